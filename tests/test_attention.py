"""DirectAttention computes what nn.MultiheadAttention computes, under the same names."""

import copy

import pytest
import torch
from torch import nn

from fsdpclip.attention import DirectAttention, use_direct_attention
from fsdpclip.spec import ModelSpec
from fsdpclip.weights import initial_model
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


def test_openclip_model_keeps_its_state_dict_and_outputs():
    model = initial_model(ModelSpec(config=str(TINY_CONFIG)), seed=0).eval()
    direct = copy.deepcopy(model)
    blocks = sum(type(m).__name__ == "ResidualAttentionBlock" for m in model.modules())
    assert blocks >= 2 and use_direct_attention(direct) == blocks
    size, context = model.visual.image_size, model.context_length
    images, texts = torch.randn(2, 3, *size), torch.randint(1, 100, (2, context))
    assert list(direct.state_dict()) == list(model.state_dict())
    for a, b in zip(model(images, texts), direct(images, texts)):
        torch.testing.assert_close(a, b)


def test_compile_auto_and_eager_evaluation(monkeypatch):
    from fsdpclip.parallelize import COMPILE_MIN_BLOCK_TFLOP, apply_compile, resolve_compile
    from fsdpclip.shard import Unit
    from fsdpclip.spec import FsdpSpec

    large, small = 2 * COMPILE_MIN_BLOCK_TFLOP * 1e12, COMPILE_MIN_BLOCK_TFLOP * 1e12 / 2
    assert resolve_compile(FsdpSpec(), "cuda", large).compile is True
    assert resolve_compile(FsdpSpec(), "cuda", small).compile is False
    assert resolve_compile(FsdpSpec(), "cpu", large).compile is False
    assert resolve_compile(FsdpSpec(compile=True), "cpu", small).compile is True
    assert resolve_compile(FsdpSpec(compile=False), "cuda", large).compile is False
    # Towers of other libraries' blocks stay eager under 'auto', as asked they compile.
    assert resolve_compile(FsdpSpec(), "cuda", large, frozenset({"Block", "T5Block"})).compile is False
    assert resolve_compile(FsdpSpec(compile=True), "cuda", small, frozenset({"T5Block"})).compile is True
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
