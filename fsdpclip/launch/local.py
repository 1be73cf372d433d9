"""The default launcher backend: torchrun on this node, run under the launcher's supervision.

`torchrun_command` renders torchrun for this node (standalone on one node, a static rendezvous on
several, where you start each node yourself with its --node-rank). `run_local` takes the run directory
and runs torchrun under `supervise` (signals to the launcher become a checkpoint-and-stop request); torchrun
runs in a fork of the launcher (`ForkedTorchrun`) and, where it can, forks the ranks too
(`prepare_forked_ranks`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import select
import signal
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, TypeVar

from fsdpclip.jobspec.backend import LAUNCHER_BACKENDS, LaunchError, LauncherBackend, LaunchFlags
from fsdpclip.launch.launcher import TORCHRUN, TRAIN_MODULE, render
from fsdpclip.run.directory import (
    EXIT_STOPPED_AT_ONCE, JOB_FILE, LAUNCHER_ENV, LAUNCH_TIME_ENV, LOCK_TOKEN_ENV, LOG_DIR,
)
from fsdpclip.run.files import keep_output
from fsdpclip.run.lock import HeldLock, RunLocked, process_identity
from fsdpclip.run.reports import finish_exit_report, request_stop

if TYPE_CHECKING:
    from rich.console import Console

    from fsdpclip.jobspec.job import Job

LAUNCHER_LOG = "launch.out"  # RUN_DIR/logs/: the launcher's and torchrun's output once their terminal is gone


class LocalBackend(LauncherBackend):
    """torchrun on this node; a job of several nodes is one launch per node (--node-rank, --master-addr)."""

    name = "local"
    help = "Run torchrun on this node (the default)."
    runs_here = True

    def __init__(self, flags: LaunchFlags):
        super().__init__(flags)
        self.new_interpreters: Optional[str] = None  # why the ranks cannot be forked from this launcher

    def check_flags(self) -> None:
        flags = self.flags
        if flags.partition is not None or flags.time_limit is not None:
            raise LaunchError("--partition and --time are Slurm options: add --slurm")
        if flags.include is not None or flags.exclude is not None:
            raise LaunchError("--include and --exclude pick hosts of a hostfile: add --hostfile FILE")
        if flags.node_rank is not None and flags.master_addr is None:
            raise LaunchError("--node-rank needs --master-addr, the address of node 0")

    def prepare(self, job: Job) -> None:
        self.new_interpreters = prepare_forked_ranks(job)

    def forks_ranks(self) -> bool:
        return self.new_interpreters is None

    def check_job(self, job: Job) -> None:
        """A launch on several nodes needs one launch per node with its rank (or another backend)."""
        nodes, node_rank = job.launch.nodes, self.flags.node_rank
        if nodes > 1 and node_rank is None:
            raise LaunchError(f"{nodes} nodes without Slurm: run `fsdpclip launch` on each node with --node-rank R "
                              "and --master-addr (node 0's address), or add --slurm")
        if node_rank is not None and node_rank >= nodes:
            raise LaunchError(f"--node-rank {node_rank} is not below the number of nodes ({nodes})")

    def start(self, job: Job, console: Console) -> Optional[dict]:
        from rich.markup import escape

        console.print(f"[bold]run directory[/bold] {escape(str(job.run_dir))}", highlight=False, soft_wrap=True)
        new_interpreters = self.new_interpreters or cuda_forbids_forked_ranks(job)
        fork_ranks = new_interpreters is None
        if new_interpreters:
            console.print(f"[dim]the ranks start as new interpreters: {escape(new_interpreters)}[/dim]",
                          highlight=False)
        console.print(escape(shown_command(node_torchrun(job, self.flags, fork_ranks),
                                           forking_environment(job, fork_ranks))), highlight=False, soft_wrap=True)
        return None if self.flags.dry_run else run_local(job, self.flags, fork_ranks)


def node_torchrun(job: Job, flags: LaunchFlags, fork_ranks: bool = False) -> list[str]:
    """The torchrun command for this node (`fork_ranks`: see `torchrun_command`)."""
    return torchrun_command(job.run_dir / JOB_FILE, job.launch.gpus_per_node, job.launch.nodes,
                            flags.node_rank or 0, flags.master_addr, job.launch.master_port, fork_ranks=fork_ranks)


def torchrun_command(job_file: Path, nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                     master_addr: Optional[str] = None, master_port: Optional[int] = None,
                     python: str = sys.executable, fork_ranks: bool = False) -> list[str]:
    """torchrun for this node: standalone on one node, a static rendezvous on several. Each rank is a new
    interpreter running `-m fsdpclip.launch.entry`, or with `fork_ranks` a fork of torchrun running that module's
    file (torchrun's `--run-path --start-method=fork`): forked from a launcher that has imported torch
    and OpenCLIP, the ranks need not import them again."""
    command = [python, "-m", TORCHRUN, f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and master_addr is None:
        command.append("--standalone")
    else:
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
                    f"--master-port={master_port}"]
    if fork_ranks:
        return command + ["--run-path", "--start-method=fork", train_module_file(), str(job_file)]
    return command + ["-m", TRAIN_MODULE, str(job_file)]


def train_module_file() -> str:
    """The path of the rank entry's source file (what torchrun's --run-path runs)."""
    import importlib.util

    spec = importlib.util.find_spec(TRAIN_MODULE)
    assert spec is not None and spec.origin is not None  # a module of this package
    return spec.origin


# Variables that act when an interpreter or its shared libraries load (glibc's allocator included): ranks
# forked from the launcher could not honour them from the spec's launch.env.
LOAD_TIME_VARIABLES = ("PYTHON", "LD_", "GLIBC_TUNABLES", "MALLOC_")


def prepare_forked_ranks(job: Job) -> Optional[str]:
    """Make this launcher what its ranks are to be forked from, before it imports torch; returns why they
    cannot be forked (None: they can): the spec asks for new interpreters (launch.fork_ranks false), torch
    was imported already (what it reads at import would not hold), or the spec sets one of
    LOAD_TIME_VARIABLES. Otherwise it takes the job's launch.env, so that the ranks start as new
    interpreters with that environment would (and for a GPU job FORK_SAFE_CUDA_CHECK, so that its own checks for a
    GPU leave the driver alone), and imports OpenCLIP as they do (without the libraries it
    would import for nothing: `model.build.left_out_of_open_clip`); for a GPU job, the CUDA driver must still be
    untouched then (the spec's checks run in a fork of their own: `in_a_fork`). What torchrun gives
    each rank (its rank, OMP_NUM_THREADS, unbuffered output) the rank applies itself
    (fsdpclip.launch.entry.adopt_rank_environment). torchrun itself always runs in a fork of the launcher
    (`ForkedTorchrun`)."""
    if not job.launch.fork_ranks:
        return "launch.fork_ranks is false"
    if "torch" in sys.modules:
        return "this process had imported torch before it could take launch.env"
    loading = [key for key in job.launch.env if key.startswith(LOAD_TIME_VARIABLES)]
    if loading:
        return f"launch.env sets {', '.join(loading)}, read when a process loads"
    os.environ.update(job.launch.env)
    os.environ.update(forking_environment(job, True))  # this launcher's own checks for a GPU ask NVML too
    with collection_paused():
        from fsdpclip.model.build import import_open_clip_as_the_ranks_do

        import_open_clip_as_the_ranks_do(job.model, job.logging.wandb is not None)
    if job.launch.device == "cuda" and cuda_driver_initialised():
        return "importing torch and OpenCLIP initialised the CUDA driver"
    return None


Result = TypeVar("Result")


def in_a_fork(work: Callable[[], Result]) -> Result:
    """`work()` run in a fork of this process, its result or exception (with the fork's traceback as its cause)
    pickled back: what it does to the process stays in the fork. The launcher runs the spec's checks so where it
    forks the ranks, since a library that initialises the CUDA driver (nvImageCodec's import does) would leave
    none of its later forks able to use CUDA. The fork is killed if this process stops waiting for it."""
    sys.stdout.flush()
    sys.stderr.flush()
    reader, writer, parent = *os.pipe(), os.getpid()
    pid = os.fork()
    if pid == 0:  # the fork: answer through the pipe, then end without running the launcher's exit handlers
        try:
            os.close(reader)
            _end_with_parent(parent)
            with os.fdopen(writer, "wb") as sink:
                sink.write(_answer(work))
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(0)
    os.close(writer)
    try:
        with os.fdopen(reader, "rb") as source:
            answer = source.read()
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        status = _reaped(pid)
    try:
        done, value, trace = pickle.loads(answer)
    except Exception:  # noqa: BLE001  (nothing, or part of an answer)
        raise RuntimeError(f"the process running the spec's checks ended without an answer "
                           f"({ended_how(status)})") from None
    if done:
        return value
    raise value from RuntimeError(f"in the process that ran the spec's checks:\n{trace}")


def _end_with_parent(parent: int) -> None:
    """Have the kernel kill this process when its parent ends (Linux's PR_SET_PDEATHSIG), or end now where the
    parent `parent` already has."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _answer(work: Callable[[], object]) -> bytes:
    """`work()`'s outcome as `in_a_fork` reads it: (done, result or exception, the exception's traceback), pickled
    and checked to unpickle; an outcome that does not comes back as a RuntimeError naming it."""
    try:
        outcome: tuple[bool, object, str] = (True, work(), "")
    except BaseException as exc:  # noqa: BLE001  (raised again in the launcher)
        outcome = (False, exc, traceback.format_exc())
    try:
        answer = pickle.dumps(outcome)
        pickle.loads(answer)
        return answer
    except Exception as exc:  # noqa: BLE001  (a result or exception that does not pickle, or not back)
        return pickle.dumps((False, RuntimeError(f"{outcome[1]!r} (which could not be sent: {exc})"), outcome[2]))


def _reaped(pid: int) -> int:
    """`pid`'s wait status once it has ended (its end is near: it answered, its pipe closed, or it was killed). A
    Ctrl-C meanwhile kills it; once reaped, the interrupt goes on."""
    interrupted: Optional[KeyboardInterrupt] = None
    while True:
        try:
            status = os.waitpid(pid, 0)[1]
            break
        except KeyboardInterrupt as exc:
            os.kill(pid, signal.SIGKILL)
            interrupted = exc
    if interrupted is not None:
        raise interrupted
    return status


def ended_how(status: int) -> str:
    """A wait status in words: "exit status N" or "signal NAME"."""
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (torch's and OpenCLIP's imports make millions of objects that
    live as long as the process, which each automatic collection walks again: a fifth of their CPU time), and the
    objects made until then frozen out of later collections afterwards, as Python's `gc.freeze` advises before a
    fork (the ranks' collections then leave the pages they share with the launcher alone)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


# What the ranks' parents (this launcher, torchrun's agent) may do with CUDA: ask NVML whether there is a GPU.
# torchrun's agent asks (torch >= 2.9, for NUMA binding); through the CUDA driver, that would leave every
# process forked from it unable to use CUDA. The ranks inherit it too, where it only changes how
# torch.cuda.is_available() looks (NVML first).
FORK_SAFE_CUDA_CHECK = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def forking_environment(job: Job, fork_ranks: bool) -> dict[str, str]:
    """What torchrun's environment needs beyond the job's own: FORK_SAFE_CUDA_CHECK where it forks GPU ranks."""
    return dict(FORK_SAFE_CUDA_CHECK) if fork_ranks and job.launch.device == "cuda" else {}


def shown_command(command: list[str], environment: dict[str, str]) -> str:
    """The torchrun command as `launch` prints it, behind the `environment` it needs (`forking_environment`)."""
    return render([*(f"{key}={value}" for key, value in environment.items()), *command])


def cuda_forbids_forked_ranks(job: Job) -> Optional[str]:
    """Why ranks forked from this launcher could not use CUDA (None: they can): it has initialised CUDA (torch's
    or, for a GPU job, the driver itself, as a library it loaded may have done), or for a GPU job NVML sees no GPU
    (with one, the agent's check under FORK_SAFE_CUDA_CHECK stays away from the driver)."""
    import torch

    if torch.cuda.is_initialized():
        return "this process has initialised CUDA"
    if job.launch.device != "cuda":
        return None
    if cuda_driver_initialised():
        return "this process initialised the CUDA driver after its imports (not in the spec's checks, run apart)"
    gpus = nvml_gpu_count()
    if gpus is None:
        return "this torch cannot ask NVML for the GPUs"
    return None if gpus > 0 else "NVML sees no GPU"


CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_initialised() -> bool:
    """Whether this process has initialised the CUDA driver (cuInit), after which no process forked from it can use
    CUDA ("initialization error" at its first call); asked without initialising it: before cuInit, every driver
    call answers CUDA_ERROR_NOT_INITIALIZED. False where there is no driver."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def nvml_gpu_count() -> Optional[int]:
    """The GPUs NVML sees, CUDA_VISIBLE_DEVICES applied (negative where NVML fails), asked without the CUDA
    driver (which would leave later forks unable to use CUDA); None where this torch cannot ask."""
    import torch

    try:
        return torch.cuda._device_count_nvml()
    except Exception:  # a private torch function
        return None


def nvml_compute_capabilities() -> Optional[list[tuple[int, int]]]:
    """The compute capability of each GPU this process may use (CUDA_VISIBLE_DEVICES applied), asked from NVML
    without the CUDA driver (see `nvml_gpu_count`); None where NVML cannot tell."""
    from ctypes import CDLL, byref, c_int, c_void_p

    import torch

    count = nvml_gpu_count()
    if not count or count < 0:
        return None
    try:
        indices = [torch.cuda._get_nvml_device_index(i) for i in range(count)]  # a private torch function
        nvml = CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        capabilities = []
        for index in indices:
            handle, major, minor = c_void_p(), c_int(), c_int()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, byref(handle)) != 0 or \
                    nvml.nvmlDeviceGetCudaComputeCapability(handle, byref(major), byref(minor)) != 0:
                return None
            capabilities.append((major.value, minor.value))
        return capabilities
    except Exception:  # noqa: BLE001  (no NVML library, or a torch without these functions)
        return None


def job_environment(job: Job) -> dict[str, str]:
    """The environment every rank starts with: ours, the spec's, and when the launch began."""
    env = dict(os.environ)
    env.update(job.launch.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[LAUNCH_TIME_ENV] = repr(time.time())
    return env


def torchrun_environment(job: Job, token: str, fork_ranks: bool) -> dict[str, str]:
    """What torchrun and the ranks of this node start with: the job's environment, the launch's lock token, this
    process as the launcher they outlive only to stop (LAUNCHER_ENV), and what forked ranks need."""
    return {**job_environment(job), LOCK_TOKEN_ENV: token, LAUNCHER_ENV: "{}:{}".format(*process_identity()),
            **forking_environment(job, fork_ranks)}


def run_local(job: Job, flags: LaunchFlags, fork_ranks: bool = False) -> dict:
    """Take the run directory (node 0), write RUN_DIR/job.json, run torchrun for this node under
    supervision and wait; returns the exit report, written to exit.json however the job ended
    (torchrun reports any failure of its ranks as 1: the code is the trainer's own where it left one).
    `fork_ranks`: see `torchrun_command` and `prepare_forked_ranks`. The ranks learn this launcher
    (LAUNCHER_ENV) and stop as on a stop request once it is gone; the lock stays held while torchrun or
    rank 0 runs, whatever became of the launcher.
    """
    token, started = uuid.uuid4().hex, time.time()
    env = torchrun_environment(job, token, fork_ranks)
    lock = HeldLock(job.run_dir, token) if (flags.node_rank or 0) == 0 else None
    try:
        job.run_dir.mkdir(parents=True, exist_ok=True)
        with lock or contextlib.nullcontext():
            job.save(job.run_dir / JOB_FILE)
            keep_output(job.run_dir / LOG_DIR / LAUNCHER_LOG)
            status = supervise(node_torchrun(job, flags, fork_ranks), env, job.run_dir, lock)
    except RunLocked as exc:
        raise LaunchError(str(exc)) from None
    except OSError as exc:
        raise LaunchError(f"cannot use the run directory {job.run_dir}: {exc.strerror or exc}") from None
    return finish_exit_report(job.run_dir, started, status, checkpoint=last_checkpoint(job.run_dir))


def last_checkpoint(run_dir: Path) -> str:
    """The run's last complete checkpoint ('' for none), for an exit report the trainer could not write."""
    from fsdpclip.checkpoint.layout import latest_checkpoint

    return str(latest_checkpoint(run_dir) or "")


def supervise(command: list[str], env: dict[str, str], run_dir: Path, lock: Optional[HeldLock] = None,
              started: Optional[Callable[[int], None]] = None) -> int:
    """Run `command` (torchrun) in its own session with inherited output (`ForkedTorchrun`), and return its
    exit status; torchrun joins `lock`, and `started` is called with its pid once the signal handlers are in
    place.

    A first SIGTERM, SIGHUP (the terminal or ssh connection gone) or Ctrl-C to this process (or to its
    process group: the terminal's Ctrl-C, a scheduler's `kill -TERM -PGID`) becomes a stop request in
    RUN_DIR/stop: the ranks checkpoint and exit 75 (no signal reaches torchrun, which would give them
    only 30 s on torch < 2.12). A second SIGTERM or Ctrl-C stops everything at once: SIGKILL to torchrun
    and every process under it (status 130).
    """
    process = ForkedTorchrun(command, env)
    if lock is not None:
        lock.add(process.pid)
    received: list[int] = []

    def handle(signum, frame) -> None:
        if signum == signal.SIGHUP and received:
            return  # a hang-up reaches us from the terminal and from the shell alike: it never stops at once
        received.append(signum)
        if len(received) == 1:
            request_stop(run_dir)
            print(f"fsdpclip: {signal.Signals(signum).name}: the ranks checkpoint and stop at their "
                  "next stop check (again to stop at once)", file=sys.stderr, flush=True)
        else:
            kill_tree(process.pid)

    previous = {signum: signal.signal(signum, handle) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    if started is not None:
        started(process.pid)
    try:
        status = process.wait()
        return EXIT_STOPPED_AT_ONCE if len(received) > 1 else status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class ForkedTorchrun:
    """torchrun's command (`python -m fsdpclip.launch.torchrun ARGS`, this interpreter) run in a forked child of this
    process, not a new interpreter: the launcher has imported torch already, which a new one would import
    again before torchrun's agent could start (1.7 s on a 2-core machine, 3.5-5 s on the GPU hosts). The
    child has a session of its own, `env` as its environment and a fresh interpreter's signal handlers, and
    never returns into the launcher's code. `pid` and `wait()` as a Popen's."""

    def __init__(self, command: list[str], env: dict[str, str]):
        if command[:3] != [sys.executable, "-m", TORCHRUN]:
            raise ValueError(f"not this interpreter's torchrun command: {render(command)}")
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os._exit(self._run(command[3:], env))

    @staticmethod
    def _run(args: list[str], env: dict[str, str]) -> int:
        code = 1
        try:
            os.setsid()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.environ.clear()
            os.environ.update(env)
            tempfile.tempdir = None  # as a new interpreter: the temporary directory from `env` (TMPDIR)
            sys.argv = [TORCHRUN, *args]
            from fsdpclip.launch.torchrun import main

            code = main()
        except SystemExit as exc:  # as the interpreter ends on it: an int is the code, anything else printed
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
        return code

    def wait(self) -> int:
        """The child's exit status: its code, or minus the signal that ended it."""
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


def kill_tree(pid: int, timeout: float = 10.0) -> list[int]:
    """SIGKILL a process and every process under it (Linux: their parents read from /proc) and wait, up to
    `timeout` seconds, until each has ended, all its threads; returns those that had not, named in one line on
    stderr (a process in an uninterruptible call, a GPU driver's say, ends only when that returns). The tree is
    stopped first (SIGSTOP, until a scan finds no member it has not stopped), so that a process forked between a
    scan and the kill (a rank's next data workers, say) cannot outlive its killed parent as an orphan. Each member
    is held by a pidfd where the kernel has them (Linux 5.3): signals reach that process and no later one of the
    same number, and its end is seen once its last thread has gone; elsewhere by its number, its end read from
    /proc."""
    members: dict[int, Optional[int]] = {}  # a member's number: its pidfd, None where there is none
    try:
        while True:
            found = [member for member in _tree(pid) if member not in members]
            if not found:
                break
            for member in found:
                members[member] = _pidfd(member)
                _signal(member, members[member], signal.SIGSTOP)
        for member, handle in members.items():
            _signal(member, handle, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        running = [member for member, handle in members.items() if _running(member, handle)]
        while running and time.monotonic() < deadline:
            time.sleep(0.01)  # SIGKILL acts asynchronously: a loaded machine takes a moment to end each member
            running = [member for member in running if _running(member, members[member])]
        if running:
            print(f"fsdpclip: still running {timeout:g} s after SIGKILL: pid {', '.join(map(str, running))}",
                  file=sys.stderr, flush=True)
        return running
    finally:
        for handle in members.values():
            if handle is not None:
                os.close(handle)


def _pidfd(pid: int) -> Optional[int]:
    """A pidfd of process `pid`; None where it has ended or the kernel has none."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _signal(pid: int, handle: Optional[int], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if handle is None:
            os.kill(pid, signum)
        else:
            signal.pidfd_send_signal(handle, signum)


def _running(pid: int, handle: Optional[int]) -> bool:
    """Whether process `pid` has not ended: its pidfd not readable yet, else its state in /proc (a zombie's leader
    counts as ended there)."""
    if handle is not None:
        poll = select.poll()  # not select(): a launcher may hold descriptors past its limit of 1024
        poll.register(handle, select.POLLIN)
        return not poll.poll(0)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


def _tree(pid: int) -> list[int]:
    """`pid` and every living process under it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] not in "ZX":  # a zombie has no children to hide and cannot be signalled
                children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [pid], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            tree.append(child)
            todo.append(child)
    return tree


LAUNCHER_BACKENDS.register(LocalBackend)
