"""Throughput, MFU, memory, metrics.jsonl, TensorBoard, Weights & Biases and the progress display (rank 0)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

from fsdpclip.run.directory import EXIT_OK, EXIT_PREEMPTED, WANDB_ID_FILE
from fsdpclip.run.files import LineLog, write_atomically
from fsdpclip.run.reports import data_wait_notice
from fsdpclip.jobspec.job import WandbSpec

# Dense bf16 peak of one device, TFLOP/s (datasheets); the spec's logging.peak_tflops overrides.
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "B200": 2250.0, "A100": 312.0, "A800": 312.0,
               "L40S": 362.1, "A10G": 70.0}


def peak_tflops(device: torch.device, configured: Optional[float]) -> Optional[float]:
    """The peak to compute MFU against: the spec's, else the device's datasheet figure (None on CPU)."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (GPU) or peak resident memory of this process (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


class Window:
    """Counts samples, time and data waiting between two log points."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.start, self.samples, self.data_wait, self.steps = time.perf_counter(), 0, 0.0, 0

    def rates(self, world_size: int, flops_per_sample: Optional[float], peak: Optional[float]) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        per_gpu = self.samples / elapsed
        out: dict[str, Optional[float]] = {"samples_per_s": per_gpu * world_size, "samples_per_s_per_gpu": per_gpu,
               "data_wait_fraction": self.data_wait / elapsed, "step_time_s": elapsed / max(1, self.steps)}
        out["mfu"] = per_gpu * flops_per_sample / (peak * 1e12) if peak and flops_per_sample else None
        return out


def live_progress(console, environ) -> bool:
    """A live progress bar only where someone watches a terminal: not in a pipe or a file, and never under Slurm
    (whose output goes to files that a redrawn bar would fill); plain log lines otherwise."""
    return console.is_terminal and "SLURM_JOB_ID" not in environ


def time_left(record: dict, total_steps: int) -> Optional[str]:
    """The time the run's remaining steps take at this record's pace, as H:MM:SS."""
    step_time, step = record.get("step_time_s"), record.get("step")
    if not step_time or step is None or step >= total_steps:
        return None
    seconds = round(step_time * (total_steps - step))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class LogLine(ProgressColumn):
    """The last log record's line, on one line: as much of it as the terminal leaves, cut with an ellipsis."""

    def render(self, task) -> Text:
        return Text(task.description, no_wrap=True, overflow="ellipsis")


def progress_bar(console) -> Progress:
    """The live bar: 'train', the bar, step of total, samples/s and time left, then the last log line. The
    step, rate and time left keep their width on any terminal (rich would shorten every column alike); the bar
    and the log line take what is left."""
    kept = Column(no_wrap=True)
    return Progress(TextColumn("[bold]train", table_column=kept), BarColumn(), MofNCompleteColumn(table_column=kept),
                    TextColumn("{task.fields[rate]}", table_column=kept), TimeRemainingColumn(table_column=kept),
                    LogLine(),
                    console=console)


class MetricsLog:
    """metrics.jsonl (and TensorBoard, and a W&B run with `config` as its config) in the run directory, and
    a progress display; rank 0 only."""

    def __init__(self, run_dir: Path, total_steps: int, tensorboard: bool, enabled: bool,
                 wandb: Optional[WandbSpec] = None, config: Optional[dict] = None, data_hints: Sequence[str] = ()):
        self.enabled, self.total_steps, self.data_hints = enabled, total_steps, list(data_hints)
        self.data_bound = 0  # log windows so far in which the step waited for its data over DATA_BOUND
        self.file = self.writer = self.progress = self.wandb = None
        if not enabled:
            return
        self.file = LineLog(run_dir / "metrics.jsonl")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb is not None and wandb.mode != "disabled":
            self.wandb = WandbRun(wandb, run_dir, config or {})
        from rich.console import Console

        self.console = Console(file=sys.stdout)
        if live_progress(self.console, os.environ):
            self.progress = progress_bar(self.console)
            self.task = self.progress.add_task("", total=total_steps, rate="")
            self.progress.start()

    def advance(self, step: int) -> None:
        """Move the progress bar to `step` (every step: its rate and time left follow the steps)."""
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def write(self, record: dict) -> None:
        if not self.enabled or self.file is None:
            return
        self.file.append(json.dumps(record))
        if self.writer is not None:
            for key, value in _flat(record).items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(record)
        line = " ".join(f"{k} {_short(v)}" for k, v in record.items() if k in SHOWN and v is not None)
        steady = "loss" in record and "time_to_first_step_s" not in record  # not the window holding the start-up
        notice = data_wait_notice(record.get("data_wait_fraction") or 0.0, record.get("samples_per_s_per_gpu") or 0.0,
                                  self.data_hints) if steady else None
        if notice is not None:
            line += f" data wait {record['data_wait_fraction']:.0%}"
            if self.data_bound % NOTICE_EVERY == 0:
                self.announce(notice, style="yellow")
            self.data_bound += 1
        rate = f"{record['samples_per_s']:,.0f} samples/s" if record.get("samples_per_s") else ""
        if self.progress is not None and "loss" in record:  # the bar shows training; other records, a line above it
            fields: dict[str, Any] = {"rate": rate} if rate else {}  # the task's own fields
            self.progress.update(self.task, completed=record.get("step", 0), description=line, **fields)
        elif self.progress is not None and line:
            self.announce(f"step {record.get('step')} {line}")
        elif line:
            left = time_left(record, self.total_steps)
            self.console.print(f"step {record.get('step')}/{self.total_steps} {line}" + (f" {rate}" if rate else "") +
                               (f" eta {left}" if left else ""), highlight=False, soft_wrap=True)

    def announce(self, text: str, style: str = "") -> None:
        """A line for the reader (above the progress bar when there is one), as it is (no markup)."""
        if self.enabled:
            self.console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)

    def close(self, exit_code: int = EXIT_OK) -> None:
        """Close every sink; the W&B run ends with the run's exit code."""
        if self.progress is not None:
            self.progress.stop()
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code)


class WandbRun:
    """The run's Weights & Biases run: the scalars of metrics.jsonl (nested keys joined with '/') against
    our own `step`, the resolved spec as its config. Its id is kept in RUN_DIR/wandb-id, so a relaunch
    (a resume) continues the same W&B run. Its files go to RUN_DIR/wandb/ unless WANDB_DIR says otherwise."""

    def __init__(self, spec: WandbSpec, run_dir: Path, config: dict):
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        write_atomically(id_file, run_id + "\n")
        if spec.mode == "offline":  # nothing reaches the network: no error reports either
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        self.run = wandb.init(project=spec.project, entity=spec.entity, name=spec.name or run_dir.name,
                              tags=spec.tags, mode=spec.mode, id=run_id, resume="allow", config=config,
                              dir=None if "WANDB_DIR" in os.environ else str(run_dir))
        # Our step, not W&B's own counter: a run resumed from a checkpoint before its last logged step
        # logs those steps again instead of having them dropped.
        self.run.define_metric("*", step_metric="step")

    def log(self, record: dict) -> None:
        self.run.log({key: value for key, value in _flat(record).items() if isinstance(value, (int, float))})

    def finish(self, exit_code: int) -> None:
        """End the W&B run (a preempted one marked so; any code but 0 shows it as failed)."""
        if exit_code == EXIT_PREEMPTED:
            self.run.mark_preempting()
        self.run.finish(exit_code=exit_code)


NOTICE_EVERY = 20  # data-bound log windows between two notices saying so
SHOWN = ("loss", "lr", "samples_per_s_per_gpu", "mfu", "peak_memory_gib", "checkpoint_blocked_s")


def _flat(record: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[prefix + key] = value
    return out


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
