"""The optimizer, the LR schedules, the loss scaler, gradient clipping (on DTensors, in a process of its own) and the
initial weights."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from conftest import REPO, TINY_CONFIG
from ranks import json_result
from fsdpclip.jobspec.job import ModelSpec, ScheduleSpec
from fsdpclip.optim.adamw import Schedule, ShardedAdamW, squared_norm


def _adam_state(optimizer, param) -> list[torch.Tensor]:
    state = optimizer.state[param]
    return [state[k].clone() for k in ("exp_avg", "exp_avg_sq", "step")]


@pytest.mark.slow
@pytest.mark.parametrize("flag", [1.0, 2.0], ids=["one-rank", "summed-over-two-ranks"])
def test_overflow_skips_the_step_under_a_grad_scaler(flag):
    """An inf gradient under the fp16 loss scaler: the weights and AdamW's moments and step count stay
    as they were, as torch's own fused AdamW keeps them (the scaler hands the flag to the optimizer;
    ShardedGradScaler's flag is a sum over ranks, 2 here)."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = ShardedAdamW([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for grad in (torch.full((4,), 0.5), torch.tensor([float("inf"), 1.0, 1.0, 1.0])):
        before, state = param.detach().clone(), optimizer.state.get(param) and _adam_state(optimizer, param)
        scaler.scale((param * grad).sum()).backward()
        scaler.unscale_(optimizer)
        if not torch.isfinite(grad).all():
            for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                found.fill_(flag)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert torch.equal(param.detach(), before), "an overflow step changed the weights"
    assert all(torch.equal(a, b) for a, b in zip(_adam_state(optimizer, param), state)), "it changed AdamW's state"
    assert scaler.get_scale() == 512.0


def test_moments_allocated_ahead_change_no_step():
    """`allocate_state` (the batch search's probes hold the moments through forward and backward, as training
    does after its first step) allocates what the first step would, and the steps after are the same."""
    torch.manual_seed(0)
    grads = [torch.randn(3, 5) for _ in range(3)]
    params, optimizers = [], []
    for ahead in (False, True):
        param = torch.nn.Parameter(torch.ones(3, 5))
        optimizer = ShardedAdamW([param], lr=0.1, weight_decay=0.1)
        if ahead:
            optimizer.allocate_state()
            assert [t.count_nonzero().item() for t in _adam_state(optimizer, param)] == [0, 0, 0]
            assert _adam_state(optimizer, param)[0].shape == param.shape
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        params.append(param)
        optimizers.append(optimizer)
    assert torch.equal(params[0].detach(), params[1].detach())
    assert all(torch.equal(a, b) for a, b in zip(*(_adam_state(o, p) for o, p in zip(optimizers, params))))


def test_initial_weights_do_not_depend_on_threads(monkeypatch):
    """The initial model is OpenCLIP's own init for the seed, bit for bit, whatever threads build it
    (rank 0 builds it with all the cores it may use)."""
    import json
    import os

    import open_clip

    from fsdpclip.model.weights import initial_model

    spec = ModelSpec(config=str(TINY_CONFIG))
    many = initial_model(spec, seed=5, init="openclip").state_dict()
    threads = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    try:
        torch.set_num_threads(1)
        one = initial_model(spec, seed=5, init="openclip").state_dict()
    finally:
        torch.set_num_threads(threads)
    torch.manual_seed(5)
    reference = open_clip.CLIP(**json.loads(TINY_CONFIG.read_text())).state_dict()
    for key, value in reference.items():
        assert torch.equal(one[key].reshape(value.shape), value) and torch.equal(many[key], one[key]), key


# clip_gradients on DTensor gradients in a world of one (a process of its own: it forms a process group).
_CLIP = """
import json, torch
from torch.distributed.tensor import Shard, _api, distribute_tensor
from fsdpclip.parallel.distributed import init_distributed
from fsdpclip.optim.adamw import clip_gradients

env = init_distributed("cpu", 60)
torch.manual_seed(0)
plain = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(()))]
for p in plain:
    p.grad = torch.randn_like(p) * 3
sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), env.mesh, [Shard(0)])) for p in plain[:3]]
for p, q in zip(sharded, plain):
    p.grad = distribute_tensor(q.grad.clone(), env.mesh, [Shard(0)])
replicated = torch.nn.Parameter(plain[3].detach().clone())
replicated.grad = plain[3].grad.clone()
calls, apply = [], _api._ToTorchTensor.apply
_api._ToTorchTensor.apply = lambda *a, **k: calls.append(1) or apply(*a, **k)
norm = clip_gradients(sharded + [replicated], max_norm=1.0)
want = torch.nn.utils.clip_grad_norm_(plain, max_norm=1.0)
print(json.dumps({"norm": norm.item(), "want": want.item(), "autograd_calls": len(calls),
                  "clipped": all(torch.allclose(p.grad.to_local(), q.grad) for p, q in zip(sharded, plain[:3]))}))
"""


@pytest.mark.slow
def test_clip_gradients_matches_torch_and_stays_off_autograd():
    """The global norm and the clipped DTensor gradients equal torch's clip_grad_norm_ on plain tensors,
    and no gradient goes through DTensor.to_local's autograd function (host time in every step)."""
    seen = json_result([sys.executable, "-c", _CLIP], timeout=120)
    assert abs(seen["norm"] - seen["want"]) < 1e-4 * seen["want"] and seen["want"] > 1.0
    assert seen["clipped"]
    assert seen["autograd_calls"] == 0


T5_TINY = REPO / "tests" / "assets" / "t5-tiny"
BERT_TINY = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 40}


def _family_config(family: str, tmp_path) -> dict:
    """An OpenCLIP model config of each tower family layer decay covers: OpenCLIP's own configs where they build
    fast on the meta device, the tiny model with a Hugging Face text tower (T5: a final norm in no group; BERT: a
    pooler, in the head) for the rest."""
    import open_clip

    tiny = json.loads(TINY_CONFIG.read_text())
    if family in ("clip", "custom-text-clip"):
        return tiny | ({"custom_text": True} if family == "custom-text-clip" else {})
    if family.startswith("hf-"):
        path = T5_TINY
        if family == "hf-bert":
            path = tmp_path / "bert"
            path.mkdir()
            (path / "config.json").write_text(json.dumps(BERT_TINY))
        return tiny | {"text_cfg": {"hf_model_name": str(path), "hf_model_pretrained": False,
                                    "hf_proj_type": "mlp", "hf_pooler_type": "cls_pooler"}}
    return open_clip.get_model_config(family)


@pytest.mark.parametrize("family", ["clip", "custom-text-clip", "RN50", "convnext_base", "ViT-B-16-SigLIP",
                                    "EVA02-B-16", "hf-t5", "hf-bert"])
@pytest.mark.parametrize("image,text", [(0.75, 0.7), (None, 1.0)])
def test_layer_lr_scales_are_open_clip_mains(family, image, text, tmp_path):
    """optimizer.layer_decay gives each parameter the scale OpenCLIP main's layer groups give it (its code is copied
    in tests/reference.py), for every tower family: OpenCLIP's ViT and text tower (on CLIP and under
    `model.text`), ModifiedResNet (its stem, 4 stages and attention pool), timm trunks (timm's own group_matcher,
    then OpenCLIP's head) and Hugging Face text towers; the temperature keeps 1."""
    from reference import open_clip_main_lr_scales

    from fsdpclip.model.build import model_from_config
    from fsdpclip.model.trainable import layer_lr_scales
    from fsdpclip.jobspec.job import LayerDecaySpec

    model = model_from_config(_family_config(family, tmp_path), device="meta")
    scales = layer_lr_scales(model, LayerDecaySpec(image=image, text=text))
    expected = open_clip_main_lr_scales(model, image, text)
    assert {name: scales.get(name, 1.0) for name in expected} == expected
    assert expected["logit_scale"] == 1.0
    if family == "clip" and image is not None:  # the tiny model's 2 blocks: embeddings, 2 layers below the top
        assert len(set(expected.values())) == 1 + 3 + 3
    if family == "RN50" and image is not None:  # the stem 4 stages below the attention pool
        assert expected["visual.conv1.weight"] == 0.75 ** 5 and expected["visual.attnpool.positional_embedding"] == 1


def test_layer_decay_is_refused_where_main_has_no_groups(tmp_path):
    """A timm trunk without a group_matcher (PoolFormer's MetaFormer) has no layer groups in OpenCLIP main: validate refuses layer decay
    on it in one located line; without layer decay the same job validates."""
    from fsdpclip.jobspec.jobfile import load_job
    from fsdpclip.validate.checks import check_job

    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"run": {"name": "x", "output_dir": str(tmp_path)},
                                "model": {"config": str(TINY_CONFIG), "image": {"timm": {"name": "poolformer_s12"}}},
                                "data": {"source": "synthetic"}, "schedule": {"steps": 2}, "batch": {"per_gpu": 2},
                                "launch": {"gpus_per_node": 1, "device": "cpu"}}))
    errors = check_job(load_job(spec, ["optimizer.layer_decay.image=0.6"]), check_paths=False).errors
    assert [(e.location, e.message, e.value) for e in errors] == [
        ("optimizer.layer_decay.image", "OpenCLIP main has no layer groups for this image tower "
                                        "(MetaFormer)", 0.6)]
    assert not check_job(load_job(spec, []), check_paths=False).errors


def test_layer_decay_is_checked(tmp_path):
    """A decay outside (0, 1] is refused at its location."""
    from fsdpclip.jobspec.problems import SpecError
    from fsdpclip.jobspec.jobfile import load_job

    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"run": {"name": "x", "output_dir": str(tmp_path)}, "model": {"config": str(TINY_CONFIG)},
                                "data": {"source": "synthetic"}, "schedule": {"steps": 2}, "batch": {"per_gpu": 2},
                                "launch": {"gpus_per_node": 1, "device": "cpu"}}))
    with pytest.raises(SpecError) as refused:
        load_job(spec, ["optimizer.layer_decay.image=0", "optimizer.layer_decay.text=1.5"])
    assert {p.location for p in refused.value.problems} == {"optimizer.layer_decay.image", "optimizer.layer_decay.text"}


def test_squared_norm_on_the_host_sums_every_square(monkeypatch):
    """The host path (a dot per tensor, not torch's get_total_norm: slow on the host, docs/performance.md) counts
    every element of tensors of any shape, dtype and size, empty too."""
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", lambda *a, **k: pytest.fail("get_total_norm on the host"))
    torch.manual_seed(3)
    tensors = [torch.randn(1000) * 5, torch.randn(7, 3).bfloat16(), torch.randn(4, 5).t(), torch.empty(0)]
    want = sum(t.double().square().sum() for t in tensors).item()
    got = squared_norm(tensors, torch.device("cpu"))
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(got.item() - want) < 1e-5 * want
    assert squared_norm([], torch.device("cpu")).item() == 0


def _lrs(spec: ScheduleSpec, total: int, peak: float = 1e-3) -> list[float]:
    """The LR that `Schedule` sets on the optimizer's group at each step of a run of `total` steps."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    schedule, lrs = Schedule(optimizer, spec, peak, total), []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    return lrs


@pytest.mark.parametrize("steps, warmup, decay, power, end", [
    (20, 3, {"decay_steps": 7}, 1.0, 0.0), (20, 0, {"decay_steps": 20}, 2.0, 1e-5),
    (37, 5, {"decay_steps": 1}, 0.5, 1e-4), (36, 4, {"decay_epochs": 1}, 1.5, 2e-4)])
def test_const_cooldown_is_open_clip_trains(steps, warmup, decay, power, end):
    """const-cooldown sets open_clip_train's `const_lr_cooldown` LRs at every step (its --epochs-cooldown as
    `decay_epochs`: here the last of 4 epochs of 9 steps), its power and end LR as `decay_power` and `min_lr`."""
    from open_clip_train.scheduler import const_lr_cooldown

    length = {"epochs": 4} if "decay_epochs" in decay else {"steps": steps}
    spec = ScheduleSpec(kind="const-cooldown", warmup_steps=warmup, decay_power=power, min_lr=end, **length, **decay)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    cooldown = decay.get("decay_steps", steps // 4)
    theirs = const_lr_cooldown(optimizer, 1e-3, warmup, steps, cooldown, power, end)
    assert _lrs(spec, steps) == pytest.approx([theirs(step) for step in range(steps)], rel=1e-12, abs=1e-18)


def test_wsd_holds_the_peak_then_decays_in_its_shape():
    """wsd: the linear warmup, the peak LR, then over the run's last steps (`decay_fraction` of them here) torchtitan's
    shapes of the progress p from 1 to `min_lr`: 1 - p, (1 + cos πp) / 2, 1 - √p, steps counted as const-cooldown
    counts them (linear wsd is const-cooldown of power 1)."""
    peak, end = 1e-3, 1e-4
    shapes = {"linear": lambda p: 1 - p, "cosine": lambda p: (1 + math.cos(math.pi * p)) / 2,
              "sqrt": lambda p: 1 - math.sqrt(p)}
    for shape, curve in shapes.items():
        spec = ScheduleSpec(kind="wsd", warmup_steps=2, steps=20, decay_fraction=0.25, decay_shape=shape, min_lr=end)
        expected = [peak * (i + 1) / 2 if i < 2 else peak if i < 15 else end + (peak - end) * curve((i - 15) / 5)
                    for i in range(20)]
        assert _lrs(spec, 20) == pytest.approx(expected, rel=1e-12), shape
    cooldown = ScheduleSpec(kind="const-cooldown", warmup_steps=2, steps=20, decay_steps=5, min_lr=end)
    assert _lrs(cooldown, 20) == pytest.approx(_lrs(ScheduleSpec(kind="wsd", warmup_steps=2, steps=20, decay_steps=5,
                                                                 min_lr=end), 20), rel=1e-12)


@pytest.mark.parametrize("decay", [{"decay_steps": 4}, {"decay_fraction": 0.25}])
def test_a_longer_wsd_run_goes_on_at_its_peak(decay):
    """Its decay anchored to the run's end, a wsd run lengthened from 16 steps to 24 has the LRs of the shorter one
    up to where that one's decay began, and decays over the new end; a cosine's curve is another one."""
    short, longer = (ScheduleSpec(kind="wsd", warmup_steps=2, steps=steps, decay_shape="sqrt", **decay)
                     for steps in (16, 24))
    start, new_start = 16 - short.decay_length(16), 24 - longer.decay_length(24)
    assert _lrs(longer, 24)[:start] == _lrs(short, 16)[:start]
    assert set(_lrs(longer, 24)[start:new_start + 1]) == {1e-3} and _lrs(longer, 24)[new_start + 1] < 1e-3
    cosine = [ScheduleSpec(warmup_steps=2, steps=steps) for steps in (16, 24)]
    assert _lrs(cosine[1], 24)[start - 1] > _lrs(cosine[0], 16)[start - 1]
