"""The run directory `<output_dir>/<name>/`: the files that describe one run, the lock that makes it one
job's, and how each launch ended.

    job.json       the resolved spec the ranks train from (absolute paths)
    launches/      every start's resolved spec and what it changed against the checkpoint it resumed
    metrics.jsonl  what the trainer logged
    checkpoints/   sharded checkpoints (fsdpclip.checkpoint.sharded)
    exit.json      how the last launch ended: code, message, step, checkpoint
    lock           who runs in it now: the processes of the job (pid and start time), host, since; refreshed
                   while it runs
    .lock.guard    what a process holds (flock) while it reads and replaces the lock
    stop           a request to checkpoint and stop, from `fsdpclip launch` or the Slurm script
    logs/          Slurm's and each node's output; a report from each rank that crashed
    wandb-id       the Weights & Biases run this run logs to (a relaunch continues it)
    wandb/         that W&B run's local files (unless WANDB_DIR puts them elsewhere)
    compile-cache.bin  torch.compile's artifacts of the first compiled step, loaded by later launches
    imported.json  the open_clip_train checkpoint the run continues, and what the spec changes (`fsdpclip import`)

Pure file handling, no torch: the launcher imports it before any rank starts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

JOB_FILE, EXIT_FILE, LOG_DIR, LAUNCHES, LOCK_FILE, STOP_FILE = "job.json", "exit.json", "logs", "launches", "lock", "stop"
WANDB_ID_FILE, IMPORT_FILE = "wandb-id", "imported.json"
# How a run ends (the trainer's exit code, in exit.json): fsdpclip.train.entry says when each is used.
EXIT_OK, EXIT_CRASH, EXIT_SPEC, EXIT_NONFINITE, EXIT_NO_SPACE, EXIT_PREEMPTED = 0, 1, 2, 65, 74, 75
# When `fsdpclip launch` started the job (seconds since the epoch), for time-to-first-step.
LAUNCH_TIME_ENV = "FSDPCLIP_LAUNCH_TIME"
# The lock token of the launch that started the ranks (they hold the lock through it).
LOCK_TOKEN_ENV = "FSDPCLIP_LOCK_TOKEN"
LOCK_GUARD = ".lock.guard"
# The launcher of this node's ranks, as "pid:start ticks": they stop (checkpoint, exit 75) once it is gone.
LAUNCHER_ENV = "FSDPCLIP_LAUNCHER"
LOCK_REFRESH_S = 30
# A lock of another host is stale once it has not been refreshed for this long (its job died with
# its node); on the same host the holder's pid tells at once.
LOCK_STALE_S = 600


def write_atomically(path: Path, content: str | bytes) -> None:
    """Write a whole file or nothing: readers never see half of it (also across nodes)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


MAX_TEXT_BYTES = 64 * 2 ** 20  # a spec, a model config, a class-name list: far smaller than this
FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
              stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def special_file(path: Path) -> Optional[str]:
    """What a path the user named is when it is there but is no regular file (a FIFO, a device, a directory),
    else None: reading it would block, never end, or fail."""
    try:
        kind = stat.S_IFMT(os.stat(path).st_mode)
    except OSError:
        return None
    return None if kind == stat.S_IFREG else FILE_KINDS.get(kind, "a special file")


def read_text_file(path: Path, limit: int = MAX_TEXT_BYTES) -> str:
    """A UTF-8 text file the user named, read only if it is a regular file of at most `limit` bytes: a FIFO
    would block forever and a device never end (/dev/zero fills the memory). Anything else is an OSError whose
    strerror says why (not UTF-8 included), as a missing file's does."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO waits for a writer without it
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        kind = stat.S_IFMT(os.fstat(descriptor).st_mode)
        if kind != stat.S_IFREG:
            raise OSError(None, f"not a regular file but {FILE_KINDS.get(kind, 'a special file')}", str(path))
        with os.fdopen(descriptor, "rb", closefd=False) as file:
            data = file.read(limit + 1)
    finally:
        os.close(descriptor)
    if len(data) > limit:
        raise OSError(None, f"larger than {limit:,} bytes, more than a text file here holds", str(path))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise OSError(None, f"not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line})", str(path)) from None


def disk_free(path: Path) -> int:
    """Bytes free for this user on the filesystem that holds (or would hold) `path`."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def disk_of(path: Path) -> tuple[str, str]:
    """The device (what is mounted: /dev/nvme0n1p2, tmpfs, server:/export) and the mount point holding `path`
    (Linux: /proc/self/mountinfo); ('the disk', '/') where that cannot be read."""
    where, found = os.path.realpath(path), ("the disk", "/")
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    def unescape(field: str) -> str:  # the kernel writes a space in a path as \040
        return re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), field)

    for line in mounts:
        fields, _, rest = line.partition(" - ")
        mount, source = unescape(fields.split()[4]), unescape(rest.split()[1])
        inside = where == mount or where.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(found[1]):
            found = (source, mount)
    return found


def no_space_message(path: Path, free: int, needed: Optional[int] = None) -> str:
    """What a write that does not fit says: the device, its mount point, the path, what it needs and what is free."""
    device, mount = disk_of(path)
    need = f"needed ~{megabytes(needed)}, " if needed is not None else ""
    return f"no space left on {device} ({mount}) writing {path}: {need}{megabytes(free)} free"


def megabytes(count: int) -> str:
    return f"{count / 1e6:,.0f} MB" if count >= 1e6 else f"{count / 1e6:.2f} MB"


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


# ---------------------------------------------------------------------- the lock
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


def launcher_gone() -> bool:
    """Whether the `fsdpclip launch` that started this rank has ended (killed, SIGKILL included) while the
    rank runs (LAUNCHER_ENV; without it, as under Slurm, never)."""
    launcher = os.environ.get(LAUNCHER_ENV, "")
    pid, _, ticks = launcher.partition(":")
    return pid.isdigit() and ticks.isdigit() and not process_alive(int(pid), int(ticks))


# ------------------------------------------------------------- stop requests
def request_stop(run_dir: Path) -> None:
    """Ask the running job to checkpoint and stop (its ranks look every few steps)."""
    write_atomically(Path(run_dir) / STOP_FILE, f"{time.time()}\n")


def stop_requested(run_dir: Path, since: float) -> bool:
    """Whether a stop was requested after `since` (an older request was another launch's)."""
    try:
        return (Path(run_dir) / STOP_FILE).stat().st_mtime >= since
    except OSError:
        return False


# ------------------------------------------------------- output that outlives its terminal
HANGUP_ERRORS = (errno.EIO, errno.EPIPE)  # a terminal that hung up, a pipe whose reader is gone


class DivertingStream:
    """sys.stdout or sys.stderr, outliving the terminal or pipe it writes to: once a write or flush fails with
    one of HANGUP_ERRORS, this process's stdout and stderr (file descriptors 1 and 2, so also what native code
    and child processes write) go to `path`, appended, and the write is made there."""

    def __init__(self, stream, path: Path):
        self.stream, self.path = stream, Path(path)

    def write(self, text: str) -> int:
        return self._diverted_on_hangup("write", text)

    def flush(self) -> None:
        return self._diverted_on_hangup("flush")

    def _diverted_on_hangup(self, method: str, *args):
        try:
            return getattr(self.stream, method)(*args)
        except OSError as exc:
            if exc.errno not in HANGUP_ERRORS:
                raise
            divert_output(self.path)
            return getattr(self.stream, method)(*args)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def divert_output(path: Path) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2) to `path`, appended."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):
        os.dup2(descriptor, target)
    os.close(descriptor)


def keep_output(path: Path) -> None:
    """Make sys.stdout and sys.stderr DivertingStreams to `path` (replacing the path of any they are already)."""
    sys.stdout, sys.stderr = (DivertingStream(stream.stream if isinstance(stream, DivertingStream) else stream, path)
                              for stream in (sys.stdout, sys.stderr))


# ------------------------------------------------------------ how a launch ended
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


def write_crash_report(run_dir: Path, rank: int, error: BaseException) -> None:
    """What killed a rank, for the launcher's last line (each rank its own file: no race)."""
    _write_crash(run_dir, {"rank": rank, "error": " ".join(f"{type(error).__name__}: {error}".split())[:500]})


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


def finish_exit_report(run_dir: Path, since: float, status: int) -> dict:
    """The report of a launch that ended with exit `status`: the trainer's own, or, when the trainer
    could not write one (a rank crashed or was killed), one made from the crash reports (a rank killed by a
    signal first: the others' errors follow from it) or the status. Written to exit.json either way."""
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
    elif status == 130:
        message = "stopped at once (a second interrupt): the steps since the last checkpoint are lost"
    elif status < 0 or status > 128:
        message = f"the job was killed (exit status {status}) before the trainer could report"
    else:
        message = f"the job ended with exit status {status} before the trainer could report (see the output above)"
    code = status if status > 0 else 1
    write_exit_report(run_dir, code, message, None, "")
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
    """`python -m fsdpclip.run.directory RUN_DIR SINCE STATUS`: finish the exit report (the Slurm script's
    last step) and print the code to exit with."""
    run_dir, since, status = (argv or sys.argv[1:])[:3]
    print(finish_exit_report(Path(run_dir), float(since), int(status))["code"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
