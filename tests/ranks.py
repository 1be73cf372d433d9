"""Start a small torchrun job from a test and stop exactly its processes (by process group).

    python tests/ranks.py TORCHRUN-ARGS... /ABS/SCRIPT.py ARGS...     (what `torchrun` below runs)

As a script, this is torchrun with torch, OpenCLIP and the trainer imported, for ranks forked from it (torchrun's
`--run-path --start-method=fork`), as `fsdpclip launch` forks its ranks: they need not import them again (~4
CPU-seconds each).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240, cwd: Path = REPO,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun_command(args, nproc)`; kill its whole group on timeout."""
    return run_group(torchrun_command(args, nproc, cwd), timeout, cwd, env)


def torchrun_command(args: list[str], nproc: int = 2, cwd: Path = REPO) -> list[str]:
    """`torchrun --standalone --nproc-per-node=nproc ARGS` (ARGS: a script and its arguments, or `-m MODULE` and its
    arguments), its ranks forked from it (this file as a script)."""
    return [sys.executable, __file__, "--standalone", f"--nproc-per-node={nproc}", "--run-path", "--start-method=fork",
            *_as_script(args, cwd)]


def _as_script(args: list[str], cwd: Path) -> list[str]:
    """torchrun's ARGS with the script as an absolute path (`-m MODULE`: its `__main__`'s file)."""
    if args[0] == "-m":
        module = args[1] if args[1].endswith("__main__") else f"{args[1]}.__main__"
        return [importlib.util.find_spec(module).origin, *args[2:]]
    return [str((cwd / args[0]).resolve()), *args[1:]]


def run_group(command: list[str], timeout: float, cwd: Path = REPO, env: dict | None = None, unset: tuple = ()):
    """Run a command in its own process group (without the variables in `unset`); on timeout stop that group
    (and only it)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    for key in unset:
        full_env.pop(key, None)
    process = subprocess.Popen(command, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(command)}\n{output[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def json_result(command: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run a command that prints a JSON object (run_group), check it exits 0, and return the last object
    it printed (its output also holds stderr: warnings, logs)."""
    result = run_group(command, timeout, env=env)
    assert result.returncode == 0, result.stdout[-3000:]
    return last_json(result.stdout)


def last_json(output: str) -> dict:
    """The last line of `output` that holds a JSON object. stderr shares the pipe: a warning from another thread
    may precede the object on its line, and lines holding '{"' that are no JSON may follow it."""
    for line in reversed(output.splitlines()):
        with contextlib.suppress(ValueError):
            return json.loads(line[line.index('{"'):])
    raise AssertionError(f"no JSON object in the output:\n{output[-3000:]}")


def start_launch(path: Path, log: Path, *extra: str) -> subprocess.Popen:
    """`fsdpclip launch PATH EXTRA` as a terminal starts it: its own process group, output to `log`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "fsdpclip", "launch", str(path), *extra], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish_launch(process: subprocess.Popen, log: Path, timeout: float = 180) -> tuple[int, str]:
    """The exit code and output of a launch `start_launch` began; its whole group killed past `timeout`."""
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise AssertionError(f"launch still running after {timeout}s:\n{log.read_text()[-4000:]}")
    return code, log.read_text()


if __name__ == "__main__":
    from fsdpclip.launch.local import collection_paused

    with collection_paused():  # as `fsdpclip launch` imports for a job that does not log to W&B
        from fsdpclip.model.build import without_modules

        with without_modules(("wandb",)):
            import open_clip  # noqa: F401

        import fsdpclip.train.trainer  # noqa: F401
        from torch.distributed.run import main

    main()
