"""The hostfile launcher backend (`fsdpclip launch --hostfile FILE`): torchrun on every host of a DeepSpeed-style
hostfile, each started over ssh from this command, the first host the rendezvous.

    # hostfile: one host per line, its slots (GPUs: processes on it); '#' starts a comment
    node-a slots=8
    node-b slots=8

`--include`/`--exclude` pick hosts and slots as DeepSpeed's do (`node-a@node-b:0,1`: all of node-a, slots 0 and 1
of node-b); `--nodes N` takes the first N hosts and `--gpus-per-node G` the first G slots of each. The code, the
interpreter (this one's path) and the run directory are on a filesystem every host shares, as DeepSpeed assumes.

On each host ssh runs this module (`python -m fsdpclip.launch.hostfile JOB_FILE NODE_RANK MASTER_ADDR`: the node's
launcher), which runs the node's torchrun under `local.supervise` as `fsdpclip launch --node-rank` would. This
launcher holds the run directory's lock, writes each node's output to RUN_DIR/logs/node-R.log (node 0's to the
console too) and passes signals on as lines of the ssh connection: a first SIGTERM or Ctrl-C reaches every node's
launcher as one (a stop request: the ranks checkpoint and exit 75), a second stops every node at once. A host that
cannot be reached, or whose node ends with a failure, stops the other nodes at once and ends the launch with one
line naming it; a connection that ends (this launcher killed) is a hang-up to the node's launcher: a stop request.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from fsdpclip.jobspec.backend import LAUNCHER_BACKENDS, LaunchError, LauncherBackend, LaunchFlags
from fsdpclip.launch.launcher import render
from fsdpclip.launch.local import (
    LAUNCHER_LOG, cuda_forbids_forked_ranks, kill_tree, last_checkpoint, node_torchrun,
    prepare_forked_ranks, supervise, torchrun_environment,
)
from fsdpclip.launch.torchrun import DELIBERATE
from fsdpclip.jobspec.problems import MAX_WORLD_SIZE
from fsdpclip.run.directory import (
    EXIT_CRASH, EXIT_STOPPED_AT_ONCE, JOB_FILE, LAUNCH_TIME_ENV, LOCK_TOKEN_ENV, LOG_DIR,
)
from fsdpclip.run.files import keep_output, read_text_file
from fsdpclip.run.lock import HeldLock, RunLocked
from fsdpclip.run.reports import exit_report, finish_exit_report, write_exit_report

if TYPE_CHECKING:
    from rich.console import Console

    from fsdpclip.jobspec.job import Job

NODE_MODULE = "fsdpclip.launch.hostfile"
# A host as the hostfile may name it: what ssh takes as a host and the rendezvous as an address; never an option.
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SSH = ["ssh", "-T", "-o", "BatchMode=yes"]  # no terminal, never a password prompt: a host that asks fails instead
SSH_FAILED = 255  # ssh's own exit status: the host could not be reached, or the connection was lost
# This launcher's environment that each node's launcher gets too (the spec's launch.env travels in job.json);
# CUDA_VISIBLE_DEVICES comes from the host's slots instead.
EXPORTED = ("PYTHON", "NCCL_", "CUDA_", "TORCH", "OMP_", "HF_", "WANDB_", "GLOO_", "TMPDIR")
TERM, KILL = "TERM", "KILL"  # the lines a node's launcher acts on: a SIGTERM of its own, everything killed at once


def read_hostfile(path: Path) -> dict[str, list[int]]:
    """A hostfile's hosts in order, each with its slots (0 .. slots-1); LaunchError naming the line that is wrong."""
    try:
        lines = read_text_file(Path(path)).splitlines()
    except OSError as exc:
        raise LaunchError(f"cannot read the hostfile {path}: {exc.strerror or exc}") from None
    hosts: dict[str, list[int]] = {}
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = words[1].removeprefix("slots=") if len(words) == 2 and words[1].startswith("slots=") else ""
        if not (slots.isascii() and slots.isdigit()) or not 1 <= int(slots) <= MAX_WORLD_SIZE:
            raise LaunchError(f"{path}:{number}: {line.strip()!r} is not 'HOST slots=N' (N at least 1, at most "
                              f"{MAX_WORLD_SIZE:,})")
        host = words[0]
        if not HOST_NAME.fullmatch(host):
            raise LaunchError(f"{path}:{number}: {host!r} is not a host name or IPv4 address (letters, digits, '.', "
                              "'-' and '_', not '-' first): a user or an IPv6 address goes in ~/.ssh/config (Host, "
                              "User, HostName), its Host name here")
        same = next((known for known in hosts if known.lower() == host.lower()), None)
        if same is not None:
            raise LaunchError(f"{path}:{number}: {host} is in the hostfile twice" + (
                f" (as {same}: host names ignore case)" if same != host else ""))
        hosts[host] = list(range(int(slots)))
    if not hosts:
        raise LaunchError(f"the hostfile {path} names no host")
    return hosts


def pick_hosts(hosts: dict[str, list[int]], include: Optional[str], exclude: Optional[str]) -> dict[str, list[int]]:
    """The hosts and slots an `--include` or `--exclude` filter leaves, in the hostfile's order (DeepSpeed's syntax:
    NODE[@NODE...], NODE = HOST or HOST:SLOT[,SLOT...]; a host alone means all of its slots)."""
    if include and exclude:
        raise LaunchError("give --include or --exclude, not both")
    chosen = include or exclude
    if not chosen:
        return hosts
    picked: dict[str, set[int]] = {} if include else {host: set(slots) for host, slots in hosts.items()}
    flag = "--include" if include else "--exclude"
    for node in chosen.split("@"):
        host, _, slot_list = node.partition(":")
        if host not in hosts:
            raise LaunchError(f"{flag} {chosen!r}: {host!r} is not in the hostfile")
        try:
            slots = {int(slot) for slot in slot_list.split(",")} if slot_list else set(hosts[host])
        except ValueError:
            raise LaunchError(f"{flag} {chosen!r}: {slot_list!r} is not a list of slot numbers") from None
        if not slots <= set(hosts[host]):
            raise LaunchError(f"{flag} {chosen!r}: {host} has slots 0 to {len(hosts[host]) - 1}")
        if include:
            picked[host] = picked.get(host, set()) | slots
        else:
            picked[host] -= slots
    left = {host: sorted(picked[host]) for host in hosts if picked.get(host)}
    if not left:
        raise LaunchError(f"--exclude {exclude!r} leaves no host")
    return left


class HostfileBackend(LauncherBackend):
    """torchrun on every host of a hostfile, each started over ssh; the first host is the rendezvous."""

    name = "hostfile"
    metavar = "FILE"
    help = ("Run torchrun on every host of FILE ('HOST slots=N' lines, as DeepSpeed's) over ssh, the first host the "
            "rendezvous; --include/--exclude pick hosts and slots.")

    def __init__(self, flags: LaunchFlags):
        super().__init__(flags)
        self.hosts: dict[str, list[int]] = {}

    def check_flags(self) -> None:
        """Read the hostfile, keep the hosts and slots the flags pick; every host needs as many slots."""
        flags = self.flags
        if flags.partition is not None or flags.time_limit is not None:
            raise LaunchError("--partition and --time are Slurm options, not --hostfile's")
        if flags.node_rank is not None or flags.master_addr is not None:
            raise LaunchError("--hostfile starts every node itself, the first host the rendezvous: no --node-rank "
                              "or --master-addr")
        if not flags.dry_run and shutil.which(SSH[0]) is None:
            raise LaunchError("--hostfile needs ssh on the PATH (use --dry-run to only print the ssh commands)")
        assert flags.backend_value is not None  # --hostfile FILE
        hosts = pick_hosts(read_hostfile(Path(flags.backend_value)), flags.include, flags.exclude)
        if flags.nodes is not None:
            if flags.nodes > len(hosts):
                raise LaunchError(f"--nodes {flags.nodes}: there are {len(hosts)} host(s) to run on")
            hosts = dict(list(hosts.items())[:flags.nodes])
        if flags.gpus_per_node is not None:
            short = [host for host, slots in hosts.items() if len(slots) < flags.gpus_per_node]
            if short:
                raise LaunchError(f"--gpus-per-node {flags.gpus_per_node}: fewer slots on {', '.join(short)}")
            hosts = {host: slots[:flags.gpus_per_node] for host, slots in hosts.items()}
        if len({len(slots) for slots in hosts.values()}) > 1:
            counts = ", ".join(f"{host} {len(slots)}" for host, slots in hosts.items())
            raise LaunchError(f"every host needs as many slots (processes) as the others: {counts} (even them with "
                              "--include or --gpus-per-node)")
        self.hosts = hosts

    def overrides(self) -> list[str]:
        """The hostfile's hosts and slots are the job's nodes and processes per node."""
        return [f"launch.nodes={len(self.hosts)}", f"launch.gpus_per_node={len(next(iter(self.hosts.values())))}"]

    def start(self, job: Job, console: Console) -> Optional[dict]:
        """Take the run directory, write RUN_DIR/job.json and run every node over ssh (or only print the ssh
        commands)."""
        from rich.markup import escape

        console.print(f"[bold]run directory[/bold] {escape(str(job.run_dir))}", highlight=False, soft_wrap=True)
        token, started = uuid.uuid4().hex, time.time()
        commands = [ssh_command(job, host, rank, slots, self.head, token, started)
                    for rank, (host, slots) in enumerate(self.hosts.items())]
        for rank, command in enumerate(commands):
            console.print(escape(f"node {rank}: {render(command)}"), highlight=False, soft_wrap=True)
        if self.flags.dry_run:
            return None
        console.print(escape(f"each node's output: {job.run_dir / LOG_DIR}/node-R.log (node 0's below)"),
                      highlight=False, soft_wrap=True)
        lock = HeldLock(job.run_dir, token)
        try:
            (job.run_dir / LOG_DIR).mkdir(parents=True, exist_ok=True)
            with lock:
                job.save(job.run_dir / JOB_FILE)
                keep_output(job.run_dir / LOG_DIR / LAUNCHER_LOG)
                nodes = SshNodes(list(self.hosts), job.run_dir / LOG_DIR)
                status = nodes.run(commands)
        except RunLocked as exc:
            raise LaunchError(str(exc)) from None
        except OSError as exc:
            raise LaunchError(f"cannot use the run directory {job.run_dir}: {exc.strerror or exc}") from None
        return nodes.exit_report(job.run_dir, started, status)

    @property
    def head(self) -> str:
        """The rendezvous host: the first, by the name the hostfile gives it."""
        return next(iter(self.hosts))


def ssh_command(job: Job, host: str, node_rank: int, slots: list[int], head: str, token: str,
                launched: float) -> list[str]:
    """ssh to `host` running its node's launcher there: in this directory, with this launcher's environment that
    the run needs (EXPORTED), the launch's lock token and start time, and its slots as the visible GPUs."""
    env = {key: value for key, value in os.environ.items()
           if key.startswith(EXPORTED) and key != "CUDA_VISIBLE_DEVICES"}
    if job.launch.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    env.update({LOCK_TOKEN_ENV: token, LAUNCH_TIME_ENV: repr(launched)})
    remote = ["exec", "env", *(f"{key}={value}" for key, value in sorted(env.items())), sys.executable, "-m",
              NODE_MODULE, str(job.run_dir / JOB_FILE), str(node_rank), head]
    return [*SSH, *job.launch.ssh_options, "--", host, f"cd {shlex.quote(os.getcwd())} && {render(remote)}"]


class SshNodes:
    """The ssh connections of a launch, one per host, each in a session of its own (a terminal's signals reach
    only this launcher, which passes them on) with its output appended to RUN_DIR/logs/node-R.log; node 0's
    output is copied to the console as it comes. While `run` runs, a first SIGTERM, SIGHUP or Ctrl-C becomes a
    TERM line to every node's launcher (a stop request there), a second a KILL line (everything stopped at once);
    the first node that ends with a failure has the others killed."""

    def __init__(self, hosts: list[str], logs: Path):
        self.hosts, self.logs = hosts, [logs / f"node-{rank}.log" for rank in range(len(hosts))]
        self.received: list[int] = []
        self.failed: Optional[int] = None  # the node whose failure ended the launch
        self.processes: list[subprocess.Popen] = []

    def run(self, commands: list[list[str]]) -> int:
        """Start every node and wait for all; the launch's exit status: EXIT_STOPPED_AT_ONCE after a second
        signal, else the failed node's, else the first non-zero one, else 0."""
        previous = {signum: signal.signal(signum, self._signalled)
                    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        self.logs[0].touch()
        console = threading.Thread(target=copy_output, daemon=True,
                                   args=(self.logs[0], self.logs[0].stat().st_size, self.processes))
        try:
            for command, log in zip(commands, self.logs):
                with open(log, "ab") as out:
                    self.processes.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out,
                                                           stderr=subprocess.STDOUT, start_new_session=True))
            console.start()
            told = 0  # the signals passed on so far (here, not in the handler: a node started since gets them too)
            while True:
                ended = all(process.poll() is not None for process in self.processes)  # then one last look
                for rank, process in enumerate(self.processes):
                    if process.poll() not in (None, 0, *DELIBERATE) and self.failed is None and told < 2:
                        self.failed, told = rank, 2
                        self.tell(KILL)
                while told < min(len(self.received), 2):
                    self.tell(KILL if told else TERM)
                    told += 1
                if ended:
                    break
                time.sleep(0.2)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            for process in self.processes:
                with contextlib.suppress(OSError):  # a line it never read
                    if process.stdin is not None:
                        process.stdin.close()
        if console.is_alive():
            console.join()
        if len(self.received) > 1:
            return EXIT_STOPPED_AT_ONCE
        if self.failed is not None:
            return self.processes[self.failed].returncode
        return next((process.returncode for process in self.processes if process.returncode), 0)

    def tell(self, line: str) -> None:
        """A line to every node's launcher that still runs."""
        for process in self.processes:
            if process.poll() is None and process.stdin is not None:
                try:
                    process.stdin.write(f"{line}\n".encode())
                    process.stdin.flush()
                except OSError:  # it has just ended
                    pass

    def _signalled(self, signum, frame) -> None:
        if signum == signal.SIGHUP and self.received:
            return  # as the local launcher: a hang-up never stops at once
        self.received.append(signum)
        if len(self.received) == 1:
            print(f"fsdpclip: {signal.Signals(signum).name}: every node's ranks checkpoint and stop at their next "
                  "stop check (again to stop at once)", file=sys.stderr, flush=True)

    def exit_report(self, run_dir: Path, since: float, status: int) -> dict:
        """How the launch ended (written to exit.json): a host ssh could not reach or lost, by name and ssh's
        own line; else the trainer's report or the crash reports (`finish_exit_report`), a node that ended
        without either named."""
        if self.failed is None or status == EXIT_STOPPED_AT_ONCE:
            return finish_exit_report(run_dir, since, status, checkpoint=last_checkpoint(run_dir))
        node = f"{self.hosts[self.failed]} (node {self.failed})"
        if status != SSH_FAILED:
            return finish_exit_report(run_dir, since, status, ended=node, checkpoint=last_checkpoint(run_dir))
        write_exit_report(run_dir, EXIT_CRASH, f"ssh to {node} failed: {last_line(self.logs[self.failed])}", None, "")
        report = exit_report(run_dir, since)
        assert report is not None  # written just above
        return report


def copy_output(log: Path, offset: int, processes: list[subprocess.Popen]) -> None:
    """Copy what `log` holds from `offset` on to this process's stdout until the first of `processes` has ended."""
    with open(log, "rb") as source:
        source.seek(offset)
        while True:
            ended = processes[0].poll() is not None
            chunk = source.read()
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            elif ended:
                return
            else:
                time.sleep(0.1)


def last_line(log: Path) -> str:
    """The last line of a node's log that says something (ssh's error, for a host it could not reach)."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return lines[-1] if lines else f"exit status {SSH_FAILED}"


def run_node(job_file: Path, node_rank: int, master_addr: str) -> int:
    """One node of a launch over ssh (what ssh runs on each host): torchrun for this node under
    `local.supervise`, as `fsdpclip launch --node-rank` would run it, with the launch's lock token and start time
    (from the environment), following the launcher's lines on stdin (`LauncherLines`)."""
    from fsdpclip.jobspec.jobfile import load_job

    lines = LauncherLines()
    job = load_job(job_file)
    keep_output(job.run_dir / LOG_DIR / f"node-{node_rank}.log")  # once the ssh connection is gone
    new_interpreters = prepare_forked_ranks(job) or cuda_forbids_forked_ranks(job)
    flags = LaunchFlags(backend=HostfileBackend.name, node_rank=node_rank, master_addr=master_addr)
    command = node_torchrun(job, flags, fork_ranks=new_interpreters is None)
    env = {**torchrun_environment(job, os.environ[LOCK_TOKEN_ENV], new_interpreters is None),
           LAUNCH_TIME_ENV: os.environ[LAUNCH_TIME_ENV]}
    print(f"fsdpclip: node {node_rank} on {socket.gethostname()}: {render(command)}", flush=True)
    lines.starting()
    status = supervise(command, env, job.run_dir, started=lines.started)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the run is over: the connection's end changes nothing
    return EXIT_STOPPED_AT_ONCE if lines.kill_ended() else status


class LauncherLines:
    """The launcher's lines on this node launcher's stdin (the ssh connection), followed on a thread from its
    start: TERM as a SIGTERM to this process (`supervise`'s stop request, or at once after another), KILL by
    killing torchrun and everything under it, the connection's end (the launcher gone) as a hang-up (a stop
    request). Before torchrun starts, KILL or the end exits at once (nothing runs yet) and TERM waits for it."""

    def __init__(self):
        self.guard = threading.Lock()
        self.torchrun: Optional[int] = None
        self.forking, self.killed = False, False
        self.pending: list[str] = []
        threading.Thread(target=self._follow, daemon=True, name="fsdpclip-launcher").start()

    def starting(self) -> None:
        """torchrun is about to start: from now on every line waits for it (`started`)."""
        with self.guard:
            self.forking = True

    def started(self, torchrun: int) -> None:
        """torchrun runs, the signal handlers are in place: act on the lines that waited."""
        with self.guard:
            self.torchrun = torchrun
            for line in self.pending:
                self._act(line)

    def kill_ended(self) -> bool:
        """Whether a KILL line killed torchrun, asked once that kill has ended (every process under torchrun gone:
        torchrun itself ends first, which ends `supervise`)."""
        with self.guard:  # held while a line is acted on
            return self.killed

    def _follow(self) -> None:
        pending = b""
        while chunk := os.read(0, 1024):  # not sys.stdin: a daemon thread must hold none of its locks at exit
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self._line(line.decode(errors="replace").strip())
        self._line("")

    def _line(self, line: str) -> None:
        with self.guard:
            if self.torchrun is not None:
                self._act(line)
            elif line == TERM or self.forking:
                self.pending.append(line)
            elif line in (KILL, ""):
                os._exit(EXIT_STOPPED_AT_ONCE)

    def _act(self, line: str) -> None:
        if line == TERM:
            os.kill(os.getpid(), signal.SIGTERM)
        elif line == KILL:
            self.killed = True
            if self.torchrun is not None:
                kill_tree(self.torchrun)
        elif line == "":
            os.kill(os.getpid(), signal.SIGHUP)


if __name__ == "__main__":
    sys.exit(run_node(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))


LAUNCHER_BACKENDS.register(HostfileBackend)
