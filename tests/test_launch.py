"""Launch rendering (torchrun, sbatch) against golden files, the launch flags, and a two-node launch without Slurm.

Set FSDPCLIP_UPDATE_GOLDEN=1 to rewrite the golden files after an intended change, then review the diff.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, squeezed, synthetic_job, write_job
from ranks import run_group
from fsdpclip.checkpoint.layout import latest_checkpoint
from fsdpclip.launch.launcher import render, resolve_paths
from fsdpclip.launch.local import torchrun_command
from fsdpclip.launch.slurm import sbatch_script
from fsdpclip.jobspec.jobfile import load_job

GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("FSDPCLIP_UPDATE_GOLDEN") == "1"
CLUSTER_EXAMPLE = REPO / "cluster" / "vit-b-32-laion400m.sbatch"

# name -> (spec, --set overrides, interpreter); paths resolve against /project.
CASES = {
    "tiny-cpu-two-nodes": ("examples/tiny-cpu.json", [
        "launch.nodes=2", "launch.gpus_per_node=1", "batch.per_gpu=32", "launch.master_port=29511",
        'launch.env={"GLOO_SOCKET_IFNAME": "eth0"}',
        'launch.slurm={"account": "proj-1", "qos": "low", "time": "00:30:00", "signal_seconds": 60,'
        ' "extra_sbatch": ["--exclusive", "--mem=0"], "env": {"NCCL_SOCKET_IFNAME": "^lo,docker0"}}',
    ], "/opt/venv/bin/python"),
    "no-requeue-quoted-paths": ("examples/tiny-cpu.json", [
        'run.output_dir="/scratch/$USER/my runs"',
        'launch.slurm={"requeue": false, "cpus_per_task": 4,'
        ' "setup": ["module load cuda/12.4", "source ~/env/bin/activate"]}',
    ], None),
}


def _render(spec: str, overrides: list[str], python) -> str:
    job = resolve_paths(load_job(REPO / spec, overrides), Path("/project"))
    return sbatch_script(job, python)


def _check_golden(path: Path, text: str) -> None:
    if UPDATE:
        path.write_text(text)
    assert path.read_text() == text, f"{path.name} differs from the rendering: rerun with FSDPCLIP_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("name", CASES)
def test_sbatch_matches_golden(name):
    _check_golden(GOLDEN / f"{name}.sbatch", _render(*CASES[name]))


def test_cluster_example_is_the_rendered_example():
    script = _render("examples/vit-b-32-laion400m.json", [], None)
    _check_golden(CLUSTER_EXAMPLE, script)
    assert "source /opt/fsdpclip/.venv/bin/activate" in script and "\n    python -m fsdpclip.launch.torchrun" in script


SCRIPTS = [*sorted(GOLDEN.glob("*.sbatch")), CLUSTER_EXAMPLE, REPO / "cluster" / "local-slurm.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_pass_bash_syntax_check(script):
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_each_mixed_sources_urls_are_made_absolute():
    """`launch` makes every local path of a mixture absolute, relative to the spec's directory; others stay."""
    job = resolve_paths(load_job(REPO / "examples/tiny-cpu.json", [
        'data={"sources": [{"urls": "a/{0..3}.tar"}, {"urls": ["/abs/b.tar", "pipe:cat b.tar"]}], "samples": 100}']),
        Path("/project"))
    assert job.data.urls is None
    assert [source.urls for source in job.data.sources] == ["/project/a/{0..3}.tar", ["/abs/b.tar", "pipe:cat b.tar"]]


def test_eval_sets_are_made_absolute():
    """Zero-shot, retrieval and validation sets alike (a retrieval set's path stayed relative in the run's job.json,
    which the ranks read from wherever they start)."""
    job = resolve_paths(load_job(REPO / "examples/tiny-cpu.json", [
        'eval={"zeroshot": [{"dataset": "folder", "path": "zs", "classnames": "zs.txt"}], '
        '"retrieval": [{"path": "pairs"}, {"path": "s3://bucket/pairs"}], '
        '"validation": [{"urls": "val/{0..3}.tar"}, {"urls": ["v.tar", "pipe:cat v.tar"], "name": "v"}]}']),
        Path("/project"))
    assert (job.eval.zeroshot[0].path, job.eval.zeroshot[0].classnames) == ("/project/zs", "/project/zs.txt")
    assert [retrieval.path for retrieval in job.eval.retrieval] == ["/project/pairs", "s3://bucket/pairs"]
    assert [validation.urls for validation in job.eval.validation] == ["/project/val/{0..3}.tar",
                                                                       ["/project/v.tar", "pipe:cat v.tar"]]


def test_sbatch_content():
    script = _render(*CASES["tiny-cpu-two-nodes"])
    lines = script.splitlines()
    options = [line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH ")]
    assert options[:3] == ["--job-name=tiny-cpu", "--nodes=2", "--ntasks-per-node=1"]
    assert "--requeue" in options and "--signal=B:USR1@60" in options
    assert not any(o.startswith("--gres") for o in options)  # CPU job
    assert "--output=/project/runs/tiny-cpu/logs/slurm-%j.out" in options
    assert "export NCCL_SOCKET_IFNAME='^lo,docker0'" in lines and "export GLOO_SOCKET_IFNAME=eth0" in lines
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=60" in lines
    assert '--rdzv-backend=c10d --rdzv-endpoint="$head_addr:29511" --rdzv-id="$SLURM_JOB_ID"' in script
    assert "-m fsdpclip.launch.entry /project/runs/tiny-cpu/job.json &" in script

    quiet = _render(*CASES["no-requeue-quoted-paths"])
    assert "--requeue" not in quiet and "trap '" not in quiet and "scontrol requeue" not in quiet
    assert "#SBATCH '--output=/scratch/$USER/my runs/tiny-cpu/logs/slurm-%j.out'" in quiet
    assert "run_dir='/scratch/$USER/my runs/tiny-cpu'" in quiet
    assert "\n    python -m fsdpclip.launch.torchrun" in quiet  # setup lines choose the interpreter


def test_the_batch_script_refuses_what_would_break_its_lines():
    """The rendering itself (not only the spec) refuses control characters in every value it writes: a job
    built in code, never validated, cannot add lines to the script either."""
    from fsdpclip.jobspec.backend import LaunchError

    job = resolve_paths(load_job(REPO / CASES["tiny-cpu-two-nodes"][0], CASES["tiny-cpu-two-nodes"][1]),
                        Path("/project"))
    slurm = job.launch.slurm
    edits = [("partition", "gpu\necho injected"), ("extra_sbatch", ["--exclusive\necho injected"]),
             ("setup", ["module load x\necho injected"]), ("env", {"A": "1\r"})]
    for field, value in edits:
        edited = job.model_copy(update={"launch": job.launch.model_copy(
            update={"slurm": slurm.model_copy(update={field: value})})})
        with pytest.raises(LaunchError, match="control character"):
            sbatch_script(edited)
    elsewhere = job.model_copy(update={"run": job.run.model_copy(update={"output_dir": "/runs\necho injected"})})
    with pytest.raises(LaunchError, match="control character"):
        sbatch_script(elsewhere)


def test_torchrun_commands():
    job = Path("/runs/x/job.json")
    assert render(torchrun_command(job, 2, python="py")) == (
        "py -m fsdpclip.launch.torchrun --nproc-per-node=2 --standalone -m fsdpclip.launch.entry /runs/x/job.json")
    assert render(torchrun_command(job, 8, 4, 3, "10.0.0.1", 29400, python="py")) == (
        "py -m fsdpclip.launch.torchrun --nproc-per-node=8 --nnodes=4 --node-rank=3 --master-addr=10.0.0.1 "
        "--master-port=29400 -m fsdpclip.launch.entry /runs/x/job.json")


# A rank of the forked-torchrun tests: writes what it sees, then exits 75 (a deliberate ending) or waits to be killed.
_PROBE_RANK = """
import json, os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
seen = {"probe": os.environ.get("SPEC_PROBE"), "parent": os.getppid(), "session": os.getsid(0), "pid": os.getpid()}
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))
deadline = time.time() + 60  # both write before either exits: torchrun stops the other rank once one has ended
while not all((out / f"rank{r}.json").exists() for r in range(int(os.environ["WORLD_SIZE"]))) and time.time() < deadline:
    time.sleep(0.05)
if sys.argv[2] == "wait":
    time.sleep(120)
sys.exit(75)
"""


def _wait(torchrun, limit: float = 60) -> int:
    """torchrun's exit status; past `limit` seconds it and everything under it are killed (the test fails)."""
    import threading

    from fsdpclip.launch.local import kill_tree

    watchdog = threading.Timer(limit, kill_tree, [torchrun.pid])
    watchdog.start()
    try:
        return torchrun.wait()
    finally:
        watchdog.cancel()


def _probe_ranks(tmp_path, mode: str, forked_ranks: bool):
    """Two probe ranks under `launch.ForkedTorchrun` with the launcher's own torchrun command and one more variable;
    the ranks are new interpreters or forks of torchrun (--run-path --start-method=fork)."""
    from fsdpclip.launch.launcher import TORCHRUN
    from fsdpclip.launch.local import ForkedTorchrun

    script = tmp_path / "probe.py"
    script.write_text(_PROBE_RANK)
    how = ["--run-path", "--start-method=fork"] if forked_ranks else []
    command = [sys.executable, "-m", TORCHRUN, "--standalone", "--nproc-per-node=2", *how, str(script), str(tmp_path),
               mode]
    return ForkedTorchrun(command, {**os.environ, "SPEC_PROBE": "from the spec"})


@pytest.mark.slow
@pytest.mark.parametrize("forked_ranks", [False, True], ids=["new-interpreter-ranks", "forked-ranks"])
def test_torchrun_runs_forked_with_the_jobs_environment(tmp_path, capfd, forked_ranks):
    """The launcher forks torchrun (no second import of torch); the ranks get the job's environment, the
    launcher's own is untouched, and a deliberate exit code comes back as it is, without a traceback or torchrun's
    `failed (exitcode: 75)` error line."""
    torchrun = _probe_ranks(tmp_path, "exit", forked_ranks)
    assert _wait(torchrun) == 75
    assert "SPEC_PROBE" not in os.environ
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["probe"] == "from the spec"
        assert seen["parent"] == torchrun.pid
    output = capfd.readouterr()
    assert "exitcode: 75" not in output.err and "Traceback" not in output.out + output.err


@pytest.mark.slow
@pytest.mark.parametrize("forked_ranks", [False, True], ids=["new-interpreter-ranks", "forked-ranks"])
def test_a_killed_forked_torchrun_reports_its_signal_and_leaves_no_rank(tmp_path, forked_ranks):
    """The forked torchrun has a session of its own; the launcher's second Ctrl-C is SIGKILL to it and
    everything under it."""
    import time

    from fsdpclip.launch.local import kill_tree

    torchrun = _probe_ranks(tmp_path, "wait", forked_ranks)
    ranks = [tmp_path / f"rank{rank}.json" for rank in (0, 1)]
    deadline = time.time() + 60
    while not all(path.exists() for path in ranks) and time.time() < deadline:
        time.sleep(0.2)
    pids = [json.loads(path.read_text())["pid"] for path in ranks if path.exists()]
    session = os.getsid(torchrun.pid)
    kill_tree(torchrun.pid)
    assert _wait(torchrun) == -9
    assert len(pids) == 2 and session == torchrun.pid != os.getsid(0)
    time.sleep(0.5)
    for pid in pids:  # killed, and reaped by init once their parent was gone
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


# A process that keeps forking children (as a rank starts its next data workers), each alive for 0.5 s; all
# of them named by argv[1].
_FORKING = """
import os, time
while True:
    if os.fork() == 0:
        time.sleep(0.5)
        os._exit(0)
    time.sleep(0.003)
"""


@pytest.mark.parametrize("pidfds", [True, False])
def test_kill_tree_leaves_no_process_forked_while_it_kills(tmp_path, monkeypatch, pidfds):
    """A tree whose members fork all the time (as a rank starting its next data workers): nothing forked
    between kill_tree's scan of the tree and its kill outlives it as an orphan, and each has ended when it
    returns; with pidfds and, as on kernels before Linux 5.3, without."""
    import time

    from fsdpclip.launch import local
    from fsdpclip.launch.local import kill_tree

    if not pidfds:
        monkeypatch.setattr(local, "_pidfd", lambda pid: None)

    marker = f"fork-marker-{tmp_path.name}"
    root = subprocess.Popen([sys.executable, "-c", _FORKING, marker], start_new_session=True)

    def named() -> list[int]:
        found = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] != "Z" and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
        return found

    try:
        time.sleep(1.0)
        assert len(named()) >= 10  # the root and its children
        assert kill_tree(root.pid) == []
        assert named() == []  # an orphan forked during the kill would live on for up to 0.5 s
        assert root.wait(10) == -9
    finally:  # whatever kill_tree did: the tree's process group (its members keep it) stops at once
        with contextlib.suppress(ProcessLookupError):
            os.killpg(root.pid, 9)
        root.wait(10)


def test_kill_tree_names_the_processes_it_could_not_end(monkeypatch, capsys):
    """A member that has not ended when the wait is over (as one in an uninterruptible driver call) is returned and
    named in one line."""
    from fsdpclip.launch import local

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    monkeypatch.setattr(local, "_running", lambda pid, handle: True)
    try:
        assert local.kill_tree(sleeper.pid, timeout=0.2) == [sleeper.pid]
        assert f"still running 0.2 s after SIGKILL: pid {sleeper.pid}" in capsys.readouterr().err
        assert sleeper.wait(10) == -9
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sleeper.pid, 9)
        sleeper.wait(10)


@pytest.mark.slow
def test_the_launcher_imports_openclip_without_collecting_and_freezes_what_it_imported(tmp_path):
    """No cyclic collection runs while the launcher that forks the ranks imports torch and OpenCLIP; what it
    imported is frozen out of later collections, and the collector is on again afterwards."""
    code = ("import gc, sys\nfrom fsdpclip.launch.local import prepare_forked_ranks\n"
            "from fsdpclip.jobspec.jobfile import load_job\ncollections = []\n"
            "gc.callbacks.append(lambda phase, info: collections.append(info['generation']) if phase == 'start' else 0)\n"
            "job = load_job(sys.argv[1])\nfrozen = gc.get_freeze_count()\n"
            "assert prepare_forked_ranks(job) is None\n"
            "print(collections, 'open_clip' in sys.modules, gc.isenabled(), gc.get_freeze_count() - frozen > 100_000)")
    proc = subprocess.run([sys.executable, "-c", code, str(_tiny(tmp_path))], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "True", "True", "True"]


@pytest.mark.slow
def test_ranks_are_forked_unless_the_spec_sets_load_time_variables(tmp_path):
    """`launch` forks the ranks from itself (they need not import torch and OpenCLIP again), takes the spec's
    launch.env before it imports torch and imports OpenCLIP as the ranks do (without transformers here); a
    variable that acts when an interpreter loads (PYTHONPATH, LD_*) keeps new interpreters, as do
    launch.fork_ranks false and a launcher that had imported torch already."""
    for sub in ("pythonpath", "asked"):
        (tmp_path / sub).mkdir()
    plain = _tiny(tmp_path, env={"SPEC_PROBE": "from the spec"})
    pythonpath = _tiny(tmp_path / "pythonpath", env={"PYTHONPATH": str(tmp_path)})

    def dry_run(path: Path) -> str:
        """The printed command, whether the launcher imported transformers and took launch.env (`fsdpclip launch`
        in-process), and then, with the variable gone and torch imported, what the ranks of a second launch get."""
        code = ("import os, sys\nfrom fsdpclip.cli.commands import app\n"
                "from fsdpclip.launch.local import prepare_forked_ranks\n"
                "from fsdpclip.jobspec.jobfile import load_job\n"
                f"sys.argv = ['fsdpclip', 'launch', {str(path)!r}, '--dry-run']\n"
                "try:\n    app()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
                "print('transformers imported:', 'transformers' in sys.modules)\n"
                "print('checked here:', 'fsdpclip.checkpoint.remote' in sys.modules)\n"
                "print('launch.env taken:', os.environ.pop('SPEC_PROBE', None))\n"
                f"print('again:', prepare_forked_ranks(load_job({str(path)!r})), os.environ.get('SPEC_PROBE'))\n")
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return squeezed(proc.stdout)

    # The tiny model has no Hugging Face tower: a launcher the ranks fork from imports OpenCLIP as they do
    forked = dry_run(plain)
    assert squeezed(f"run directory {tmp_path / 'runs' / 't'} {sys.executable} -m fsdpclip.launch.torchrun") in forked
    assert squeezed(f"--run-path --start-method=fork {REPO / 'fsdpclip' / 'launch' / 'entry.py'} ") in forked
    assert squeezed("transformers imported: False") in forked
    assert squeezed("checked here: False") in forked  # the spec's checks ran in a fork of the launcher
    assert squeezed("launch.env taken: from the spec") in forked
    assert squeezed("again: this process had imported torch before it could take launch.env None") in forked
    for path, why in ((pythonpath, "launch.env sets PYTHONPATH, read when a process loads"),
                      (_tiny(tmp_path / "asked", fork_ranks=False), "launch.fork_ranks is false")):
        new_interpreters = dry_run(path)
        assert squeezed(f"the ranks start as new interpreters: {why}") in new_interpreters
        assert squeezed("-m fsdpclip.launch.entry ") in new_interpreters
        assert squeezed("transformers imported: True") in new_interpreters
        assert squeezed("checked here: True") in new_interpreters
    assert squeezed("new interpreters") not in forked


def test_ranks_on_gpus_are_forked_only_where_nvml_sees_a_gpu(tmp_path, monkeypatch):
    """torchrun's agent asks whether there is a GPU; only NVML's answer leaves its forks able to use CUDA."""
    import torch

    from fsdpclip.launch.local import cuda_forbids_forked_ranks, forking_environment, shown_command
    from fsdpclip.jobspec.jobfile import load_job

    (tmp_path / "gpu").mkdir()
    gpu, cpu = load_job(_tiny(tmp_path / "gpu", device="cuda")), load_job(_tiny(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    assert cuda_forbids_forked_ranks(gpu) is None and cuda_forbids_forked_ranks(cpu) is None
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)  # NVML not there
    assert cuda_forbids_forked_ranks(gpu) == "NVML sees no GPU" and cuda_forbids_forked_ranks(cpu) is None
    monkeypatch.delattr(torch.cuda, "_device_count_nvml")  # a torch without the private function
    assert cuda_forbids_forked_ranks(gpu) == "this torch cannot ask NVML for the GPUs"
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2, raising=False)
    assert cuda_forbids_forked_ranks(gpu) is None  # no CUDA driver on this machine: nothing initialised it
    driver = FakeDriver(initialised=True)  # a library the launcher loaded called cuInit: torch cannot tell
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver if name == "libcuda.so.1" else None)
    assert cuda_forbids_forked_ranks(gpu) == ("this process initialised the CUDA driver after its imports (not in "
                                              "the spec's checks, run apart)")
    assert cuda_forbids_forked_ranks(cpu) is None  # CPU ranks do not use it
    driver.initialised = False
    assert cuda_forbids_forked_ranks(gpu) is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the launcher itself used CUDA
    assert cuda_forbids_forked_ranks(cpu) == "this process has initialised CUDA"
    # forked GPU ranks' torchrun runs (and is printed) behind the NVML check; CPU ranks' needs nothing
    command = torchrun_command(Path("/r/job.json"), 2, python="py", fork_ranks=True)
    assert shown_command(command, forking_environment(gpu, True)).startswith(
        "PYTORCH_NVML_BASED_CUDA_CHECK=1 py -m fsdpclip.launch.torchrun --nproc-per-node=2 --standalone --run-path ")
    assert forking_environment(cpu, True) == forking_environment(gpu, False) == {}


class Unrebuildable(Exception):
    """An exception pickle saves but cannot make again (its __init__ takes an argument it does not pass on)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__()
        self.message, self.code = message, code

    def __reduce__(self):
        return Unrebuildable, ()


class FakeDriver:
    """libcuda as ctypes loads it: cuDeviceGetCount answers CUDA_ERROR_NOT_INITIALIZED (3) before cuInit."""

    def __init__(self, initialised: bool):
        self.initialised = initialised

    def cuDeviceGetCount(self, count) -> int:
        return 0 if self.initialised else 3


def test_a_gpu_launcher_checks_for_gpus_through_nvml(tmp_path, monkeypatch):
    """Ranks forked from a GPU job's launcher: its own checks ask NVML whether there is a GPU (torch.cuda.is_available
    through the driver would leave the forks unable to use CUDA)."""
    from fsdpclip.launch.local import prepare_forked_ranks
    from fsdpclip.jobspec.jobfile import load_job

    (tmp_path / "gpu").mkdir()
    gpu, cpu = load_job(_tiny(tmp_path / "gpu", device="cuda")), load_job(_tiny(tmp_path))
    monkeypatch.setattr("fsdpclip.model.build.import_open_clip_as_the_ranks_do", lambda *args: None)
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.delitem(sys.modules, "torch")  # as in a launcher that has not imported torch yet
    assert prepare_forked_ranks(cpu) is None and "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    assert prepare_forked_ranks(gpu) is None and os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    driver = FakeDriver(initialised=True)  # an import called cuInit: the ranks start as new interpreters
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver if name == "libcuda.so.1" else None)
    assert prepare_forked_ranks(gpu) == "importing torch and OpenCLIP initialised the CUDA driver"
    assert prepare_forked_ranks(cpu) is None


def test_work_in_a_fork_answers_and_leaves_this_process_as_it_was():
    """`in_a_fork`: the work's result or exception comes back; what it does to the process (a module it imports,
    a variable it sets, as a library that initialises the CUDA driver would) stays in the fork; a fork that dies
    or whose answer does not pickle is said so."""
    import signal
    import threading

    from fsdpclip.launch.local import in_a_fork

    def work() -> None:
        os.environ["FSDPCLIP_FORK_PROBE"] = "set"
        import fsdpclip.launch.fork_probe_absent  # noqa: F401  (not a module: raises)

    assert in_a_fork(lambda: (os.getpid(), sorted({3, 1}))) [1] == [1, 3]
    assert in_a_fork(lambda: os.getpid()) != os.getpid()
    with pytest.raises(ModuleNotFoundError, match="fork_probe_absent") as raised:
        in_a_fork(work)
    assert "FSDPCLIP_FORK_PROBE" not in os.environ
    assert "in work\n" in str(raised.value.__cause__)  # the fork's traceback
    with pytest.raises(RuntimeError, match="could not be sent"):  # pickles, but does not unpickle
        in_a_fork(lambda: Unrebuildable("an argument its class does not pass on"))
    with pytest.raises(RuntimeError, match="ended without an answer \\(signal SIGKILL\\)"):
        in_a_fork(lambda: os.kill(os.getpid(), signal.SIGKILL))
    with pytest.raises(RuntimeError, match="could not be sent"):
        in_a_fork(lambda: threading.Lock())

_FORKED_RANK = """
import os, signal, sys, torch
from fsdpclip.launch.entry import adopt_rank_environment
signal.signal(signal.SIGHUP, lambda *args: None)  # as torchrun's agent catches it
torch.set_num_threads(2)
os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun gives each rank
sys.stdout.reconfigure(line_buffering=False, write_through=False)  # the launcher's output to a pipe
pid = os.fork()
if pid == 0:
    before = (torch.get_num_threads(), signal.getsignal(signal.SIGHUP) is signal.SIG_DFL)
    if sys.argv[1] == "adopt":
        adopt_rank_environment()
    print(before, (torch.get_num_threads(), signal.getsignal(signal.SIGHUP) is signal.SIG_DFL))
    os.kill(os.getpid(), signal.SIGKILL)  # a rank killed: what it printed must be out already
os.waitpid(pid, 0)
"""


@pytest.mark.slow
def test_a_forked_rank_takes_what_torchrun_gives_a_new_interpreter():
    """torch read OMP_NUM_THREADS when the launcher imported it, and the agent's signal handlers and the
    launcher's buffered output come with the fork: the rank resets all three (without it, a rank killed
    after printing a line has printed nothing)."""
    def fork(mode: str) -> str:
        proc = subprocess.run([sys.executable, "-c", _FORKED_RANK, mode], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert fork("adopt") == "(2, False) (1, True)"
    assert fork("as-forked") == ""


def _tiny(tmp_path, **launch) -> Path:
    job = synthetic_job(tmp_path, **{"gpus_per_node": 2, **launch})
    job["batch"]["global_batch"], job["logging"] = 32, {"every_steps": 1}
    return write_job(tmp_path, job)


def test_slurm_dry_run_prints_the_script_and_writes_nothing(cli, tmp_path):
    path = _tiny(tmp_path)
    result = cli("launch", path, "--slurm", "--dry-run", "--nodes", "2", "--gpus-per-node", "1",
                 "--partition", "cpu", "--time", "1:00:00")
    assert result.exit_code == 0, result.output
    job = load_job(path, ["launch.nodes=2", "launch.gpus_per_node=1", 'launch.slurm.partition="cpu"',
                          'launch.slurm.time="1:00:00"'])
    assert result.stdout == sbatch_script(job)
    assert "#SBATCH --partition=cpu" in result.stdout and "#SBATCH --time=1:00:00" in result.stdout
    assert not (tmp_path / "runs").exists()


def test_a_cluster_spec_previews_off_the_cluster_with_no_check_paths(cli):
    """The LAION example's shards and ImageNet exist only on its cluster: refused here, unless paths go unchecked."""
    path = REPO / "examples" / "vit-b-32-laion400m.json"
    refused = cli("launch", path, "--slurm", "--dry-run")
    assert refused.exit_code == 2 and "data.urls" in refused.output and "directory not found" in refused.output
    result = cli("launch", path, "--slurm", "--dry-run", "--no-check-paths")
    assert result.exit_code == 0, result.output
    assert result.stdout == sbatch_script(resolve_paths(load_job(path), Path.cwd()))


def test_flags_are_validated_with_the_real_world_size(cli, tmp_path):
    path = _tiny(tmp_path)  # global_batch 32 = 16 per rank × 2 ranks
    for flags in (["--slurm", "--nodes", "2"], ["--nodes", "2", "--node-rank", "0", "--master-addr", "h"]):
        result = cli("launch", path, "--dry-run", *flags)
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        assert "batch.global_batch" in result.output and "world size 4" in result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flags, message", [
    (["--node-rank", "1"], "--node-rank needs --master-addr"),
    (["--nodes", "2", "--gpus-per-node", "1"], "2 nodes without Slurm"),
    (["--nodes", "2", "--gpus-per-node", "1", "--node-rank", "2", "--master-addr", "h"], "--node-rank 2 is not below"),
    (["--slurm", "--master-addr", "h"], "--slurm starts every node itself"),
    (["--partition", "gpu"], "add --slurm"),
    (["--slurm", "--time", "soon"], "launch.slurm.time"),
    (["--slurm", "--partition", "gpu\n#SBATCH --wrap=id"], "--partition 'gpu\\n#SBATCH --wrap=id': contains the "
                                                            "control character"),
    (["--slurm", "--nodes", str(2 ** 64)], "less than or equal to 1048576"),
])
def test_bad_launch_flags_are_user_errors(cli, tmp_path, flags, message):
    result = cli("launch", _tiny(tmp_path), "--dry-run", *flags)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert message in result.output


@pytest.mark.parametrize("flags, block", [([], "launch.env"), (["--slurm"], "launch.slurm.env")])
def test_the_launchers_own_variables_are_refused_in_a_spec(cli, tmp_path, flags, block):
    """A spec's FSDPCLIP_LOCK_TOKEN let two jobs hold one run directory's lock; its FSDPCLIP_LAUNCHER, exported
    by the batch script, stopped every Slurm launch after a step as if its launcher were gone."""
    for name in ("FSDPCLIP_LOCK_TOKEN", "FSDPCLIP_LAUNCHER"):
        result = cli("launch", _tiny(tmp_path), "--dry-run", *flags, "--set", f'{block}={{"{name}": "1"}}')
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        assert block in result.output
        assert squeezed(f"'{name}': FSDPCLIP_* variables are set by") in squeezed(result.output)
    assert not (tmp_path / "runs").exists()


def test_slurm_without_sbatch_is_a_user_error(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = cli("launch", _tiny(tmp_path), "--slurm")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "needs Slurm's sbatch on the PATH" in result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_two_nodes_without_slurm(tmp_path):
    """What a user types on each of two machines (here both on this one): a static rendezvous on node 0.
    With memory to spare, 'auto' shards inside each node (one rank) and replicates across the two; rank
    0 decides and every rank builds that mesh."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = _tiny(tmp_path, nodes=2, gpus_per_node=1, gpu_memory_gib=80)
    launches = [[sys.executable, "-m", "fsdpclip", "launch", str(path), "--node-rank", str(rank),
                 "--master-addr", "127.0.0.1", "--master-port", str(port)] for rank in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        node0, node1 = pool.map(lambda command: run_group(command, timeout=180), launches)
    assert node0.returncode == 0, node0.stdout[-4000:]
    assert node1.returncode == 0, node1.stdout[-4000:]
    assert "--nnodes=2 --node-rank=1 --master-addr=127.0.0.1" in node1.stdout
    assert squeezed("mesh: 2 replica(s) × shard groups of 1") in squeezed(node0.stdout)
    run_dir = tmp_path / "runs" / "t"
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 0
    assert json.loads((latest_checkpoint(run_dir) / "meta.json").read_text())["world_size"] == 2


def test_a_ctrl_c_while_the_launcher_reaps_its_fork_kills_the_fork_and_stops_the_launcher(monkeypatch):
    """The launcher waits for its checks' fork to end; a Ctrl-C then kills the fork and, once it is reaped,
    stops the launcher rather than letting it launch."""
    import signal

    from fsdpclip.launch import local

    fork = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    real_waitpid, calls = os.waitpid, []

    def interrupted_once(pid, options):
        calls.append(pid)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_waitpid(pid, options)

    monkeypatch.setattr(os, "waitpid", interrupted_once)
    try:
        with pytest.raises(KeyboardInterrupt):
            local._reaped(fork.pid)
        assert calls == [fork.pid, fork.pid]
        fork.returncode = -signal.SIGKILL  # reaped above, by its number
    finally:
        if fork.returncode is None:
            fork.kill()
            fork.wait()


_WAITING_FORK = """
import os, sys, time
from fsdpclip.launch.local import in_a_fork

def work():
    with open(sys.argv[1] + ".part", "w") as out:
        out.write(str(os.getpid()))
    os.rename(sys.argv[1] + ".part", sys.argv[1])
    time.sleep(60)

try:
    in_a_fork(work)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.mark.parametrize("signal_name,group", [("SIGINT", True), ("SIGINT", False), ("SIGKILL", False)])
def test_a_fork_ends_with_the_launcher_that_stops_waiting_for_it(tmp_path, signal_name, group):
    """A signal while the launcher's checks run in a fork. Ctrl-C (SIGINT to the process group) or SIGINT to the
    launcher alone: it kills the fork, reaps it and stops; SIGKILL to the launcher: the kernel ends the fork with
    it (PR_SET_PDEATHSIG)."""
    import signal
    import time

    from fsdpclip.run.lock import process_alive

    marker = tmp_path / "fork.pid"
    launcher = subprocess.Popen([sys.executable, "-c", _WAITING_FORK, str(marker)], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)},
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.05)
        fork = int(marker.read_text())
        if group:
            os.killpg(launcher.pid, getattr(signal, signal_name))
        else:
            launcher.send_signal(getattr(signal, signal_name))
        out, _ = launcher.communicate(timeout=20)
        assert ("interrupted" in out) == (signal_name == "SIGINT"), out
        deadline = time.monotonic() + 10
        while process_alive(fork) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_alive(fork)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
