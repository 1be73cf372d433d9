"""When a run stops early: stop requests agreed by the ranks at paced checks (`StopChecks`), Stop and its exit
codes, the run directory's lock while the job runs, and the exit report."""

from __future__ import annotations

import contextlib
import math
import signal
import time
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from fsdpclip.checkpoint.layout import latest_checkpoint
from fsdpclip.parallel.distributed import Dist, all_max
from fsdpclip.run.directory import EXIT_PREEMPTED, EXIT_SPEC
from fsdpclip.run.lock import HeldLock, RunLocked, launch_time, launcher_gone, lock_token
from fsdpclip.run.reports import stop_requested, write_exit_report
from fsdpclip.jobspec.job import Job

if TYPE_CHECKING:
    from fsdpclip.train.saving import CheckpointManager

STOP_REQUEST = 1000  # in the stop agreement (a maximum over ranks): a stop asked for through RUN_DIR/stop

LAUNCHER_GONE = 1001  # ... the `fsdpclip launch` that started a rank has ended (killed) while it runs
# Ranks agree on a stop signal after each launch's first step, then every STOP_CHECK_STEPS steps at most:
# one small blocking collective, whose cost is negligible at this interval, and no extra process group (a
# gloo group connects every pair of ranks, which does not scale). Where steps are slow, more often: about
# STOP_CHECK_SECONDS apart, or every step (a scheduler's grace between SIGTERM and SIGKILL is 30 s by
# default on Slurm; ten 10-second steps of a 10B model would outlast it).
STOP_CHECK_STEPS = 10
STOP_CHECK_SECONDS = 10.0


class Stop(Exception):
    """The run ends early on purpose, with an exit code and a message for the user."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def stop_check_interval(step_seconds: float) -> int:
    """Steps between two stop checks for steps of `step_seconds`: the most of 10, 5, 2 and 1 that keeps
    them STOP_CHECK_SECONDS apart (1 for steps longer than 5 s). Divisors of STOP_CHECK_STEPS, so that
    steps of up to a second are checked at its multiples."""
    return next((n for n in (STOP_CHECK_STEPS, 5, 2) if n * step_seconds <= STOP_CHECK_SECONDS), 1)


@contextlib.contextmanager
def run_lock(job: Job, env: Dist):
    """Hold the run directory's lock (rank 0 takes it, or finds its launch holding it) while the job
    runs; every rank learns the outcome, and all stop (Stop, exit 2) when another job holds it."""
    lock = HeldLock(job.run_dir, lock_token())
    refused: list[Optional[str]] = [None]  # why another job holds it (rank 0's, broadcast)
    if env.is_main:
        try:
            lock.__enter__()
        except RunLocked as exc:
            refused[0] = str(exc)
    dist.broadcast_object_list(refused, src=0)
    if refused[0] is not None:
        raise Stop(EXIT_SPEC, refused[0])
    try:
        yield
    finally:
        if env.is_main:
            lock.__exit__(None, None, None)


class StopChecks:
    """The stop checks of a training loop that starts after `step`: paced (`due`), agreed by the ranks (`check`).
    `signals` tells of a stop signal (`received`; None: none is watched). A stop saves through `checkpoints`, whose
    own agreements the same collective carries (an asynchronous write failed, checkpoint.every_minutes passed)."""

    def __init__(self, job: Job, env: Dist, signals: Any, checkpoints: CheckpointManager, step: int):
        self.job, self.env, self.signals, self.checkpoints = job, env, signals, checkpoints
        self.interval, self.checked = STOP_CHECK_STEPS, (step, time.perf_counter())
        self.first = step + 1  # a check after it sets the pace (its time includes the start-up's compiling)

    def due(self, step: int) -> bool:
        """Whether the ranks check for a stop after `step`."""
        return step % self.interval == 0 or step == self.first

    def check(self, step: int) -> None:
        """Agree with the other ranks on a stop (a signal to any rank, a request file seen by rank 0, or a
        rank's launcher gone); if there is one, checkpoint and stop with EXIT_PREEMPTED. Otherwise set the
        interval to the next check from the slowest rank's step time since this one's last (the same on
        every rank), and mark a save due where rank 0 found checkpoint.every_minutes passed."""
        asked = self.signals.received if self.signals else 0
        if self.env.is_main and stop_requested(self.job.run_dir, launch_time()):
            asked = STOP_REQUEST
        if launcher_gone():
            asked = LAUNCHER_GONE
        now = time.perf_counter()
        step_ms = 1000 * (now - self.checked[1]) / max(1, step - self.checked[0])
        reason, slowest_ms, writes, minutes_passed = all_max(
            [asked, math.ceil(step_ms), self.checkpoints.write_status(), self.checkpoints.minutes_passed()],
            self.env.device)
        self.checked, self.interval = (step, now), stop_check_interval(slowest_ms / 1000)
        self.checkpoints.raise_if_write_failed(writes)
        if minutes_passed:
            self.checkpoints.mark_due()
        if not reason:
            return
        path = self.checkpoints.save()
        cause = {STOP_REQUEST: "a stop was requested", LAUNCHER_GONE: "the launcher (fsdpclip launch) has ended"}.get(
            reason) or f"{signal.Signals(reason).name} received"
        raise Stop(EXIT_PREEMPTED, f"{cause}: stopped after step {step}; checkpoint saved at {path}; start the "
                                   f"job again in {self.job.run_dir} to resume")


def report_exit(job: Job, env: Dist, code: int, message: str, step: int) -> None:
    """Rank 0 writes exit.json; every rank waits for it, so that none ends (and has torchrun stop the
    others) before the report is written."""
    if env.is_main:
        write_exit_report(job.run_dir, code, message, step, str(latest_checkpoint(job.run_dir) or ""))
    dist.barrier()
