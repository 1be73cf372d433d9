"""The spec `fsdpclip init` writes: a model, its data (webdataset shards or synthetic batches) and the GPUs
of this machine, with settings that pass `validate`, and what each of them means."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel

from fsdpclip.spec.job import Job
from fsdpclip.spec.jobfile import block_of

SYNTHETIC_STEPS = 100  # a run on synthetic batches: long enough to see the speed settle
LR_FROM_SCRATCH, LR_FINE_TUNING = 5e-4, 1e-5  # AdamW peaks: OpenCLIP's ViT-B-32 recipe; a published model's fine-tuning
MAX_WORKERS = 8


def starter_spec(name: str, gpus: int, cores: int, data: Optional[str] = None, samples: Optional[int] = None,
                 pretrained: Optional[str] = None, per_gpu: Optional[int] = None, epochs: int = 1) -> dict:
    """A job spec as a dict: `name` trained (or fine-tuned from the published `pretrained`) on `gpus` GPUs of
    one node (the CPU with one rank when there are none) over the shards `data` of `samples` pairs, or on
    synthetic batches; data workers shared out over the `cores`."""
    on_cpu = gpus == 0
    ranks = max(1, gpus)
    per_gpu = per_gpu or (8 if on_cpu else 128)
    if data is None:
        source = {"source": "synthetic"}
        schedule = {"kind": "cosine", "warmup_steps": SYNTHETIC_STEPS // 10, "steps": SYNTHETIC_STEPS}
    else:
        workers = max(1, min(MAX_WORKERS, cores // ranks))
        source = {"source": "webdataset", "urls": data, "samples": samples, "workers": workers}
        steps = (samples or 0) * epochs // (per_gpu * ranks)
        schedule = {"kind": "cosine", "warmup_steps": max(1, min(2000, steps // 20)), "epochs": epochs}
    return {
        "run": {"name": f"{name.lower()}{'-' + pretrained if pretrained else ''}", "output_dir": "runs", "seed": 0},
        "model": {"name": name, **({"pretrained": pretrained} if pretrained else {})},
        "fsdp": {"param_dtype": "fp32" if on_cpu else "bf16", "reduce_dtype": "fp32"},
        "optimizer": {"lr": LR_FINE_TUNING if pretrained else LR_FROM_SCRATCH, "weight_decay": 0.1},
        "schedule": schedule,
        "data": source,
        "batch": {"per_gpu": per_gpu},
        "launch": {"nodes": 1, "gpus_per_node": ranks, "device": "cpu" if on_cpu else "cuda"},
    }


def described_fields(spec: dict) -> list[tuple[str, Any, str]]:
    """(dotted field, value, its description in the spec) for every value set in `spec`."""
    rows = []

    def walk(node: dict, model: type[BaseModel], prefix: str) -> None:
        for key, value in node.items():
            field = model.model_fields.get(key)
            inner = block_of(model, key, value)
            if inner is not None:
                walk(value, inner, f"{prefix}{key}.")
            else:
                rows.append((prefix + key, value, field.description if field is not None else ""))

    walk(spec, Job, "")
    return rows
