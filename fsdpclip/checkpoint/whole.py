"""Checkpoints read or written by one process that holds the whole model: OpenCLIP's format out of a
sharded checkpoint (`export_checkpoint`), and a sharded checkpoint out of a model held whole (`save_whole`,
which `fsdpclip import` uses)."""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from fsdpclip.checkpoint.layout import (
    AVERAGES, CHECKPOINTS, PARTIAL_SUFFIX, CheckpointError, checkpoint_name, checkpoint_problem, first_failure, publish,
    required_averages,
)
from fsdpclip.model.pickles import SafeLoadPlanner, SafeReader
from fsdpclip.jobspec.preprocess import PREPROCESSING_KEYS
from fsdpclip.run.files import write_atomically
from fsdpclip.jobspec.job import SHARED_PARAMETERS
from fsdpclip.model.build import OpenClip


def save_whole(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> Path:
    """Write checkpoint `step` of a model and optimizer that this one process holds whole, without a
    process group: the layout of a sharded save, which any world size resumes (`Checkpointer.load`
    gives each rank its rows); no rank-local state. Returns its path; nothing is left on failure."""
    final = Path(run_dir) / CHECKPOINTS / checkpoint_name(step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(partial),  # pyright: ignore[reportPrivateImportUsage]
                     no_dist=True)  # (torch re-exports dcp.save without __all__)
        publish(partial, final, {**meta, "step": step, "world_size": 1, "saved_at": time.time()})
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


def read_model_state(checkpoint: Path, model: nn.Module, averaged: bool = False) -> dict[str, torch.Tensor]:
    """The full model state of a sharded checkpoint, read by this process alone onto the CPU; `averaged`: with the
    moving average of the tensors it holds one of (`optim.ema`: the trained parameters, floating-point buffers) in
    place of theirs, the rest (frozen parameters, integer buffers) as trained; CheckpointError where it holds none.

    `model` (usually on the meta device) gives the keys, shapes and dtypes.
    """
    problem = checkpoint_problem(checkpoint, rank_state=False)
    if problem:
        raise CheckpointError(f"{checkpoint} cannot be read: {problem}")
    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    averages = {name: state[name] for name in required_averages(checkpoint) if name in state} if averaged else {}
    parts = {"model": {k: v for k, v in state.items() if k not in averages}}
    if averages:
        parts[AVERAGES] = averages
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(parts, storage_reader=SafeReader(str(checkpoint)),  # pyright: ignore[reportPrivateImportUsage]
                     planner=SafeLoadPlanner(),  # (torch re-exports dcp.load without __all__)
                     no_dist=True)
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        raise CheckpointError(f"{checkpoint} cannot be read: {first_failure(exc)}") from None
    except Exception as exc:  # DCP reports a mismatch in many forms
        raise CheckpointError(f"{checkpoint} does not match the model: {str(exc).strip()[:300]}") from None
    return state


WEIGHTS_SUFFIXES = (".pt", ".bin", ".pth", ".safetensors")  # an export to a path with one is a weights file
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def open_clip_name(config: dict, label: str, out: Path) -> tuple[str, bool]:
    """The name OpenCLIP loads a weights file exported to `out` by, and whether its model config must be
    registered under it (`open_clip.add_model_config`): the label where OpenCLIP's own config of that name (one it
    ships, not one this process registered) is the model's; else the label where it is a name OpenCLIP has not
    taken, else the file's stem."""
    import open_clip

    shipped = Path(open_clip.__file__).parent / "model_configs" / f"{label}.json"
    own = json.loads(shipped.read_text()) if NAME.fullmatch(label) and shipped.is_file() else None
    if own is not None and own == {k: v for k, v in config.items() if k not in PREPROCESSING_KEYS}:
        return label, False
    return (label if own is None and NAME.fullmatch(label) else Path(out).stem), True


def exported_files(out: Path, safetensors: bool = False, config_name: Optional[str] = None) -> list[Path]:
    """The files an export to `out` writes, configs first: a weights file (`out` with a suffix of WEIGHTS_SUFFIXES)
    and, with `config_name`, the model config OpenCLIP registers under that name beside it (`config_name.json`);
    else open_clip's `local-dir:` layout, its config and its weights (safetensors or a torch pickle)."""
    out = Path(out)
    if out.suffix in WEIGHTS_SUFFIXES:
        return [*([out.with_name(f"{config_name}.json")] if config_name else []), out]
    return [out / "open_clip_config.json",
            out / ("open_clip_model.safetensors" if safetensors else "open_clip_pytorch_model.bin")]


def holds_model_config(path: Path, config: dict) -> bool:
    """Whether `path` is the model config an export of `config` writes beside a weights file (an export of
    another checkpoint of the same model into the same folder: writing it again changes nothing)."""
    try:
        return json.loads(Path(path).read_text()) == {k: v for k, v in config.items() if k not in PREPROCESSING_KEYS}
    except (OSError, ValueError):
        return False


def export_checkpoint(checkpoint: Path, model: OpenClip, out: Path, config: dict, safetensors: bool = False,
                      config_name: Optional[str] = None, averaged: bool = False) -> Path:
    """Write the model of a sharded checkpoint as one OpenCLIP checkpoint, in one process (`averaged`: its moving
    average's weights, `read_model_state`).

    `out` is a file (`.pt`, `.bin`, `.safetensors`), with its model config beside it as `config_name.json` where
    given (the file `open_clip.add_model_config` registers under that name), or a directory laid out for
    open_clip's `local-dir:` (open_clip_config.json, with the preprocessing, beside the weights). `model` is the
    unwrapped model on the meta device: its full state is allocated once on the CPU, filled from the checkpoint
    and written from the same tensors. Returns the weights file written. The destination is made (and so
    checked) before anything is read; OSError when it cannot be.
    """
    out = Path(out)
    safetensors = safetensors or out.suffix == ".safetensors"
    *config_file, weights = exported_files(out, safetensors, config_name)
    weights.parent.mkdir(parents=True, exist_ok=True)
    partial = weights.with_name(weights.name + PARTIAL_SUFFIX)
    partial.touch()
    try:
        state = read_model_state(checkpoint, model, averaged)
        for name in SHARED_PARAMETERS:  # OpenCLIP keeps them 0-d
            if name in state:
                state[name] = state[name].reshape(())
        model_cfg = {k: v for k, v in config.items() if k not in PREPROCESSING_KEYS}
        for path in config_file:
            layout = model_cfg if out.suffix in WEIGHTS_SUFFIXES else {"model_cfg": model_cfg,
                                                                      "preprocess_cfg": model.visual.preprocess_cfg}
            write_atomically(path, json.dumps(layout, indent=2))
        if safetensors:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(partial))
        else:
            torch.save({"state_dict": state}, partial)
        partial.replace(weights)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return weights
