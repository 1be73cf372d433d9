"""`fsdpclip report RUN_DIR`: what a run did, from its directory alone (metrics.jsonl, launches/,
exit.json, the lock, the checkpoints): a summary and one PNG of its curves, restarts marked."""

from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fsdpclip.jobspec.source import DATA_SOURCES
from fsdpclip.jobspec.task import EVAL_TASKS
from fsdpclip.run.directory import EXIT_FILE, EXIT_OK, EXIT_PREEMPTED, EXIT_STOPPED_AT_ONCE, JOB_FILE, LAUNCHES
from fsdpclip.jobspec.problems import SpecError
from fsdpclip.run.lock import lock_holder
from fsdpclip.run.reports import DATA_BOUND, data_wait_notice
from fsdpclip.jobspec.jobfile import parse_job

# (metric key in metrics.jsonl, panel title); panels without data are left out.
PANELS = (("loss", "loss"), ("lr", "learning rate"), ("logit_scale", "logit scale (1 / temperature)"),
          ("samples_per_s_per_gpu", "samples/s per GPU"), ("mfu", "MFU"), ("data_wait_fraction", "data wait fraction"))
RATE_WINDOW = 5  # log records the ETA's rate is taken over


class ReportError(Exception):
    """RUN_DIR is not a run directory (or holds nothing to report yet)."""


@dataclass
class Run:
    """A run directory as read from disk."""

    path: Path
    records: list[dict]  # training log records, in the order written
    evaluations: list[dict]  # evaluation records (zero-shot and retrieval)
    restarts: list[int] = field(default_factory=list)  # steps a later launch resumed from
    launches: int = 0
    exit: Optional[dict] = None
    running: Optional[str] = None  # who holds the lock, when the run is live
    last_checkpoint: Optional[str] = None


def read_run(run_dir: Path) -> Run:
    """Everything the report needs from a run directory."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() and not (run_dir / JOB_FILE).is_file():
        raise ReportError(f"{run_dir} has no metrics.jsonl: not a run directory, or a run that has not logged yet")
    lines = _text(metrics).splitlines() if metrics.is_file() else []  # none: the run failed before it logged
    rows = [row for row in map(_json, lines) if isinstance(row, dict)]
    launches = sorted((run_dir / LAUNCHES).glob("*.json"))
    restarts = []
    for launch in launches:
        record = _json(_text(launch))
        match = re.search(r"step-(\d+)", str(record.get("resumed_from") if isinstance(record, dict) else ""))
        if match:
            restarts.append(int(match.group(1)))
    exit_file = run_dir / EXIT_FILE
    ended = _json(_text(exit_file)) if exit_file.is_file() else None
    holder = lock_holder(run_dir)
    from fsdpclip.checkpoint.layout import complete_checkpoints

    checkpoints = complete_checkpoints(run_dir)
    evaluated = tuple(f"{kind}/" for kind in EVAL_TASKS.members())  # the prefixes of evaluation results
    return Run(run_dir, [r for r in rows if "loss" in r], [r for r in rows if any(k.startswith(evaluated) for k in r)],
               restarts, len(launches), ended if isinstance(ended, dict) and "code" in ended else None,
               f"pid {holder.pid} on {holder.host}" if holder else None,
               checkpoints[-1].name if checkpoints else None)


def _text(path: Path) -> str:
    """A file the run wrote, as text: bytes that are not UTF-8 (a damaged disk block, a foreign writer) read as
    U+FFFD, so a line holding them still parses where they fall inside a string, and is skipped otherwise."""
    return path.read_bytes().decode("utf-8", errors="replace")


def _json(text: str):
    """Parsed JSON, or None for text a crash cut short."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def summary(run: Run, now: Optional[float] = None) -> dict:
    """Steps done of the total, the state (running, finished, stopped and from which step it resumes, failed), an
    ETA while running, the last complete checkpoint, the command that launches it again from its job.json (where
    it has not finished and nothing runs it), launches and restarts, and the last result of each evaluation set."""
    last = run.records[-1] if run.records else {}
    done, total = last.get("step", 0), last.get("total_steps")
    code = None if run.running or run.exit is None else run.exit["code"]
    if run.running:
        state = "running"
    elif code is None:
        state = "ended without a report"
    elif code in (EXIT_PREEMPTED, EXIT_STOPPED_AT_ONCE):
        how = "stopped (preempted or asked to)" if code == EXIT_PREEMPTED else "stopped at once (a second interrupt)"
        state = f"{how}, " + (f"resumable from step {int(run.last_checkpoint.removeprefix('step-'))}"
                              if run.last_checkpoint else "before any checkpoint: launched again, it starts afresh")
    else:
        state = "finished" if code == EXIT_OK else f"failed (exit {code})"
    job_file = run.path / JOB_FILE
    relaunch = shlex.join(["fsdpclip", "launch", str(job_file)]) if job_file.is_file() and not run.running and \
        code != EXIT_OK else None
    eta = None
    timed = [r for r in run.records if "time" in r][-RATE_WINDOW:]
    if run.running and total and len(timed) >= 2 and timed[-1]["step"] > timed[0]["step"]:
        per_step = (timed[-1]["time"] - timed[0]["time"]) / (timed[-1]["step"] - timed[0]["step"])
        eta = max(0.0, (total - done) * per_step - ((now or time.time()) - timed[-1]["time"]))
    latest = run.evaluations[-1] if run.evaluations else {}
    results = {kind: {k.removeprefix(f"{kind}/"): v for k, v in latest.items() if k.startswith(f"{kind}/")}
               for kind in EVAL_TASKS.members()}
    return {"run_dir": str(run.path), "state": state, "holder": run.running, "step": done, "total_steps": total,
            "eta_s": eta, "last_checkpoint": run.last_checkpoint, "relaunch": relaunch, "launches": run.launches,
            "restarts_at": run.restarts, "exit": run.exit, "loss": last.get("loss"), **data_wait(run), **results}


def data_wait(run: Run) -> dict:
    """The share of its time the step waited for data over the last log windows (the first, which holds the
    start-up, left out; their median) and, where over DATA_BOUND, the notice saying so with the fixes that
    apply to the run's spec (`DataSource.waiting_hints`, for a node whose cores are not known here)."""
    waits = sorted(r["data_wait_fraction"] for r in run.records[1:][-RATE_WINDOW * 4:]
                   if isinstance(r.get("data_wait_fraction"), (int, float)))
    if not waits:
        return {"data_wait_fraction": None, "data_bound": None}
    wait = waits[len(waits) // 2]
    rates = [r["samples_per_s_per_gpu"] for r in run.records[1:][-RATE_WINDOW * 4:]
             if isinstance(r.get("samples_per_s_per_gpu"), (int, float))]
    hints: list[str] = []
    if wait > DATA_BOUND:
        try:
            job = parse_job(_json(_text(run.path / "job.json")) or {})
            hints = DATA_SOURCES[job.data.source].waiting_hints(job.data, job.launch.world_size,
                                                                 job.launch.gpus_per_node, None)
        except (OSError, SpecError):  # a run directory without a usable spec: the rate alone
            pass
    rate = sorted(rates)[len(rates) // 2] if rates else 0.0
    return {"data_wait_fraction": wait, "data_bound": data_wait_notice(wait, rate, hints)}


def plot(run: Run, png: Path) -> list[str]:
    """One PNG: a panel per logged curve against step (zero-shot acc1 and retrieval recall@1 per set too),
    restarts as dashed lines; returns the panels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(key, title) for key, title in PANELS if any(r.get(key) is not None for r in run.records)]
    evaluated = [(title, curves) for title, curves in _evaluation_curves(run) if curves]
    count = len(panels) + len(evaluated)
    if not count:
        raise ReportError(f"{run.path}: no training step logged yet, no curves to draw")
    columns = min(3, count)
    rows = -(-count // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.3 * rows), squeeze=False)
    flat = [a for row in axes for a in row]
    for axis, (key, title) in zip(flat, panels):
        points = [(r["step"], r[key]) for r in run.records if r.get(key) is not None]
        axis.plot(*zip(*points), linewidth=1)
        axis.set(title=title, xlabel="step")
    for axis, (title, curves) in zip(flat[len(panels):], evaluated):
        for label, points in curves.items():
            axis.plot(*zip(*points), marker="o", markersize=3, label=label)
        axis.set(title=title, xlabel="step")
        axis.legend(fontsize=8)
    for axis in flat[:count]:
        for step in run.restarts:
            axis.axvline(step, color="grey", linestyle="--", linewidth=0.8)
    for axis in flat[count:]:
        axis.set_visible(False)
    restarts = f", restarts at step {', '.join(map(str, run.restarts))}" if run.restarts else ""
    figure.suptitle(f"{run.path.name}{restarts}", fontsize=10)
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return [title for _, title in panels] + [title for title, _ in evaluated]


def _evaluation_curves(run: Run) -> list[tuple[str, dict[str, list[tuple[int, float]]]]]:
    """(panel title, {label: [(step, value)]}) per eval task, its curves as the task draws them (zero-shot acc1
    per set, retrieval recall@1 per set and direction)."""
    tasks = EVAL_TASKS.members()
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {kind: {} for kind in tasks}
    for record in run.evaluations:
        for key, values in record.items():
            kind, _, name = key.partition("/")
            if name and kind in tasks:
                for label, value in tasks[kind].curves(name, values).items():
                    curves[kind].setdefault(label, []).append((record["step"], value))
    return [(task.panel, curves[kind]) for kind, task in tasks.items()]
