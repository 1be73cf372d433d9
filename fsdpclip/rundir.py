"""The run directory `<output_dir>/<name>/`: the files that describe one run, and how it ended.

    job.json       the resolved spec the ranks train from (absolute paths)
    metrics.jsonl  what the trainer logged
    checkpoints/   sharded checkpoints (fsdpclip.checkpoint)
    exit.json      how the last launch ended: code, message, step, checkpoint
    logs/          Slurm's and each node's output

Pure file handling, no torch: the launcher imports it before any rank starts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

JOB_FILE, EXIT_FILE, LOG_DIR = "job.json", "exit.json", "logs"
# When `fsdpclip launch` started the job (seconds since the epoch), for time-to-first-step.
LAUNCH_TIME_ENV = "FSDPCLIP_LAUNCH_TIME"


def write_atomically(path: Path, text: str) -> None:
    """Write a whole file or nothing: readers never see half of it (also across nodes)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    partial.replace(path)


def write_exit_report(run_dir: Path, code: int, message: str, step: Optional[int], checkpoint: str) -> None:
    """Record how the run ended (rank 0 of the trainer, or the launcher when the trainer could not)."""
    report = {"code": code, "message": message, "step": step, "checkpoint": checkpoint, "time": time.time()}
    write_atomically(Path(run_dir) / EXIT_FILE, json.dumps(report, indent=2) + "\n")


def exit_report(run_dir: Path, since: float) -> Optional[dict]:
    """How the run ended, if it was reported after `since` (an older report is another launch's)."""
    try:
        report = json.loads((Path(run_dir) / EXIT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return report if report.get("time", 0) >= since else None
