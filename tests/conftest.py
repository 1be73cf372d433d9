"""Shared fixtures: the CLI runner, the tiny model config and the demo digits data."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fsdpclip.cli.commands import app
from fsdpclip.launch.local import collection_paused

with collection_paused():  # what every test's process holds from its start: out of the collector's walks
    import open_clip  # noqa: F401
    import torch  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO / "examples" / "models" / "tiny-clip.json"

# The processes the tests start (launchers, torchrun's agents and their log directories, ranks, data workers,
# compilers) keep their temporary files in one directory, removed when the session ends; pytest's own
# directories stay where they were (this process keeps its temporary directory).
tempfile.gettempdir()
SUBPROCESS_TMP = Path(tempfile.mkdtemp(prefix="fsdpclip-tests-"))
os.environ["TMPDIR"] = str(SUBPROCESS_TMP)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(SUBPROCESS_TMP, ignore_errors=True)


def pytest_configure(config):
    """Under pytest-xdist (`make test`), each worker computes on one thread: the workers share the cores (torch's
    spinning thread pools, one per core in each worker, would fight over them)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def once_per_session(tmp_path_factory, name: str, compute):
    """`compute(directory)`, a JSON value, computed once per test session: pytest-xdist's workers share it (the first
    to ask computes it under a lock, in a directory that every worker sees; the others wait and read it)."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the workers' basetemps are its children
    result = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.is_file():
            result.write_text(json.dumps(compute(Path(tempfile.mkdtemp(prefix=name, dir=root)))))
        return json.loads(result.read_text())


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> Path:
    """The digits demo data, built once per test session."""
    from fsdpclip.data.digits import write_digits

    out = tmp_path_factory.mktemp("digits")
    write_digits(out, shards=8)
    return out


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory, digits_dir):
    """The demo job (examples/tiny-cpu.json) through `fsdpclip launch`, shortened to 40 steps on
    the session's digits, evaluated (zero-shot and retrieval) at step 20 and at the end (37 images per
    forward), units kept gathered after forward, MFU against 1 TFLOP/s, checkpointed at the end: (run
    directory, launch output). Run once per session, its directory only read by the tests."""
    run_dir, output = once_per_session(tmp_path_factory, "demo", lambda tmp: _launch_demo(tmp, digits_dir))
    return Path(run_dir), output


def _launch_demo(tmp: Path, digits_dir: Path) -> tuple[str, str]:
    import sys

    from ranks import run_group

    overrides = {
        "run.output_dir": str(tmp / "runs"),
        "schedule": json.dumps({"warmup_steps": 10, "steps": 40}),
        "data.urls": str(digits_dir / "train-{000000..000007}.tar"),
        "eval": json.dumps({"zeroshot": [{"dataset": "digits", "path": str(digits_dir / "test")}],
                            "retrieval": [{"path": str(digits_dir / "test"), "name": "digits"}],
                            "every_steps": 20, "batch_per_gpu": 37}),
        "fsdp.reshard_after_forward": "false",
        "logging.peak_tflops": "1",  # MFU on the CPU too: from the FLOPs the last rank counts
        "launch.collective_timeout_s": "60",
    }
    command = [sys.executable, "-m", "fsdpclip", "launch", str(REPO / "examples" / "tiny-cpu.json")]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    proc = run_group(command, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return str(tmp / "runs" / "tiny-cpu"), proc.stdout


PREEMPTIBLE_STEPS = 24


def preemptible_job(output_dir: Path, digits_dir: Path, name: str, **launch) -> dict:
    """A tiny 2-rank job on the digits shards with 2 data workers per rank, logging every step: long
    enough to be stopped mid-run, the same losses wherever it runs (so a stopped and resumed run can
    be held against one that ran straight through)."""
    return {
        "run": {"name": name, "output_dir": str(output_dir), "seed": 5},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32"},
        "optimizer": {"lr": 1e-3},
        "schedule": {"warmup_steps": 2, "steps": PREEMPTIBLE_STEPS},
        "data": {"urls": str(digits_dir / "train-{000000..000007}.tar"), "samples": 1438, "workers": 2,
                 "shuffle_buffer": 50},
        "batch": {"per_gpu": 16},
        "checkpoint": {"keep": 2},
        "logging": {"every_steps": 1},
        "launch": {"gpus_per_node": 2, "device": "cpu", "collective_timeout_s": 60, **launch},
    }


def logged_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from a run's metrics.jsonl (the last record of a step, if a step ran twice)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def assert_same_losses(run_dir: Path, straight: dict[int, float]) -> None:
    """The preemptible job in `run_dir` logged every step, with the losses of the run that went
    straight through (a stopped and resumed run must continue exactly)."""
    losses = logged_losses(run_dir)
    assert sorted(losses) == list(range(1, PREEMPTIBLE_STEPS + 1))
    for step, loss in losses.items():
        assert loss == pytest.approx(straight[step], abs=1e-5), step


@pytest.fixture(scope="session")
def straight_losses(tmp_path_factory, digits_dir) -> dict[int, float]:
    """The preemptible job run straight through: its loss at every step (run once per session)."""
    import sys

    from ranks import run_group

    def launch(tmp: Path) -> list[tuple[int, float]]:
        path = write_job(tmp, preemptible_job(tmp / "runs", digits_dir, "straight"))
        proc = run_group([sys.executable, "-m", "fsdpclip", "launch", str(path)], timeout=300)
        assert proc.returncode == 0, proc.stdout[-4000:]
        return list(logged_losses(tmp / "runs" / "straight").items())

    return dict(once_per_session(tmp_path_factory, "straight", launch))


@pytest.fixture
def tiny_job(tmp_path, digits_dir) -> dict:
    """`tiny_job_in` the test's directory."""
    return tiny_job_in(tmp_path, digits_dir)


def tiny_job_in(directory: Path, digits_dir: Path, name: str = "t") -> dict:
    """A valid tiny job (2 CPU ranks) on the digits shards, run in `directory`/runs, as a dict to edit."""
    return {
        "run": {"name": name, "output_dir": str(directory / "runs")},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32"},
        "data": {"urls": str(digits_dir / "train-{000000..000007}.tar"), "samples": 1438, "workers": 1},
        "batch": {"per_gpu": 16},
        "launch": {"gpus_per_node": 2, "device": "cpu"},
    }


def synthetic_job(directory: Path, name: str = "t", **launch) -> dict:
    """A valid tiny job of 4 steps on synthetic data on the CPU, run in `directory`/runs, as a dict to edit;
    `launch` adds to its launch section."""
    return {
        "run": {"name": name, "output_dir": str(directory / "runs")},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32"},
        "schedule": {"steps": 4},
        "data": {"source": "synthetic"},
        "batch": {"per_gpu": 16},
        "launch": {"device": "cpu", "collective_timeout_s": 60, **launch},
    }


PRINTED = re.compile(r"^(next|resume|progress|launch again|run again[^:]*): (fsdpclip .*)$")


def printed_commands(output: str) -> dict[str, list[list[str]]]:
    """The commands the last lines of a launch (or a report) give, by label ('next', 'resume', 'progress',
    'run again (...)'), each split as a shell splits it; a label's further commands are indented below it."""
    commands: dict[str, list[list[str]]] = {}
    label = None
    for line in output.splitlines():
        match = PRINTED.match(line)
        if match:
            label = match[1]
            commands.setdefault(label, []).append(shlex.split(match[2]))
        elif label is not None and line.startswith(" " * 6 + "fsdpclip "):
            commands[label].append(shlex.split(line))
        else:
            label = None
    return commands


def run_printed(command: list[str], cli: "Cli") -> tuple[int, str]:
    """A printed `fsdpclip ...` command run as a user runs it: a launch as a process of its own (its ranks are
    processes), any other command in-process; its exit code and output."""
    if command[1] == "launch":
        import sys

        from ranks import run_group

        proc = run_group([sys.executable, "-m", *command], timeout=300)
        return proc.returncode, proc.stdout
    result = cli(*command[1:])
    return result.exit_code, result.output


def write_job(tmp_path: Path, job: dict, name: str = "job.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(job))
    return path


class Cli:
    """Runs `fsdpclip` in-process and parses --json output."""

    def __init__(self):
        self.runner = CliRunner()

    def __call__(self, *args: str):
        return self.runner.invoke(app, [str(a) for a in args])

    def validate_json(self, path: Path, *extra: str) -> tuple[int, dict]:
        result = self("validate", path, "--json", *extra)
        return result.exit_code, json.loads(result.stdout)


@pytest.fixture
def cli() -> Cli:
    return Cli()


class RunsCode:
    """Pickles as a call of os.system that creates `marker`: what a planted checkpoint or weights file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def squeezed(text: str) -> str:
    """Text without whitespace or table borders, to find a message that rich wrapped in a table cell."""
    return re.sub(r"[\s│┃]+", "", text)


@contextlib.contextmanager
def hangs_fail_after(seconds: float):
    """Fail the test as hung once the block has run `seconds` (SIGALRM interrupts a blocking open or read of a FIFO;
    pytest's failure is no Exception, which the code under test or CliRunner would catch)."""
    def hung(signum, frame):
        pytest.fail(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def small_disk(path: Path, megabytes: int):
    """A tmpfs of `megabytes` at `path` (root only), unmounted afterwards; the test is skipped where none can be
    mounted."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
