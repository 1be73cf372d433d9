"""Stop requests and how each launch ended: RUN_DIR/stop, exit.json (completed from crash reports when the
trainer could not write it; `python -m fsdpclip.run.reports` completes it at the end of the Slurm script), and
the launch history in launches/. No torch."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

from fsdpclip.run.directory import EXIT_FILE, EXIT_STOPPED_AT_ONCE, LAUNCHES, LOG_DIR, STOP_FILE
from fsdpclip.run.files import disk_free, no_space_message, write_atomically

FULL_DISK = 2 ** 20  # bytes free under which a job that ended without a report is said to have filled its disk


def request_stop(run_dir: Path) -> None:
    """Ask the running job to checkpoint and stop (its ranks look every few steps)."""
    write_atomically(Path(run_dir) / STOP_FILE, f"{time.time()}\n")


def stop_requested(run_dir: Path, since: float) -> bool:
    """Whether a stop was requested after `since` (an older request was another launch's)."""
    try:
        return (Path(run_dir) / STOP_FILE).stat().st_mtime >= since
    except OSError:
        return False


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


CRASH_LINE = 500  # characters of a crash's error kept in its report


def write_crash_report(run_dir: Path, rank: int, error: BaseException) -> None:
    """What killed a rank, for the launcher's last line (each rank its own file: no race)."""
    _write_crash(run_dir, {"rank": rank, "error": crash_line(error)})


def crash_line(error: BaseException) -> str:
    """An exception on one line of at most CRASH_LINE characters that keeps its cause: a message carrying a
    traceback (a data worker's, as DataLoader raises it again) gives its first and last lines, and one still too
    long its start and its end."""
    lines = [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {' … '.join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)}"
    if len(text) <= CRASH_LINE:
        return text
    half = (CRASH_LINE - 3) // 2
    return f"{text[:half]} … {text[-half:]}"


def record_killed_rank(run_dir: Path, rank: int, signal_name: str) -> None:
    """A rank that a signal killed (torchrun saw it go): the cause the launcher names before the other ranks'
    errors, which are then only their lost connection to it."""
    _write_crash(run_dir, {"rank": rank, "signal": signal_name})


def _write_crash(run_dir: Path, record: dict) -> None:
    path = Path(run_dir) / LOG_DIR / f"crash-rank-{record['rank']:05d}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({**record, "time": time.time()}) + "\n")
    except OSError:
        pass  # the report is a courtesy; the rank's own traceback still reaches its log


def finish_exit_report(run_dir: Path, since: float, status: int, ended: str = "the job",
                       checkpoint: str = "") -> dict:
    """The report of a launch that ended with exit `status`: the trainer's own, or, when the trainer
    could not write one (a rank crashed or was killed, its disk was full), one made from the crash reports (a
    rank killed by a signal first: the others' errors follow from it) or the status (of what `ended`: the job,
    or one of its nodes; a full disk named), with `checkpoint`, the run's last complete one. Written to exit.json
    either way."""
    report = exit_report(run_dir, since)
    if report is not None:
        return report
    crashes = []
    for path in (Path(run_dir) / LOG_DIR).glob("crash-rank-*.json"):
        try:
            crash = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if crash.get("time", 0) >= since:
            crashes.append(crash)
    killed = [crash for crash in crashes if "signal" in crash]
    if killed:
        first = min(killed, key=lambda c: c["time"])
        others = " (the other ranks lost their connection to it)" if len(crashes) > len(killed) else ""
        message = f"rank {first['rank']} was killed by {first['signal']}{others}"
    elif crashes:
        first = min(crashes, key=lambda c: c["time"])
        message = f"rank {first['rank']} failed: {first['error']}"
    elif status == EXIT_STOPPED_AT_ONCE:
        message = "stopped at once (a second interrupt), " + (
            f"resumable from its last checkpoint, {Path(checkpoint).name}; the steps after it are lost" if checkpoint
            else "before any checkpoint: launched again, it starts afresh")
    elif status < 0 or status > 128:
        message = f"{ended} was killed (exit status {status}) before the trainer could report"
    else:
        free = disk_free(run_dir)
        full = f"; {no_space_message(run_dir, free)}" if free < FULL_DISK else ""
        message = (f"{ended} ended with exit status {status} before the trainer could report{full} "
                   "(see the output above)")
    code = status if status > 0 else 1
    write_exit_report(run_dir, code, message, None, checkpoint)
    return exit_report(run_dir, since) or {"code": code, "message": message}


def record_launch(run_dir: Path, job_json: str, changes: list[str], resumed_from: Optional[str]) -> Path:
    """Keep this start's resolved spec and what it changed against its checkpoint (history, never
    overwritten)."""
    folder = Path(run_dir) / LAUNCHES
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    number = len(list(folder.glob("*.json"))) + 1
    path = folder / f"{number:04d}-{stamp}.json"
    write_atomically(path, json.dumps({"time": time.time(), "resumed_from": resumed_from, "changes": changes,
                                       "job": json.loads(job_json)}, indent=2) + "\n")
    return path




def main(argv: Optional[list[str]] = None) -> int:
    """`python -m fsdpclip.run.reports RUN_DIR SINCE STATUS`: finish the exit report (the Slurm script's
    last step) and print the code to exit with."""
    run_dir, since, status = (argv or sys.argv[1:])[:3]
    print(finish_exit_report(Path(run_dir), float(since), int(status))["code"])
    return 0


if __name__ == "__main__":
    sys.exit(main())


DATA_BOUND = 0.10  # a step that waits for its batches longer than this share of its time is bound by its data


def data_wait_notice(wait: float, samples_per_s_per_gpu: float, hints: list[str]) -> Optional[str]:
    """What to tell of a log window whose step waited `wait` of its time for its batches, at that rate: the rate
    the data supplies, what the step alone would take, and `hints` (the fixes that apply:
    `DataSource.waiting_hints`); None where the step waited no more than DATA_BOUND."""
    if wait <= DATA_BOUND:
        return None
    wait = min(wait, 0.99)  # a window counts the device spans it sees finished: a short one can count more
    alone = samples_per_s_per_gpu / (1 - wait)
    text = (f"data-bound: the step waited for its batches {wait:.0%} of the time: the data supplies "
            f"~{samples_per_s_per_gpu:,.0f} samples/s per GPU, the step alone would take ~{alone:,.0f}")
    return text + (" (to feed it: " + "; ".join(hints) + ")" if hints else "")

