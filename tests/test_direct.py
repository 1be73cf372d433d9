"""DirectAttention and DirectPatchEmbedding compute what nn.MultiheadAttention and nn.Conv2d compute,
under the same names."""

import copy

import pytest
import torch
from torch import nn

from fsdpclip.model.fast_modules import (DirectAttention, DirectPatchEmbedding, is_patch_embedding, use_direct_attention,
                             use_direct_patch_embedding)
from fsdpclip.model.weights import initial_model
from fsdpclip.jobspec.job import ModelSpec
from conftest import TINY_CONFIG


def _pair(**kwargs):
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(32, 4, batch_first=True, **kwargs)
    direct = copy.deepcopy(plain)
    assert use_direct_attention(direct) == 1 and type(direct) is DirectAttention
    return plain, direct


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_same_outputs_and_gradients(cross, mask):
    plain, direct = _pair()
    x = torch.randn(3, 7, 32)
    kv = torch.randn(3, 5, 32) if cross else x
    attn_mask = torch.full((7, kv.shape[1]), float("-inf")).triu(1) if mask else None
    outputs = []
    for module in (plain, direct):
        out = module(x, kv, kv, need_weights=False, attn_mask=attn_mask)[0]
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outputs.append((out, module.in_proj_weight.grad, module.out_proj.weight.grad))
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert list(plain.state_dict()) == list(direct.state_dict())


def test_uncovered_calls_fall_back_to_the_original():
    plain, direct = _pair()
    x = torch.randn(2, 6, 32)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[:, -2:] = True
    for kwargs in ({"need_weights": True}, {"need_weights": False, "key_padding_mask": padding},
                   {"need_weights": False, "attn_mask": torch.ones(6, 6, dtype=torch.bool).triu(1)}):
        a, b = plain(x, x, x, **kwargs), direct(x, x, x, **kwargs)
        torch.testing.assert_close(a[0], b[0])
        assert (a[1] is None) == (b[1] is None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("size", [(32, 32), (35, 45)])  # the second leaves rows and columns the kernel drops
def test_patch_embedding_same_outputs_and_gradients(bias, size):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, kernel_size=(8, 7), stride=(8, 7), bias=bias).double()
    direct = copy.deepcopy(conv)
    assert is_patch_embedding(direct)
    direct.__class__ = DirectPatchEmbedding
    images = torch.randn(2, 3, *size, dtype=torch.float64)
    outputs = []
    for module in (conv, direct):
        x = images.clone().requires_grad_()
        out = module(x)
        tokens = out.reshape(out.shape[0], out.shape[1], -1).permute(0, 2, 1)  # OpenCLIP's flattening
        (tokens * torch.linspace(-1, 1, tokens.numel(), dtype=tokens.dtype).view_as(tokens)).sum().backward()
        outputs.append((out, tokens, x.grad, module.weight.grad) + ((module.bias.grad,) if bias else ()))
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert outputs[1][1].is_contiguous()  # the tokens are a view of the matmul's output, not a copy
    assert list(conv.state_dict()) == list(direct.state_dict())
    torch.testing.assert_close(direct(images[0]), conv(images[0]))  # unbatched: the convolution itself
    for module in (conv, direct):  # smaller than the kernel: refused, not an empty output
        with pytest.raises(RuntimeError, match="Kernel size can't be greater than actual input size"):
            module(images[:, :, :7, :])


def test_only_patch_embeddings_are_swapped():
    """Only an OpenCLIP ViT's conv1, and only where it is a patch embedding; other libraries' (timm's) and other
    convolutions stay as they are."""
    kept = [nn.Conv2d(3, 4, 3, stride=3, padding=1), nn.Conv2d(3, 4, 4, stride=2),
            nn.Conv2d(4, 4, 2, stride=2, groups=2), nn.Conv2d(3, 4, 2, stride=2, dilation=2), nn.Conv2d(3, 4, 1),
            nn.Conv1d(3, 4, 4, stride=4)]
    patches = nn.Conv2d(3, 4, 4, stride=4, padding="valid")
    assert not any(map(is_patch_embedding, kept)) and is_patch_embedding(patches)
    model = nn.Sequential(*kept, patches)
    assert use_direct_patch_embedding(model) == 0 and type(patches) is nn.Conv2d  # not in an OpenCLIP ViT
    vit = initial_model(ModelSpec(config=str(TINY_CONFIG)), seed=0, init="openclip").visual
    vit.conv1 = nn.Conv2d(3, 64, 8, stride=4)  # overlapping patches: not a patch embedding
    assert use_direct_patch_embedding(vit) == 0


def test_openclip_model_keeps_its_state_dict_and_outputs():
    model = initial_model(ModelSpec(config=str(TINY_CONFIG)), seed=0, init="openclip").eval()
    direct = copy.deepcopy(model)
    blocks = sum(type(m).__name__ == "ResidualAttentionBlock" for m in model.modules())
    assert blocks >= 2 and use_direct_attention(direct) == blocks
    assert use_direct_patch_embedding(direct) == 1 and type(direct.visual.conv1) is DirectPatchEmbedding
    size, context = model.visual.image_size, model.context_length
    images, texts = torch.randn(2, 3, *size), torch.randint(1, 100, (2, context))
    assert list(direct.state_dict()) == list(model.state_dict())
    for a, b in zip(model(images, texts), direct(images, texts)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["CLIP", "CustomTextCLIP", "CoCa", "no causal mask"])
def test_a_text_towers_causal_mask_is_passed_as_is_causal(kind, monkeypatch):
    """In OpenCLIP's text towers the causal mask becomes SDPA's is_causal (vision blocks, 3-D masks and
    towers without a causal mask keep theirs); outputs and gradients stay those of nn.MultiheadAttention."""
    import json

    import open_clip
    from torch.nn import functional as F

    config = json.loads(TINY_CONFIG.read_text())
    if kind == "no causal mask":
        config["text_cfg"]["no_causal_mask"] = True
    if kind == "CoCa":  # a class token joins the causal mask: 3-D per sample and head
        config["multimodal_cfg"] = {"width": 64, "heads": 2, "layers": 1, "context_length": 16}
        config["text_cfg"] |= {"embed_cls": True, "output_tokens": True}
        config["vision_cfg"] |= {"attentional_pool": True, "attn_pooler_heads": 2, "output_tokens": True}
    classes = {"CLIP": open_clip.CLIP, "no causal mask": open_clip.CLIP, "CustomTextCLIP": open_clip.CustomTextCLIP,
               "CoCa": open_clip.CoCa}
    torch.manual_seed(0)
    model = classes[kind](**config).eval()
    if kind == "CoCa":  # OpenCLIP 3.3 leaves the decoder's projection as torch.empty made it
        nn.init.normal_(model.text_decoder.text_projection, std=0.02)
    direct = copy.deepcopy(model)
    use_direct_attention(direct)
    text_tower = {"CLIP": direct, "no causal mask": direct}.get(kind, getattr(direct, "text", None))
    text_attention = [m for m in text_tower.transformer.modules() if isinstance(m, DirectAttention)]
    assert text_attention and all(m.mask_is_causal == (kind != "no causal mask") for m in text_attention)
    assert not any(m.mask_is_causal for m in direct.visual.modules() if isinstance(m, DirectAttention))
    if kind in ("CLIP", "CustomTextCLIP"):
        mask = text_tower.attn_mask
        torch.testing.assert_close(mask, torch.full_like(mask, float("-inf")).triu(1))  # what is_causal stands for
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((q.shape[-2], attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    images, texts = torch.randn(2, 3, 32, 32), torch.randint(1, 100, (2, 16))
    outputs = []
    for module in (model, direct):
        calls.clear()  # what the direct model's forward calls is kept
        out = module(images, texts)
        features = [o for o in (out.values() if isinstance(out, dict) else out) if torch.is_tensor(o) and o.dim()
                    and o.is_floating_point()]
        sum(f.sum() for f in features).backward()
        text = module.text if kind in ("CustomTextCLIP", "CoCa") else module
        first_attention = text.transformer.resblocks[0].attn
        outputs.append(features + [text.positional_embedding.grad, first_attention.in_proj_weight.grad])
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    causal = [c for c in calls if c[2]]
    assert all(c == (16, True, True) for c in causal)
    assert len(causal) == (len(text_attention) if kind in ("CLIP", "CustomTextCLIP") else 0)


def test_only_openclips_causal_masks_are_taken_as_causal():
    """A 2-D mask beside a `transformer` is taken as causal only in OpenCLIP's CLIP and TextTransformer, which
    build it so; elsewhere it may be anything."""
    class CLIP(nn.Module):  # OpenCLIP's name, another library's class
        pass

    tower = CLIP()
    tower.register_buffer("attn_mask", torch.zeros(4, 4))
    tower.transformer = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True))
    assert use_direct_attention(tower) == 1 and not tower.transformer[0].mask_is_causal


@pytest.mark.slow
def test_wrap_and_checkpoint_classes_are_named_as_validation_saw_them():
    """`fsdp.wrap` and `activation_checkpointing` name the classes validation sees (Conv2d, MultiheadAttention);
    the direct forwards swap those classes afterwards, so the units and checkpointed modules are planned first.
    Each unit below the root is compiled with the spec's `compile_options`."""
    import sys

    from ranks import json_result

    result = json_result([sys.executable, "tests/workers/plan_classes.py", str(TINY_CONFIG)], timeout=120)
    assert {"visual.conv1", "transformer.resblocks.0.attn"} <= set(result["direct"])
    assert "visual.conv1" in result["sharded"]
    assert result["checkpointed"] == ["transformer.resblocks.0.attn", "transformer.resblocks.1.attn"]
    assert result["compiled"] == [{"coordinate_descent_tuning": True}] * (len(result["sharded"]) - 1)


@pytest.mark.slow
def test_compile_auto_and_eager_evaluation(monkeypatch):
    """compile 'auto': whole towers (their `Transformer` as the unit, kept gathered unless the spec says
    otherwise) for OpenCLIP towers up to WHOLE_TOWER_MAX_PARAMETERS (ViT-H-14's too); in larger towers
    per block for large blocks (and where the step is CUDA-graphed: tests/test_cuda_graph.py), off for
    small ones of an eager step; off for other unit plans, on CPU and for other libraries' blocks; what the
    spec sets stays.
    Then a compiled unit module trains compiled and evaluates eager."""
    from fsdpclip.model.build import build_model, find_towers
    from fsdpclip.parallel.parallelize import COMPILE_MIN_BLOCK_TFLOP, apply_compile
    from fsdpclip.model.units import Unit, plan_units
    from fsdpclip.plan.resolved import Node, plan_for_node, unit_layout
    from fsdpclip.jobspec.job import FsdpSpec, Job, ModelSpec

    large, small = 2 * COMPILE_MIN_BLOCK_TFLOP * 1e12, COMPILE_MIN_BLOCK_TFLOP * 1e12 / 2
    b32 = build_model(ModelSpec(name="ViT-B-32"))
    b32_towers = find_towers(b32)
    h14 = build_model(ModelSpec(name="ViT-H-14"))  # a 632M-parameter image tower: whole
    h14_towers = find_towers(h14)
    big_g = build_model(ModelSpec(name="ViT-bigG-14"))  # 1.8B: too large for one unit
    big_g_towers = find_towers(big_g)

    def resolved(fsdp=FsdpSpec(), device="cuda", flops=small, model=b32, towers=b32_towers):
        """The plan's layout on 2 ranks (a step not CUDA-graphed) where a block's forward over the micro batch
        takes `flops`."""
        job = Job(**{"model": {"name": "ViT-B-32"}, "data": {"source": "synthetic"}, "batch": {"per_gpu": 1},
                     "fsdp": fsdp.model_dump(), "launch": {"device": device}})
        per_sample = flops * 3 * sum(len(tower.blocks) for tower in towers.values())
        return plan_for_node(job, model, towers, Node(2, 2, device), per_sample).layout

    per_block = resolved(flops=large, model=big_g, towers=big_g_towers)
    assert (per_block.compile, per_block.wrap["image"], per_block.reshard_after_forward) == (True, None, True)
    # Without the blocks' work only the units are decided (validate's memory estimate): whole towers, or eager.
    assert unit_layout(FsdpSpec(), b32, b32_towers, "cuda").wrap["image"] == ("Transformer",)
    assert unit_layout(FsdpSpec(), big_g, big_g_towers, "cuda").compile is False
    for flops in (small, large):  # towers this small are compiled whole, whatever their blocks' work
        whole = resolved(flops=flops)
        assert (whole.compile, whole.wrap["image"], whole.wrap["text"], whole.reshard_after_forward) == \
            (True, ("Transformer",), ("Transformer",), False)
    units = plan_units(b32, b32_towers, whole)
    assert [u.modules for u in units] == [("visual.transformer",), ("transformer",), ("",)]
    assert resolved(FsdpSpec(reshard_after_forward=True)).reshard_after_forward is True
    h14_whole = resolved(model=h14, towers=h14_towers)
    assert [u.modules for u in plan_units(h14, h14_towers, h14_whole)] == \
        [("visual.transformer",), ("transformer",), ("",)]
    for fsdp, device, model, towers in [(FsdpSpec(), "cpu", b32, b32_towers),
                                        (FsdpSpec(unit_size=2, cuda_graph=False), "cuda", b32, b32_towers),
                                        (FsdpSpec(activation_checkpointing={"image": True}), "cuda", b32, b32_towers),
                                        (FsdpSpec(cuda_graph=False), "cuda", big_g, big_g_towers)]:
        off = resolved(fsdp, device, model=model, towers=towers)
        assert (off.compile, off.wrap, off.reshard_after_forward) == (False, {"image": None, "text": None}, True)
    assert resolved(FsdpSpec(compile=True), "cpu").compile is True
    assert resolved(FsdpSpec(compile=False), flops=large).compile is False
    # Towers of other libraries' blocks stay eager under 'auto'; asked, they compile.
    timm_like = {name: type(tower)(tower.name, ("Block",), tower.blocks) for name, tower in b32_towers.items()}
    assert resolved(flops=large, towers=timm_like).compile is False
    assert resolved(FsdpSpec(compile=True), towers=timm_like).compile is True
    calls = []

    def fake_compile(fn, **options):
        assert options.get("dynamic") is False
        return lambda *a, **k: calls.append("compiled") or fn(*a, **k)

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    units = [Unit(("0",), "Linear", "image", (), 0), Unit(("",), "Sequential", None, (), 0)]
    apply_compile(model, units)
    x = torch.randn(2, 4)
    trained = model(x)
    assert calls == ["compiled"]  # the block, not the root
    model.eval()
    torch.testing.assert_close(model(x), trained)
    assert calls == ["compiled"]  # evaluation ran the eager forward
