"""The spec `fsdpclip init` writes: a model, its data (webdataset shards or synthetic batches) and the GPUs
of this machine, with settings that pass `validate`, what each of them means and why it is not the spec's
default where it is not."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from fsdpclip.jobspec.job import Job, OptimizerSpec
from fsdpclip.jobspec.jobfile import block_of, spelled_default

SYNTHETIC_STEPS = 100  # a run on synthetic batches: long enough to see the speed settle
LR_FINE_TUNING = 1e-5  # a published model's fine-tuning; from scratch, the spec's default
WARMUP_SHARE, MAX_WARMUP = 20, 2000  # warmup: a twentieth of the steps, at most 2,000

# Why `starter_spec` writes a value other than the spec's default, for each field where it may.
WHY_NOT_DEFAULT = {
    "run.name": "named after the model (and its published weights)",
    "fsdp.param_dtype": "the CPU trains in fp32",
    "optimizer.lr": "published weights are fine-tuned at a lower rate",
    "schedule.warmup_steps": f"a twentieth of the run's steps (at most {MAX_WARMUP:,}): the peak rate from the "
                             "first step can diverge",
    "launch.gpus_per_node": "the GPUs this machine sees",
    "launch.device": "this machine sees no GPU",
}


def starter_spec(name: str, gpus: int, data: Optional[str] = None, samples: Optional[int] = None,
                 pretrained: Optional[str] = None, per_gpu: Optional[int] = None, epochs: int = 1) -> dict:
    """A job spec as a dict: `name` trained (or fine-tuned from the published `pretrained`) on `gpus` GPUs of
    one node (the CPU with one rank when there are none) over the shards `data` of `samples` pairs, or on
    synthetic batches."""
    on_cpu = gpus == 0
    ranks = max(1, gpus)
    per_gpu = per_gpu or (8 if on_cpu else 128)
    optimizer = OptimizerSpec()  # its defaults: open_clip_train's
    if data is None:
        source, steps, length = {"source": "synthetic"}, SYNTHETIC_STEPS, {"steps": SYNTHETIC_STEPS}
    else:
        source, length = {"source": "webdataset", "urls": data, "samples": samples}, {"epochs": epochs}
        assert samples is not None, "shards come with their samples"
        steps = samples * epochs // (per_gpu * ranks)
    return {
        "run": {"name": f"{name.lower()}{'-' + pretrained if pretrained else ''}", "output_dir": "runs", "seed": 0},
        "model": {"name": name, **({"pretrained": pretrained} if pretrained else {})},
        "fsdp": {"param_dtype": "fp32" if on_cpu else "bf16", "reduce_dtype": "fp32"},
        "optimizer": {"lr": LR_FINE_TUNING if pretrained else optimizer.lr, "weight_decay": optimizer.weight_decay},
        "schedule": {"kind": "cosine", "warmup_steps": max(1, min(MAX_WARMUP, steps // WARMUP_SHARE)), **length},
        "data": source,
        "batch": {"per_gpu": per_gpu},
        "launch": {"nodes": 1, "gpus_per_node": ranks, "device": "cpu" if on_cpu else "cuda"},
    }


def described_fields(spec: dict) -> list[tuple[str, Any, str, Optional[str]]]:
    """(dotted field, value, its description in the spec, why it is not the spec's default: None where it is, or
    where the spec has none) for every value set in `spec`."""
    rows = []

    def walk(node: dict, model: type[BaseModel], prefix: str) -> None:
        for key, value in node.items():
            field = model.model_fields.get(key)
            inner = block_of(model, key, value)
            if inner is not None:
                walk(value, inner, f"{prefix}{key}.")
            else:
                rows.append((prefix + key, value, field.description if field is not None else "",
                             _why_not_default(prefix + key, value, field)))

    walk(spec, Job, "")
    return rows


def _why_not_default(path: str, value: Any, field) -> Optional[str]:
    """Why `value` is not the field's default (WHY_NOT_DEFAULT), or None where it is, or where the field's default
    is unset (null) or it has none."""
    if field is None or field.is_required():
        return None
    default = to_jsonable_python(field.get_default(call_default_factory=True))
    if default is None or default == value:
        return None
    return f"not the default {spelled_default(field)}: {WHY_NOT_DEFAULT[path]}"
