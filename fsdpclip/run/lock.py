"""The run directory's lock (who runs in it: the processes of the job, host, since; taken under a guard and
refreshed while the job runs), the processes it names, and when a launch and this process started. No torch."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from fsdpclip.run.directory import (
    LAUNCHER_ENV, LAUNCH_TIME_ENV, LOCK_FILE, LOCK_GUARD, LOCK_REFRESH_S, LOCK_STALE_S, LOCK_TOKEN_ENV,
)
from fsdpclip.run.files import write_atomically


def launch_time() -> float:
    """When `fsdpclip launch` (or the batch script) started the job, else when this process started."""
    launched = os.environ.get(LAUNCH_TIME_ENV)
    return float(launched) if launched is not None else process_start()


def process_start() -> float:
    """When this process started, by exec or fork (Linux: from /proc, so before its imports), else now (also
    when /proc disagrees with itself, as a container's own /proc/uptime beside the host's start times does)."""
    now, started = time.time(), start_ticks(os.getpid())
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return now
    if started is None:
        return now
    began = now - uptime + started / os.sysconf("SC_CLK_TCK")
    return began if now - 600 <= began <= now else now


class StartupClock:
    """Seconds from the launch to the end of each start-up phase on this rank, in order: what the first
    metrics record reports as `startup_s` ("process": this rank's process started; from `fsdpclip
    launch`, whose validation comes before its launch time, that is torchrun's start-up)."""

    def __init__(self):
        self.phases = {"process": round(process_start() - launch_time(), 2)}

    def mark(self, phase: str) -> None:
        """The end of `phase`, the first time it is marked."""
        if phase not in self.phases:
            self.phases[phase] = round(time.time() - launch_time(), 2)

    def summary(self) -> str:
        """The phases on one line."""
        return ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in self.phases.items())


def start_ticks(pid: int) -> Optional[int]:
    """When a live process started (clock ticks since boot: /proc/PID/stat field 22), which tells it from a
    later process given the same pid; None when there is no such live process (a zombie is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def process_alive(pid: int, ticks: int = 0) -> bool:
    """Whether the process `pid` that started at `ticks` (0: whenever) still runs. Without /proc (another
    system), whether the pid is taken."""
    if not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    started = start_ticks(pid)
    return started is not None and ticks in (0, started)


def process_identity(pid: Optional[int] = None) -> tuple[int, int]:
    """A process as the lock records it: its pid and start ticks (this process by default)."""
    pid = os.getpid() if pid is None else pid
    return pid, start_ticks(pid) or 0


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory: the process that took the lock (pid, its start ticks), host, token, since,
    and the job's other processes that joined it (torchrun, rank 0) as (pid, start ticks) pairs. The lock is
    live while any of them runs."""

    pid: int
    host: str
    token: str
    since: float
    command: str = ""
    started: int = 0
    members: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, text: str) -> "Holder":
        """A holder from the lock file's JSON (TypeError, ValueError: not a lock)."""
        fields = json.loads(text)
        fields["members"] = tuple((int(pid), int(ticks)) for pid, ticks in fields.get("members", ()))
        return cls(**fields)

    def processes(self) -> list[tuple[int, int]]:
        """Every process of the job the lock names, the one that took it first."""
        return [(self.pid, self.started), *(m for m in self.members if m != (self.pid, self.started))]

    def running(self, but: Optional[tuple[int, int]] = None) -> list[int]:
        """The pids of its processes that still run on this host (leaving out `but`)."""
        return [pid for pid, ticks in self.processes() if (pid, ticks) != but and process_alive(pid, ticks)]

    def __str__(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        text = f"pid {self.pid} on {self.host} (since {started}{': ' + self.command if self.command else ''})"
        running = self.running() if self.host == socket.gethostname() else [self.pid]
        if self.pid not in running and running:
            text += f", which has ended; its processes {', '.join(map(str, running))} still run"
        return text


class RunLocked(Exception):
    """The run directory belongs to a job that is still running."""

    def __init__(self, run_dir: Path, holder: Holder):
        super().__init__(f"{run_dir} is in use by {holder}: wait for that job to end or stop it, or give this one "
                         "another run.name")
        self.holder = holder


def lock_token() -> str:
    """The token this process holds (or may take over) the lock with: its launch's, the Slurm job's
    (so a requeued job takes its own lock back), or a new one."""
    if os.environ.get(LOCK_TOKEN_ENV):
        return os.environ[LOCK_TOKEN_ENV]
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    return uuid.uuid4().hex


def lock_holder(run_dir: Path) -> Optional[Holder]:
    """The live holder of a run directory's lock, or None (no lock, or a stale one)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        holder = Holder.parse(path.read_text())
        refreshed = path.stat().st_mtime
    except (OSError, ValueError, TypeError):
        return None
    if holder.host == socket.gethostname():
        return holder if holder.running() else None
    return holder if time.time() - refreshed < LOCK_STALE_S else None


@contextlib.contextmanager
def _lock_guard(run_dir: Path):
    """Only one process at a time reads and replaces the lock (flock on RUN_DIR/.lock.guard), so that taking
    over a stale lock is one step. A filesystem without flock leaves the step unguarded."""
    with open(Path(run_dir) / LOCK_GUARD, "a") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def acquire_lock(run_dir: Path, token: str, pid: Optional[int] = None) -> bool:
    """Take the run directory for this job (this process, or `pid`): True when taken (no lock, or a stale
    one: none of its processes runs), False when the job holds it already (the same token: the process
    joins it; a requeued Slurm job on another host takes it afresh), RunLocked when a live job of another
    does."""
    path = Path(run_dir) / LOCK_FILE
    process = process_identity(pid)
    with _lock_guard(run_dir):
        holder = lock_holder(run_dir)
        if holder is not None and holder.token != token:
            raise RunLocked(Path(run_dir), holder)
        if holder is not None and holder.host == socket.gethostname():
            if process not in holder.processes():
                holder = replace(holder, members=(*holder.members, process))
                write_atomically(path, json.dumps(asdict(holder)) + "\n")
            return False
        mine = Holder(process[0], socket.gethostname(), token, time.time(), " ".join(sys.argv)[:200], process[1])
        write_atomically(path, json.dumps(asdict(mine)) + "\n")
        return True


def release_lock(run_dir: Path, token: str) -> None:
    """Give the run directory back when this process is the last of the job (the same token) that runs;
    while another (torchrun, a rank) still does, the lock stays theirs."""
    path = Path(run_dir) / LOCK_FILE
    with _lock_guard(run_dir):
        try:
            holder = Holder.parse(path.read_text())
        except (OSError, ValueError, TypeError):
            return
        if holder.token == token and not holder.running(but=process_identity()):
            path.unlink(missing_ok=True)


class HeldLock:
    """Holds a run directory's lock while a job runs: taken or joined on entry, refreshed every
    LOCK_REFRESH_S, given back on exit (`release_lock`)."""

    def __init__(self, run_dir: Path, token: str):
        self.run_dir, self.token = Path(run_dir), token
        self.taken = False
        self.done = threading.Event()

    def __enter__(self) -> "HeldLock":
        self.taken = acquire_lock(self.run_dir, self.token)
        threading.Thread(target=self._refresh, daemon=True, name="fsdpclip-lock").start()
        return self

    def add(self, pid: int) -> None:
        """Another process of the job (torchrun) holds the lock too: it stays live while that one runs."""
        acquire_lock(self.run_dir, self.token, pid)

    def _refresh(self) -> None:
        path = self.run_dir / LOCK_FILE
        while not self.done.wait(LOCK_REFRESH_S):
            try:
                os.utime(path)
            except OSError:
                pass

    def __exit__(self, *exc) -> None:
        self.done.set()
        release_lock(self.run_dir, self.token)


def launcher_reports() -> bool:
    """Whether the `fsdpclip launch` that started this rank still runs, to end with the exit report's message
    (which the rank then need not print too); under Slurm, or started by hand, no launcher does."""
    return bool(os.environ.get(LAUNCHER_ENV)) and not launcher_gone()


def launcher_gone() -> bool:
    """Whether the `fsdpclip launch` that started this rank has ended (killed, SIGKILL included) while the
    rank runs (LAUNCHER_ENV; without it, as under Slurm, never)."""
    launcher = os.environ.get(LAUNCHER_ENV, "")
    pid, _, ticks = launcher.partition(":")
    return pid.isdigit() and ticks.isdigit() and not process_alive(int(pid), int(ticks))


