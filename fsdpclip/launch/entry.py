"""The rank entry point (what torchrun starts on every rank).

    python -m fsdpclip.launch.entry RUN_DIR/job.json      (or: fsdpclip train RUN_DIR/job.json)

`fsdpclip launch` on its own nodes has torchrun fork the ranks from it instead and run this file
(`--run-path`): they start with everything below imported (fsdpclip.launch.local.torchrun_command).
Started by hand, the ranks resume as a launch would: a checkpoint whose run this spec and world size would
change (its global batch, length or LR at the resume step, `jobspec.resume.consequences`) is refused (exit 2)
unless the spec accepts it, and `fsdpclip launch` is the one that keeps the global batch on other world sizes.

Exit codes (also written to RUN_DIR/exit.json by rank 0):
    0   finished
    2   the job cannot start: not a valid spec, the run directory is in use by another job, or
        its checkpoints cannot be used with this spec (or would change the run, not accepted)
    65  stopped on a non-finite gradient norm (optimizer.on_nonfinite = "stop"); the last
        good checkpoint is kept
    74  no space left: a checkpoint that does not fit on its disk (found before it is written) or a log
        that could not be written; the last complete checkpoint stays latest
    75  preempted (SIGTERM, SIGUSR1 or SIGINT on any rank, a stop request in RUN_DIR/stop, or the
        `fsdpclip launch` that started a rank gone):
        the ranks agree on it at their next stop check (after the first step, then every 10 steps;
        about every 10 s where steps take over a second), save a checkpoint and stop; start the job again
        in the same run directory to resume
A rank that crashes leaves RUN_DIR/logs/crash-rank-N.json for the launcher's report; one whose collective
failed because another rank is gone says so in one line and exits 1 (the launcher names the rank that ended).
A rank whose terminal hung up or whose output pipe closed writes on to RUN_DIR/logs/rank-N.out.
"""

from __future__ import annotations

import contextlib
import errno
import io
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from fsdpclip.model.build import left_out_of_open_clip, without_modules
from fsdpclip.parallel.cuda_graphs import keep_nccl_capturable
from fsdpclip.parallel.distributed import init_distributed, lost_peer
from fsdpclip.run.directory import EXIT_CRASH, EXIT_NO_SPACE, EXIT_SPEC, LOG_DIR
from fsdpclip.run.files import disk_free, keep_output, no_space_message
from fsdpclip.run.lock import StartupClock
from fsdpclip.run.reports import write_crash_report, write_exit_report

if TYPE_CHECKING:
    from fsdpclip.jobspec.job import Job

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# A rank whose peer is gone waits this long for torchrun to stop it (SIGTERM) before it exits itself: torchrun's
# agent reports only the first rank it finds ended, which is then the one that died (a signal's victim), not
# this one.
PEER_GONE_GRACE_S = 5
# This module imports only what forming the process group needs (torch, the spec); the trainer (DTensor
# and sympy, checkpointing, the data pipeline) is imported on a thread meanwhile, with OpenCLIP (in a rank
# forked from the launcher, OpenCLIP and DTensor are imported already).
TRAINER_MODULE = "fsdpclip.train.trainer"
# Other libraries' warnings a user cannot act on: torch's deprecation of the all_gather that OpenCLIP's losses
# call (once per rank and tower), and the DataLoader's count of one rank's workers against the cores (`validate`
# weighs the workers of every rank of a node against the node's cores instead).
UNACTIONABLE_WARNINGS = (
    (FutureWarning, r"torch\.distributed\.nn\.functional\.all_gather is deprecated"),
    (UserWarning, r"This DataLoader will create \d+ worker processes in total"),
)


class StopSignals:
    """Remembers SIGTERM/SIGUSR1/SIGINT so the loop can finish its step and checkpoint first (the data
    workers ignore them, see fsdpclip.data.batches.ignore_stop_signals, so a signal to the whole process
    group reaches the rank's decision, not its workers' deaths)."""

    def __init__(self):
        self.received = 0
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def wait(self, seconds: float) -> None:
        """Until a stop signal arrives, at most `seconds`."""
        deadline = time.monotonic() + seconds
        while not self.received and time.monotonic() < deadline:
            time.sleep(0.05)


def main(argv: Optional[list[str]] = None) -> int:
    """Train from a job file on this rank (torchrun sets RANK, WORLD_SIZE and the rendezvous)."""
    startup = StartupClock()
    startup.mark("imports")
    adopt_rank_environment()
    for category, message in UNACTIONABLE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    import argparse

    from fsdpclip.jobspec.jobfile import load_job
    from fsdpclip.jobspec.problems import SpecError
    from fsdpclip.jobspec.source import DATA_SOURCES

    parser = argparse.ArgumentParser(prog="fsdpclip.launch.entry", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("job", type=Path, help="the resolved job spec, usually RUN_DIR/job.json")
    args = parser.parse_args(argv)
    try:
        job = load_job(args.job)
    except SpecError as exc:
        print(f"fsdpclip.launch.entry: {args.job} is not a valid job spec:\n{exc}", file=sys.stderr)
        return EXIT_SPEC
    keep_output(job.run_dir / LOG_DIR / f"rank-{int(os.environ.get('RANK', '0')):05d}.out")  # once a terminal is gone
    signals = StopSignals()
    keep_nccl_capturable(job.fsdp.cuda_graph, os.environ)  # before any other thread reads the environment
    DATA_SOURCES[job.data.source].prepare_rank(job.data, job.launch.device)
    import_in_background([TRAINER_MODULE, "open_clip"],
                         absent=left_out_of_open_clip(job.model, job.logging.wandb is not None))
    env = init_distributed(job.launch.device, job.launch.collective_timeout_s, cpu_collectives=job.fsdp.cpu_offload)
    startup.mark("distributed")
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING,
                        format=f"[rank {env.rank}] %(levelname)s %(name)s: %(message)s", force=True)
    job.run_dir.mkdir(parents=True, exist_ok=True)
    trainer = None
    try:
        # The trainer first: this waits for the thread's import of it, which holds fsdpclip.checkpoint.sharded's.
        from fsdpclip.checkpoint.layout import CheckpointError
        from fsdpclip.jobspec.problems import ModelError
        from fsdpclip.train.stops import Stop, run_lock
        from fsdpclip.train.trainer import Trainer

        startup.mark("trainer_imported")
        try:
            with run_lock(job, env):
                trainer = Trainer(job, env, signals, startup)
                try:
                    return trainer.fit()
                finally:
                    trainer.close()
        except (Stop, CheckpointError, ModelError, SpecError) as exc:  # it cannot start as it is: no traceback
            message = getattr(exc, "message", str(exc))
            if env.is_main:
                print(f"fsdpclip.launch.entry: {message}", file=sys.stderr)
                if not isinstance(exc, Stop):  # a locked run directory's exit.json is its running job's
                    write_exit_report(job.run_dir, EXIT_SPEC, message, None, "")
            return EXIT_SPEC
    except BaseException as exc:
        full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC  # a log or report that did not fit
        try:
            if full and isinstance(exc, OSError):  # before the crash report: where only one more file fits, exit.json
                # names the checkpoint
                report_no_space(job, env.rank, exc, trainer.progress.step if trainer is not None else None)
            write_crash_report(job.run_dir, env.rank, exc)
        finally:
            stop_child_processes()
        if full:
            return EXIT_NO_SPACE
        lost = lost_peer(exc)
        if lost:  # another rank's end, which the launcher names: one line here, no traceback
            print(f"fsdpclip.launch.entry: rank {env.rank} lost its connection to another rank ({lost})",
                  file=sys.stderr)
            signals.wait(PEER_GONE_GRACE_S)
            return EXIT_CRASH
        raise
    finally:
        dist.destroy_process_group()


def report_no_space(job: Job, rank: int, error: OSError, step: Optional[int]) -> None:
    """A log or report that did not fit on its disk: one line naming the disk and the checkpoint kept, in exit.json
    too where it still fits (a lock this rank held leaves room for it once released; under `fsdpclip launch`, the
    launcher reports once it lets go of its lock)."""
    from fsdpclip.checkpoint.layout import kept_checkpoint, latest_checkpoint

    path = Path(error.filename or job.run_dir)
    message = f"rank {rank}: {no_space_message(path, disk_free(path))}; {kept_checkpoint(job.run_dir, full=True)}"
    print(f"fsdpclip.launch.entry: {message}", file=sys.stderr)
    with contextlib.suppress(OSError):
        write_exit_report(job.run_dir, EXIT_NO_SPACE, message, step, str(latest_checkpoint(job.run_dir) or ""))


def adopt_rank_environment() -> None:
    """What a new interpreter under torchrun has, also in a rank forked from the launcher (`fsdpclip launch`
    forks them where it can: fsdpclip.launch.local.torchrun_command): default actions for the signals torchrun's
    agent catches (SIGHUP, SIGQUIT; StopSignals takes the others), OMP_NUM_THREADS as torch's thread count
    (torch read the variable when it was imported, in the launcher), and output written out at each line
    at the latest (PYTHONUNBUFFERED, which the launcher's own streams did not have)."""
    for signum in (signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=True)


def stop_child_processes() -> None:
    """Kill this rank's multiprocessing children (data workers a failure left running). They ignore the
    stop signals (fsdpclip.data.batches.ignore_stop_signals), and at exit multiprocessing would send them SIGTERM
    and wait for them: the rank would never end, not even on SIGTERM, which it keeps for its own stop."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=10)


def import_in_background(modules: list[str], absent: tuple[str, ...] = ()) -> threading.Thread:
    """Start importing `modules`, in order, on a thread. The trainer's imports (DTensor and sympy, the
    checkpoint and data libraries) and OpenCLIP's (torchvision, timm, and transformers unless left out:
    0.7–4.5 s on the GPU hosts) then overlap forming the process group, whose rendezvous and backend
    set-up leave the interpreter free (a thread runs on while `init_process_group` waits for the other
    ranks); the main thread's first import of one waits for the thread's (Python locks each module
    while it is imported). Meant for modules the main thread imports from functions only, never while
    importing one of its own, and started when the main thread imports little else (forming the
    process group imports nothing of theirs): two threads importing modules that import each other
    would get a partly initialised one. A failure is left to the main thread's import to report. Not
    a daemon: an early exit waits for the imports rather than ending the interpreter under them. The
    modules in `absent` are left out of them (`without_modules`): OpenCLIP imports transformers for
    Hugging Face text towers and CoCa's generation, ~3 s of its import on the GPU hosts, which a model
    without a Hugging Face tower never uses. Returns the thread."""
    def load() -> None:
        with without_modules(absent):
            for module in modules:
                with contextlib.suppress(Exception):
                    importlib.import_module(module)

    thread = threading.Thread(target=load, name=f"import {', '.join(modules)}")
    thread.start()
    return thread


if __name__ == "__main__":
    sys.exit(main())
