"""What a checkpoint directory holds, and which checkpoints a run can use.

A checkpoint is a directory `RUN_DIR/checkpoints/step-NNNNNNNN/` holding the model and
optimizer (and the `ema` block's averages, under AVERAGES) as a torch.distributed.checkpoint (any world size can
load it), one small file of
rank-local state per rank (RNG, data position) and `meta.json` (step, schedule, scaler),
written last. Every checkpoint is written under a hidden `.partial` name and renamed into
place only when complete (`publish`); `checkpoints/latest` names the newest complete one. A crash
while saving leaves at most a `.partial` directory, which is never loaded and is cleared on the
next start. Nothing is read in a way that can run code (`fsdpclip.model.pickles`): a checkpoint with a
file that cannot be read, or whose pickle names anything but plain data, is passed over for the one before it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Optional

from fsdpclip.model.pickles import PickleRefused, load_weights_only, read_dcp_metadata
from fsdpclip.run.directory import JOB_FILE
from fsdpclip.run.files import write_atomically
from fsdpclip.jobspec.job import Job

CHECKPOINTS, LATEST, META = "checkpoints", "latest", "meta.json"
AVERAGES = "ema"  # the key of the moving average's tensors in a checkpoint's state, beside "model" and "optim"
PARTIAL_SUFFIX = ".partial"
CHECKPOINT_NAME = re.compile(r"step-[0-9]{8,}")  # what `checkpoint_name` makes: the only names `latest` may hold


class CheckpointError(Exception):
    """A checkpoint that cannot be used (message meant for the user)."""


class DiskFull(CheckpointError):
    """A checkpoint that does not fit on its disk: nothing of it is published, the last complete one stays latest."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def is_checkpoint_name(name: str) -> bool:
    """Whether `name` is one a checkpoint is saved under (a `latest` naming anything else, a path of another run
    or outside the run directory, is not followed)."""
    return bool(CHECKPOINT_NAME.fullmatch(name))


def is_complete(path: Path) -> bool:
    return path.is_dir() and not path.name.endswith(PARTIAL_SUFFIX) and (path / META).is_file()


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    found = [p for p in root.glob("step-*") if is_checkpoint_name(p.name) and is_complete(p)] \
        if root.is_dir() else []
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint: the one `latest` names where it is a checkpoint of this run, else the
    newest found."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        named = pointer.read_text().strip()
        if is_checkpoint_name(named) and is_complete(root / named):
            return root / named
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def kept_checkpoint(run_dir: Path, full: bool) -> str:
    """What a run that a failed write stops says of its checkpoints (`full`: the write did not fit on its disk)."""
    latest = latest_checkpoint(run_dir)
    return (f"the last complete checkpoint, {latest.name if latest else 'none'}, is kept: "
            f"{'make room and ' if full else ''}launch again to resume from it")


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory from a checkpoint or run directory; CheckpointError if there is none."""
    path = Path(path)
    if is_complete(path):
        return path
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is not None:
            return found
    raise CheckpointError(f"{path} is neither a complete checkpoint (a directory with {META}) "
                          f"nor a run directory with one under {CHECKPOINTS}/{_checkpoints_there(path)}")


def _checkpoints_there(path: Path) -> str:
    """The complete checkpoints of the run a missing checkpoint path points into, for its error."""
    run_dir = path.parent.parent if path.parent.name == CHECKPOINTS else path
    if not (run_dir / CHECKPOINTS).is_dir():
        return ""
    found = [p.name for p in complete_checkpoints(run_dir)]
    if not found:
        return f"; {run_dir / CHECKPOINTS} holds no complete checkpoint"
    return f"; {run_dir / CHECKPOINTS} holds {', '.join(found)} (checkpoint.keep removes older ones)"


def read_meta(checkpoint: Path) -> dict:
    return json.loads((checkpoint / META).read_text())


def rank_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / f"rank-{rank:05d}.pt"


def read_rank_state(path: Path) -> dict:
    """One rank's saved state (RNG, data position), read weights-only; CheckpointError saying what is wrong."""
    if not path.is_file():
        raise CheckpointError(f"{path.name} is missing")
    try:
        return load_weights_only(path, path.name)
    except PickleRefused as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # torch reports a truncated or damaged file in many forms
        first = " ".join(str(exc).split()).split(". ")[0][:200]  # what follows is torch's advice on its internals
        raise CheckpointError(f"{path.name} is truncated or damaged ({type(exc).__name__}: {first})") from None


def averaged_names(checkpoint: Path) -> list[str]:
    """The model's names of the tensors whose moving average `checkpoint` holds (`optim.ema`): none where its run
    kept none. Its DCP metadata is read as `checkpoint_problem` reads it; CheckpointError where it cannot be."""
    try:
        metadata = read_dcp_metadata(checkpoint / ".metadata", where=".metadata")
    except Exception as exc:  # a missing or damaged .metadata file, in whichever form it fails
        raise CheckpointError(f"{checkpoint} cannot be read: its DCP metadata: {type(exc).__name__}: "
                              f"{str(exc)[:200]}") from None
    prefix = AVERAGES + "."
    return [key.removeprefix(prefix) for key in metadata.state_dict_metadata if key.startswith(prefix)]


def required_averages(checkpoint: Path) -> list[str]:
    """`averaged_names` of a checkpoint whose moving average is asked for (`--ema`); CheckpointError where it holds
    none."""
    names = averaged_names(checkpoint)
    if not names:
        raise CheckpointError(f"{checkpoint} holds no moving average of the weights (--ema): its run had no `ema` "
                              "block")
    return names


def checkpoint_problem(checkpoint: Path, rank_state: bool = True) -> Optional[str]:
    """Why a checkpoint directory cannot be loaded, or None: its meta.json and its DCP metadata must be
    readable (the metadata naming only DCP's own types), every data file that metadata names present and
    as long as the data it holds, and (`rank_state`) every rank's state file readable weights-only."""
    if not (checkpoint / META).is_file():
        return f"it has no {META} (a save that did not finish)"
    try:
        meta = read_meta(checkpoint)
        if not isinstance(meta, dict) or not {"step", "world_size", "model"} <= set(meta):
            return f"its {META} lacks step, world_size or model"
    except (OSError, ValueError) as exc:
        return f"its {META} cannot be read: {exc}"
    try:
        metadata = read_dcp_metadata(checkpoint / ".metadata", where=".metadata")
    except PickleRefused as exc:
        return str(exc)
    except Exception as exc:  # a missing or damaged .metadata file, in whichever form it fails
        return f"its DCP metadata cannot be read: {type(exc).__name__}: {str(exc)[:200]}"
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size < size:
            return f"{name} is truncated ({path.stat().st_size:,} of {size:,} bytes)"
    for rank in range(meta["world_size"]) if rank_state and "imported" not in meta else ():  # imports hold none
        try:
            read_rank_state(rank_file(checkpoint, rank))
        except CheckpointError as exc:
            return str(exc)
    return None


def usable_checkpoints(run_dir: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The run's checkpoints that can be loaded, newest first, and those that cannot, with why."""
    root = Path(run_dir) / CHECKPOINTS
    found = [p for p in root.glob("step-*") if is_checkpoint_name(p.name) and p.is_dir()] if root.is_dir() else []
    usable, skipped = [], []
    for checkpoint in sorted(found, key=lambda p: p.name, reverse=True):
        problem = checkpoint_problem(checkpoint)
        (skipped.append((checkpoint, problem)) if problem else usable.append(checkpoint))
    return usable, skipped


def resume_candidates(run_dir: Path, resume: Optional[str]) -> tuple[list[Path], list[str]]:
    """The checkpoints to try in turn for `checkpoint.resume`, and a warning for each one passed over.

    'latest': every loadable checkpoint of the run, newest first (none: a fresh start, unless
    checkpoints exist that cannot be loaded: then CheckpointError, never a silent restart that would
    replace them); a path: that checkpoint alone, which must be loadable; None: nothing.
    """
    if resume is None:
        return [], []
    if resume != "latest":
        if Path(resume).is_file():
            raise CheckpointError(f"{resume} is a file, not a checkpoint directory: an open_clip_train checkpoint "
                                  f"(epoch_N.pt) is continued with `fsdpclip import {resume} JOB_FILE`")
        checkpoint = resolve_checkpoint(Path(resume))
        problem = checkpoint_problem(checkpoint)
        if problem:
            raise CheckpointError(f"cannot resume from {checkpoint}: {problem}")
        return [checkpoint], []
    usable, skipped = usable_checkpoints(run_dir)
    warnings = [f"skipping {path}: {why}" for path, why in skipped]
    if not usable and skipped:
        raise CheckpointError(f"{len(skipped)} checkpoint(s) in {Path(run_dir) / CHECKPOINTS} and none can be "
                              f"loaded ({'; '.join(w.removeprefix('skipping ') for w in warnings[:3])}): set "
                              "checkpoint.resume to null to start over (they will be replaced), or to one of them")
    return usable, warnings


def run_job(checkpoint: Path) -> Optional[Job]:
    """The spec of the run that saved `checkpoint` (its run directory's job.json), if it can be read."""
    from fsdpclip.jobspec.problems import SpecError
    from fsdpclip.jobspec.jobfile import load_job

    path = Path(checkpoint).parent.parent / JOB_FILE
    try:
        return load_job(path) if path.is_file() else None
    except SpecError:
        return None


def publish(partial: Path, final: Path, meta: dict) -> None:
    """Complete a written checkpoint: meta.json last, rename into place, point `latest` at it."""
    write_atomically(partial / META, json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    point_latest(final)


def point_latest(checkpoint: Path) -> None:
    """Name a complete checkpoint in its run's `latest`."""
    write_atomically(checkpoint.parent / LATEST, checkpoint.name + "\n")


def first_failure(exc: BaseException) -> str:
    """The first rank's error out of a CheckpointException, on one line."""
    failures = getattr(exc, "failures", None) or {}
    first = next(iter(failures.values()), exc)
    error = first[0] if isinstance(first, tuple) else first
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]
