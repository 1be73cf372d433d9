"""What every launcher backend (`fsdpclip.jobspec.backend`) shares: the job's paths made absolute and torchrun's
command line. Nothing here imports torch.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from fsdpclip.jobspec.urls import is_local

if TYPE_CHECKING:
    from fsdpclip.jobspec.job import Job

TRAIN_MODULE = "fsdpclip.launch.entry"
TORCHRUN = "fsdpclip.launch.torchrun"  # torchrun, without a traceback for the trainer's deliberate exits


def resolve_paths(job: Job, base: Path) -> Job:
    """The job with every local path made absolute (relative ones are relative to `base`)."""

    def absolute(path: Optional[str]) -> Optional[str]:
        return None if path is None else str((base / path).resolve()) if is_local(path) else path

    def resolve_fields(block, names: tuple[str, ...]) -> None:  # a path, a list of them, or another value
        for name in names:
            blocks, _, field = name.partition("[].")
            if field:  # that field of each block in a list
                for item in getattr(block, blocks) or []:
                    resolve_fields(item, (field,))
                continue
            value = getattr(block, name)
            setattr(block, name, absolute(value) if isinstance(value, str) else
                    [absolute(v) for v in value] if isinstance(value, list) else value)

    data = job.model_copy(deep=True)
    output_dir = absolute(job.run.output_dir)
    assert output_dir is not None
    data.run.output_dir = output_dir
    model = data.model
    model.config = absolute(model.config)
    model.pretrained = model.pretrained if model.published_tag else absolute(model.pretrained)
    model.image.pretrained, model.text.pretrained = absolute(model.image.pretrained), absolute(model.text.pretrained)
    for entry, block in data.registered_blocks():
        resolve_fields(block, entry.paths(block))
    if data.checkpoint.resume not in (None, "latest"):
        data.checkpoint.resume = absolute(data.checkpoint.resume)
    return data


def render(command: list[str]) -> str:
    """A command line as the shell reads it."""
    return " ".join(shlex.quote(part) for part in command)

