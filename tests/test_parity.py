"""The parity matrix: every spec option that changes training math, on 2 CPU ranks (HSDP's on 4), against the plain
single-process reference of tests/reference.py (OpenCLIP's own model, losses, schedule and accum_freq
logic, torch's AdamW, clipping and GradScaler).

All cases train in one torchrun process group (tests/workers/parity.py); each is compared step by step
(losses and gradient norms) and by its final weights, with tolerances that a missing step, a wrong
weight decay or a missing clip would exceed many times over (`test_tolerances_can_fail` proves it).
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch

from conftest import TINY_CONFIG
from ranks import torchrun
from reference import open_clip_main_lr_scales, open_clip_model, open_clip_train_no_decay, reference_run

pytestmark = pytest.mark.slow  # torchrun process groups

SEED, WORLD, PER_GPU, STEPS = 7, 2, 8, 6
# fp32: the same arithmetic up to summation order (measured: losses within 2e-6, gradient norms 5e-6
# relative). Weights are compared per tensor as |trained - reference| / |reference - initial|: rounding
# noise stays under 4e-3 of a tensor's movement (Adam's normalisation amplifies near-zero gradients,
# such as rarely seen token embeddings'), while one step fewer, no weight decay or no clipping moves
# some tensor by over 0.13 (`test_tolerances_can_fail`).
FP32 = {"loss": 1e-5, "norm": 2e-5, "weights": 1e-2}
# bf16/fp16: step 1 starts from the same weights, so its loss and gradient norm agree closely (a bf16
# temperature alone moves step 1's loss by 2.6e-3; a bf16 instead of an fp32 reduction moves its norm
# by ~1e-3); after that, one rounding flip grows into noise: a 1e-7 change of one initial tensor moves
# the reference's 6-step losses by up to 3e-3 and its weights by 0.2 of their movement, and the
# trainer's bf16 reduction (gloo's order of sums) lands up to 1e-2 away, so later steps are held to
# that noise and the weights are not compared; dtype-specific behaviour has direct tests (the
# temperature's dtype, the overflow step).
LOW = {"first_loss": 2e-5, "first_norm": 1e-4, "loss": 3e-2, "norm": 1e-1}


def default_decay(wd: float):
    return lambda name, param: 0.0 if open_clip_train_no_decay(name, param) else wd


def custom_decay(name: str, param: torch.Tensor) -> float:
    """The `decay_rules` of the 'decay-rules' case: the image projection 0.0, the first text block 0.05,
    any other tensor of < 2 dims 0.0, the rest 0.5."""
    if name == "visual.proj":
        return 0.0
    if name.startswith("transformer.resblocks.0."):
        return 0.05
    return 0.0 if param.ndim < 2 else 0.5


def frozen_parts(name: str) -> bool:
    """freeze {image: blocks '0:-1' + embeddings, text: blocks ':' + head, logit_scale}, written out for
    the tiny model (2 image blocks, 2 text blocks)."""
    if name.startswith("visual.transformer.resblocks."):
        return int(name.split(".")[3]) < 1
    if name.startswith("visual."):
        return bool(re.search(r"conv1|class_embedding|positional_embedding|ln_pre", name))
    if name.startswith("transformer.resblocks."):
        return True
    return name in ("ln_final.weight", "ln_final.bias", "text_projection", "logit_scale")


def frozen_image_embeddings(name: str) -> bool:
    """freeze {image: embeddings}, written out."""
    return name.startswith("visual.") and bool(re.search(r"conv1|class_embedding|positional_embedding|ln_pre", name))


def main_lr_scales(job, model) -> dict:
    """OpenCLIP main's layer-wise LR scales for the spec's layer decay (tests/reference.py)."""
    return open_clip_main_lr_scales(model, job.optimizer.layer_decay.image, job.optimizer.layer_decay.text)


CASES = {  # name -> (job overrides, low precision?, decay, frozen, poisoned (step, rank))
    "fp32": ({}, False, None, None, None),
    "auto-units-no-reshard-wrap": ({"fsdp": {"unit_size": "auto", "reshard_after_forward": False,
                                             "wrap": {"text": ["Transformer"]}}}, False, None, None, None),
    "grad-accum": ({"batch": {"per_gpu": PER_GPU // 2, "grad_accum": 2}}, False, None, None, None),
    "clip-global-loss": ({"loss": {"local_loss": False}}, False, None, None, None),
    "clip-local-no-grad-gather": ({"loss": {"gather_with_grad": False}}, False, None, None, None),
    "clip-global-no-grad-gather": ({"loss": {"local_loss": False, "gather_with_grad": False}}, False, None, None,
                                   None),
    **{f"siglip-{exchange}": ({"loss": {"kind": "siglip", "exchange": exchange}}, False, None, None, None)
       for exchange in ("bidir", "shift", "reduce", "gather")},
    "siglip-grad-accum": ({"loss": {"kind": "siglip"}, "batch": {"per_gpu": PER_GPU // 2, "grad_accum": 2}},
                          False, None, None, None),
    "freeze": ({"freeze": {"image": {"blocks": "0:-1", "embeddings": True}, "text": {"blocks": ":", "head": True},
                           "logit_scale": True}}, False, None, frozen_parts, None),
    "decay-rules": ({"optimizer": {"decay_rules": [
        {"pattern": r"^visual\.proj$", "weight_decay": 0.0},
        {"pattern": r"^transformer\.resblocks\.0\.", "weight_decay": 0.05},
        {"max_ndim": 1, "weight_decay": 0.0}]}}, False, custom_decay, None, None),
    "layer-decay": ({"optimizer": {"layer_decay": {"image": 0.5, "text": 0.7}, "decay_rules": [
        {"pattern": r"^visual\.proj$", "weight_decay": 0.0},
        {"pattern": r"^transformer\.resblocks\.0\.", "weight_decay": 0.05},
        {"max_ndim": 1, "weight_decay": 0.0}]}, "freeze": {"image": {"embeddings": True}}},
                    False, custom_decay, frozen_image_embeddings, None),
    "no-clip-constant-lr": ({"optimizer": {"grad_clip_norm": None}, "schedule": {"kind": "constant"}},
                            False, None, None, None),
    "cosine-floor": ({"schedule": {"min_lr": 5e-4}}, False, None, None, None),
    "cpu-offload": ({"fsdp": {"cpu_offload": True}}, False, None, None, None),
    "compile": ({"fsdp": {"compile": True}}, False, None, None, None),  # through aot_eager: see docs/options.md
    "compile-whole-towers": ({"fsdp": {"compile": True, "wrap": {"image": ["Transformer"], "text": ["Transformer"]},
                                       "reshard_after_forward": False}}, False, None, None, None),  # aot_eager too
    "activation-checkpointing": ({"fsdp": {"activation_checkpointing": {"image": True, "text": ["ResidualAttentionBlock"]}}},
                                 False, None, None, None),
    "bf16": ({"fsdp": {"param_dtype": "bf16"}}, True, None, None, None),
    "bf16-reduce-bf16": ({"fsdp": {"param_dtype": "bf16", "reduce_dtype": "bf16"}}, True, None, None, None),
    "fp16-scaler-overflow": ({"fsdp": {"param_dtype": "fp16", "grad_scaler": {"init_scale": 1024.0,
                                                                            "growth_interval": 2}}},
                             True, None, None, (3, 1)),
    "resampled-data": ({"data": "resampled"}, False, None, None, None),
    # HSDP on 4 ranks (tests/workers/parity.py in a second, 4-rank process group)
    "hsdp-2x2": ({"fsdp": {"shard_degree": 2}, "launch": {"gpus_per_node": 4}}, False, None, None, None),
    "replicate-4-grad-accum": ({"fsdp": {"shard_degree": 1}, "launch": {"gpus_per_node": 4},
                                "batch": {"per_gpu": PER_GPU // 2, "grad_accum": 2}}, False, None, None, None),
    "hsdp-2x2-freeze-offload": ({"fsdp": {"shard_degree": 2, "cpu_offload": True}, "launch": {"gpus_per_node": 4},
                                 "freeze": {"image": {"blocks": "0:-1", "embeddings": True},
                                            "text": {"blocks": ":", "head": True}, "logit_scale": True}},
                                False, None, frozen_parts, None),
}


def world_of(name: str) -> int:
    return CASES[name][0].get("launch", {}).get("gpus_per_node", WORLD)


def _merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def siglip_config(tmp_path) -> str:
    """The tiny model with SigLIP's learned bias and starting temperature."""
    path = tmp_path / "tiny-siglip.json"
    path.write_text(json.dumps(json.loads(TINY_CONFIG.read_text()) | {"init_logit_scale": math.log(10),
                                                                     "init_logit_bias": -10.0}))
    return str(path)


def case_job(name: str, tmp_path, digits_dir) -> dict:
    overrides = CASES[name][0]
    job = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": SEED},
        "model": {"config": siglip_config(tmp_path) if "siglip" in name else str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32", "reduce_dtype": "fp32", "unit_size": 1},
        "optimizer": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.5, "grad_clip_norm": 1.0},
        "schedule": {"kind": "cosine", "warmup_steps": 2, "steps": STEPS},
        "data": {"source": "synthetic"},
        "batch": {"per_gpu": PER_GPU},
        "checkpoint": {"resume": None, "at_end": False},
        "launch": {"gpus_per_node": WORLD, "device": "cpu", "collective_timeout_s": 60},
    }
    if overrides.get("data") == "resampled":
        overrides = {k: v for k, v in overrides.items() if k != "data"}
        job["data"] = {"urls": str(digits_dir / "train-{000000..000007}.tar"), "samples": 1438, "resampled": True,
                       "workers": 2, "shuffle_buffer": 20}
    return _merge(job, overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, digits_dir):
    """Every case trained by the real trainer, those of each world size in one torchrun:
    name -> (job, results)."""
    tmp = tmp_path_factory.mktemp("parity")
    results = {}
    for world in sorted({world_of(name) for name in CASES}):
        names = [name for name in CASES if world_of(name) == world]
        cases = {name: {"job": case_job(name, tmp, digits_dir), "poison": CASES[name][4],
                        "compile_backend": "aot_eager" if name.startswith("compile") else None} for name in names}
        (tmp / f"cases-{world}.json").write_text(json.dumps(cases))
        proc = torchrun(["tests/workers/parity.py", str(tmp / f"cases-{world}.json"), str(tmp)], nproc=world,
                        timeout=600)
        assert proc.returncode == 0, proc.stdout[-6000:]
        results.update({name: (cases[name]["job"], torch.load(tmp / f"{name}.pt", weights_only=False))
                        for name in names})
    return results


def batch_source(job, rank_count: int):
    """The micro batches each rank's data source gives, read in this process: (rank, index) -> batch."""
    from fsdpclip.data.batches import WebDatasetBatches
    from fsdpclip.data.sources.synthetic import SyntheticBatches
    from fsdpclip.data.stream import ShardStream

    if job.data.source == "synthetic":
        sources = [SyntheticBatches((3, 32, 32), 16, 49408, job.batch.per_gpu, torch.device("cpu"), job.run.seed,
                                    rank) for rank in range(rank_count)]
        return lambda rank, index: sources[rank].batch(index)
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2

    transform = image_transform_v2(PreprocessCfg(size=32), is_train=True)
    tokenizer = open_clip.SimpleTokenizer(context_length=16)
    streams = [iter(WebDatasetBatches(ShardStream(job.data, transform, tokenizer, job.batch.per_gpu, rank, rank_count,
                                                  job.run.seed), job.data.workers, pin_memory=False))
               for rank in range(rank_count)]
    seen: list[list] = [[] for _ in range(rank_count)]

    def batch(rank: int, index: int):
        while len(seen[rank]) <= index:
            seen[rank].append(next(streams[rank]))
        return seen[rank][index]

    return batch


def reference_for(name: str, job_dict: dict, steps: int = STEPS, **changes):
    """The reference run of a case (`changes` alter the spec, to show what a mistake would cost)."""
    from fsdpclip.jobspec.jobfile import parse_job

    job = parse_job(_merge(job_dict, changes))
    _, _, decay, frozen, poison = CASES[name]
    model = open_clip_model(job.model.config, SEED)
    world = world_of(name)
    return reference_run(job, model, world, batch_source(job, world), frozen or (lambda _: False),
                         decay or default_decay(job.optimizer.weight_decay), steps, poison, main_lr_scales(job, model))


def relative_difference(state: dict, reference, initial: dict) -> tuple[float, str]:
    """The largest |trained - reference| / |reference - initial| over the tensors that moved, and which."""
    worst = (0.0, "")
    for key, value in reference.state.items():
        moved = (value - initial[key]).norm()
        if moved > 0:
            worst = max(worst, (((state[key].reshape(value.shape) - value).norm() / moved).item(), key))
    return worst


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_reference(name, trained):
    job_dict, result = trained[name]
    initial = open_clip_model(job_dict["model"]["config"], SEED).state_dict()
    for key, value in result["initial"].items():  # the same seed gives OpenCLIP's own initial weights
        assert torch.equal(value.reshape(initial[key].shape), initial[key]), key
    reference = reference_for(name, job_dict)
    losses, norms = result["losses"], result["norms"]
    assert len(losses) == STEPS
    finite = [i for i, n in enumerate(reference.norms) if math.isfinite(n)]
    assert all(not math.isfinite(norms[i]) for i in range(STEPS) if i not in finite)
    tolerance = LOW if CASES[name][1] else FP32
    if CASES[name][1]:
        assert losses[0] == pytest.approx(reference.losses[0], abs=LOW["first_loss"]), "step 1 loss"
        assert norms[0] == pytest.approx(reference.norms[0], rel=LOW["first_norm"]), "step 1 gradient norm"
    assert losses == pytest.approx(reference.losses, abs=tolerance["loss"]), "losses"
    assert [norms[i] for i in finite] == pytest.approx([reference.norms[i] for i in finite], rel=tolerance["norm"])
    if not CASES[name][1]:
        worst, key = relative_difference(result["state"], reference, initial)
        assert worst < FP32["weights"], f"{key}: {worst} of its movement"
    assert result["scale"] == reference.scale
    assert result["temperature_fp32"]


@pytest.mark.parametrize("name", ["freeze", "decay-rules", "layer-decay"])
def test_decay_groups_and_encoders(name, trained):
    """The optimizer's groups hold exactly the trainable parameters, each with the decay the rules give
    (computed on OpenCLIP's names and shapes) and OpenCLIP main's layer-wise LR scale; encode_image/encode_text
    work on the sharded model outside forward and equal OpenCLIP's own model with the trained weights."""
    job_dict, result = trained[name]
    _, _, decay, frozen, _ = CASES[name]
    plain = open_clip_model(job_dict["model"]["config"], SEED)
    trainable = {n: p for n, p in plain.named_parameters() if not (frozen or (lambda _: False))(n)}
    decay = decay or default_decay(job_dict["optimizer"]["weight_decay"])
    grouped = {n: g["weight_decay"] for g in result["groups"] for n in g["names"]}
    assert sorted(grouped) == sorted(trainable)
    assert grouped == {n: decay(n, p) for n, p in trainable.items()}
    from fsdpclip.jobspec.jobfile import parse_job

    scales = main_lr_scales(parse_job(job_dict), plain)
    assert {n: g["lr_scale"] for g in result["groups"] for n in g["names"]} == {n: scales[n] for n in trainable}
    plain.load_state_dict({k: v.reshape(plain.state_dict()[k].shape) for k, v in result["state"].items()})
    plain.eval()
    torch.manual_seed(123)
    with torch.no_grad():
        assert torch.allclose(result["encode_image"], plain.encode_image(torch.randn(5, 3, 32, 32)), atol=1e-5)
        assert torch.allclose(result["encode_text"], plain.encode_text(torch.randint(1, 1000, (3, 16))), atol=1e-5)


def test_tolerances_can_fail(trained):
    """What a missing step, no weight decay or no clipping does to the fp32 case's weights: far beyond
    the tolerance (so the comparison above can fail)."""
    job_dict, result = trained["fp32"]
    initial = open_clip_model(job_dict["model"]["config"], SEED).state_dict()
    reference = reference_for("fp32", job_dict)
    assert max(reference.norms) > job_dict["optimizer"]["grad_clip_norm"]  # clipping was active
    mistakes = {
        "one step fewer": reference_for("fp32", job_dict, steps=STEPS - 1),
        "no weight decay": reference_for("fp32", job_dict, optimizer={"weight_decay": 0.0}),
        "no clipping": reference_for("fp32", job_dict, optimizer={"grad_clip_norm": None}),
    }
    for mistake, wrong in mistakes.items():
        worst, _ = relative_difference(result["state"], wrong, initial)
        assert worst > 10 * FP32["weights"], f"{mistake} changes the weights by only {worst} of their movement"


def test_overflow_step_changes_nothing_on_any_rank(trained):
    """fp16: the step whose loss overflowed on rank 1 left every weight and every optimizer moment and
    step count unchanged on both ranks, and the loss scale halved."""
    _, result = trained["fp16-scaler-overflow"]
    assert result["poisoned_step_unchanged"] is True
    assert result["scale_before_poison"] / 2 == result["scale_after_poison"]
