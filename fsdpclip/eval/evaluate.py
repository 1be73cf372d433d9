"""A checkpoint evaluated by one eval task, as `fsdpclip eval` does it: the model a path holds (a run or
checkpoint directory of fsdpclip, an exported file, an open_clip local-dir) loaded on one process or sharded
over the ranks torchrun started, and its result as CLIP_benchmark records it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdpclip.jobspec.task import task_of

if TYPE_CHECKING:
    from fsdpclip.jobspec.job import Job

COUNTS = ("samples", "texts")  # in a set's metrics next to the scores: how many images and captions


def clip_benchmark_record(task: str, dataset: str, model: str, pretrained: str, metrics: dict) -> dict:
    """The JSON CLIP_benchmark writes for one result."""
    return {"dataset": dataset, "model": model, "pretrained": pretrained, "task": task,
            "metrics": {k: v for k, v in metrics.items() if k not in COUNTS}, "language": "en"}


WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "open_clip_pytorch_model.bin",
                "open_clip_pytorch_model.pth", "model.safetensors", "pytorch_model.bin")


@dataclass
class ModelSource:
    """A model to evaluate: its OpenCLIP config, a label, how to fill a full CPU model with its weights,
    and the sharding of the run that trained it (None: an exported file, sharded by default)."""

    config: dict
    label: str
    fill: Callable[[nn.Module], object]
    job: Optional["Job"] = None


def checkpoint_source(path: Path, model_name: Optional[str], model_config: Optional[str],
                      averaged: bool = False) -> ModelSource:
    """What `path` holds: a run or checkpoint directory of fsdpclip (`averaged`: its moving average's weights), an
    exported file, or an open_clip local-dir."""
    from fsdpclip.checkpoint.layout import CheckpointError, read_meta, required_averages, resolve_checkpoint, run_job
    from fsdpclip.checkpoint.whole import read_model_state
    from fsdpclip.model.build import model_config as spec_config
    from fsdpclip.model.weights import load_model_weights
    from fsdpclip.jobspec.problems import ModelError
    from fsdpclip.jobspec.job import ModelSpec

    path = Path(path)
    try:
        checkpoint = resolve_checkpoint(path)
    except CheckpointError:
        checkpoint = None
    if checkpoint is not None:
        if model_name is not None or model_config is not None:
            raise ModelError(f"{path} is an fsdpclip checkpoint, which names its own model: --model and "
                             "--model-config are for exported weights files")
        if averaged:
            required_averages(checkpoint)  # on every rank, before any waits for rank 0's weights
        meta = read_meta(checkpoint)
        return ModelSource(meta["model"]["open_clip_config"], meta["model"]["label"],
                           lambda model: model.load_state_dict(read_model_state(checkpoint, model, averaged)),
                           run_job(checkpoint))
    if averaged:
        raise ModelError(f"{path} is not an fsdpclip checkpoint: --ema reads the moving average a run's checkpoint "
                         "holds")
    if path.is_dir() and (path / "open_clip_config.json").is_file():
        weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
        if weights is None:
            raise ModelError(f"{path} has open_clip_config.json but none of {', '.join(WEIGHT_FILES)}")
        model_config, path = str(path / "open_clip_config.json"), weights
    elif not path.is_file():
        raise ModelError(f"{path} is not a checkpoint: expected a run or checkpoint directory, "
                         "an OpenCLIP weights file or an open_clip local-dir")
    if (model_name is None) == (model_config is None):
        raise ModelError(f"{path} is an OpenCLIP weights file: give --model NAME or --model-config FILE")
    spec = ModelSpec(name=model_name, config=model_config)
    return ModelSource(spec_config(spec), spec.label, lambda model: load_model_weights(model, str(path), spec.label))


def load_eval_model(source: ModelSource, device: torch.device, mesh, precision: str) -> nn.Module:
    """The model with its weights: plain on one process, sharded with FSDP2 over `mesh` otherwise (as the
    run that trained it was sharded, without what only training needs). Rank 0 reads the weights; the
    other ranks receive only their shards."""
    from fsdpclip.model.build import find_towers, model_from_config
    from fsdpclip.parallel.parallelize import materialize, parallelize
    from fsdpclip.plan.resolved import unit_layout
    from fsdpclip.jobspec.job import ActivationCheckpointSpec, FsdpSpec

    rank = dist.get_rank() if dist.is_initialized() else 0
    weights = None
    if rank == 0:
        weights = model_from_config(source.config, device="cpu")
        source.fill(weights)
    if mesh is None:
        assert weights is not None  # one process: rank 0's
        return weights.to(device).eval()
    model = model_from_config(source.config, device="meta")
    trained = source.job.fsdp if source.job is not None else FsdpSpec()
    fsdp = trained.model_copy(update={"param_dtype": precision, "reduce_dtype": "fp32", "compile": False,
                                      "activation_checkpointing": ActivationCheckpointSpec()})
    block_classes = source.job.model.block_classes if source.job is not None else None
    layout = unit_layout(fsdp, model, find_towers(model, block_classes), device.type)
    parallelize(model, fsdp, layout, mesh, block_classes)
    materialize(model, device, fsdp.cpu_offload, weights)
    return model.eval()


def evaluate_checkpoint(path: Path, spec, model_name: Optional[str],
                        model_config: Optional[str], precision: str, batch_size: int, workers: Optional[int],
                        progress: Callable[[str, Optional[int]], Callable[[int], None]],
                        averaged: bool = False) -> Optional[dict]:
    """The metrics of a checkpoint (`averaged`: of its moving average's weights, the record saying "weights": "ema")
    on the set `spec` describes (its task's), as CLIP_benchmark records them (with the counts of images and
    captions), on one process or sharded over the ranks torchrun started (every rank calls it; the record comes
    back on rank 0, None elsewhere).

    `progress(set name, images or None)` is called once and returns a callback taking images done."""
    import os

    from fsdpclip.model.build import build_tokenizer, image_transform
    from fsdpclip.parallel.distributed import init_distributed

    task = task_of(spec)
    source = checkpoint_source(path, model_name, model_config, averaged)
    workers = min(4, os.cpu_count() or 1) if workers is None else workers
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    env = init_distributed("cuda" if torch.cuda.is_available() else "cpu", timeout_s=1800) if distributed else None
    device = env.device if env else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = load_eval_model(source, device, env.mesh if env else None, precision)
        dataset = task.load(spec, image_transform(model, train=False))
        advance = progress(dataset.name, dataset.size)
        # One process: autocast gives bf16; sharded: FSDP's mixed precision does.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16" and env is None):
            metrics = task.measure(model, build_tokenizer(source.config), dataset, device, batch_size, workers,
                                   progress=advance)
    finally:
        if env is not None:
            dist.destroy_process_group()
    if env is not None and not env.is_main:
        return None
    name = {"imagenet": "imagenet1k"}.get(dataset.name) or dataset.name
    record = clip_benchmark_record(task.task, name, source.label, str(path), metrics)
    record |= {k: metrics[k] for k in COUNTS if k in metrics} | ({"weights": "ema"} if averaged else {})
    folder_classes = getattr(dataset, "folder_classes", None)
    return record | ({"folder_classes": folder_classes} if folder_classes else {})
