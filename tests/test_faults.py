"""Faults the way they happen: signals to a launch's whole process group, a second launch into a run
directory in use, specs changed between launches, checkpoints that cannot be read, a rank that crashes.

Every test starts `fsdpclip launch` in a process group of its own and stops only that group; it
checks that no process of the job outlives it (scanning /proc for the job's file on a command line).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    PREEMPTIBLE_STEPS, TINY_CONFIG, RunsCode, assert_same_losses, logged_losses, preemptible_job, printed_commands,
    run_printed, small_disk, squeezed, write_job,
)
from ranks import (
    REPO, finish_launch, json_result, last_json, run_group, start_launch, torchrun, torchrun_command,
)


def _wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ((run_dir / "metrics.jsonl").is_file() and max(logged_losses(run_dir), default=0) >= step):
        assert process.poll() is None, f"the launch ended early:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"step {step} never came:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def _wait_just_past_a_stop_check(run_dir: Path, process: subprocess.Popen, log: Path) -> None:
    """Until the ranks have just passed a stop check (every 10 steps for these fast steps), so that a signal sent
    now leaves them several steps of work before they can act on it."""
    step = 11
    while True:
        _wait_for_step(run_dir, step, process, log)
        if max(logged_losses(run_dir)) % 10 in range(1, 5):
            return
        step += 10


def _job_processes(run_dir: Path, spec: Path) -> list[int]:
    """The job's processes: those whose command line names its spec (the launcher, and torchrun, the ranks and
    their data workers forked from it carry the launcher's command line) or RUN_DIR/job.json (ranks started
    as new interpreters)."""
    return sorted(set(_processes_naming(spec)) | set(_processes_naming(run_dir / "job.json")))


def _processes_naming(path: Path) -> list[int]:
    """Processes whose command line names `path` (torchrun, its ranks, their data workers)."""
    needle, found = str(path).encode(), []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


def _none_left(run_dir: Path, spec: Path, grace: float = 15) -> None:
    deadline = time.monotonic() + grace
    while _job_processes(run_dir, spec):
        assert time.monotonic() < deadline, f"processes of the job outlived it: {_job_processes(run_dir, spec)}"
        time.sleep(0.2)


def _all_running(run_dir: Path, spec: Path) -> None:
    """The job's processes as `_none_left` finds them while it runs: the launcher, torchrun, 2 ranks and their
    data workers (so that finding none afterwards means something)."""
    assert len(_job_processes(run_dir, spec)) >= 6, _job_processes(run_dir, spec)


def _exit_report(run_dir: Path) -> dict:
    return json.loads((run_dir / "exit.json").read_text())


def _report(cli, run_dir: Path, tmp_path: Path) -> dict:
    result = cli("report", run_dir, "--json", "--png", tmp_path / "report.png")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_sigterm_to_the_launch_group_checkpoints_and_resumes(tmp_path, digits_dir, straight_losses, cli):
    """SIGTERM to the whole process group of `fsdpclip launch` (a scheduler's `kill -TERM -PGID`), with
    2 data workers per rank: a checkpoint, exit 75, no process left, no traceback nor torchrun's error line, the
    stop said once, by the launch's own last lines, which say how to resume; relaunched as the report printed
    there says (`launch RUN/job.json`), the run finishes with the losses of a run that was never stopped, and the
    launch's own resume command then finds it finished."""
    run_dir = tmp_path / "runs" / "preempted"
    path = write_job(tmp_path, preemptible_job(tmp_path / "runs", digits_dir, "preempted"))
    process = start_launch(path, tmp_path / "first.log")
    _wait_for_step(run_dir, 2, process, tmp_path / "first.log")
    _all_running(run_dir, path)
    os.killpg(process.pid, signal.SIGTERM)
    code, output = finish_launch(process, tmp_path / "first.log")
    assert code == 75, output[-4000:]
    assert "Traceback" not in output and "killed by signal" not in output and "exitcode: 75" not in output
    assert f"run directory: {run_dir}\nresume: fsdpclip launch {path}\nprogress: fsdpclip report {run_dir}" in output
    report = _exit_report(run_dir)
    at = report["step"]  # the ranks' next stop check: step 10, or 5 where a loaded machine makes steps slow
    assert report["code"] == 75 and at in (5, 10) and f"a stop was requested: stopped after step {at}" in \
        report["message"], report
    assert output.count("a stop was requested") == 1, output[-4000:]
    _none_left(run_dir, path)
    stopped = _report(cli, run_dir, tmp_path)
    assert stopped["state"] == f"stopped (preempted or asked to), resumable from step {at}"
    assert stopped["last_checkpoint"] == f"step-{at:08d}" and stopped["exit"]["code"] == 75
    printed = printed_commands(output)
    code, shown = run_printed(printed["progress"][0], cli)
    assert code == 0 and printed_commands(shown)["resume"] == [["fsdpclip", "launch", str(run_dir / "job.json")]]
    code, again = run_printed(printed_commands(shown)["resume"][0], cli)
    assert code == 0, again[-4000:]
    assert "resumed from" in again and f"step-{at:08d}" in again
    assert_same_losses(run_dir, straight_losses)
    finished = _report(cli, run_dir, tmp_path)
    assert finished["state"] == "finished" and finished["step"] == finished["total_steps"] == max(straight_losses)
    assert finished["launches"] == 2 and finished["restarts_at"] == [at] and finished["relaunch"] is None
    resumed = cli(*printed["resume"][0][1:])  # in-process: a finished run starts nothing
    assert resumed.exit_code == 0 and "already finished" in resumed.output, resumed.output[-3000:]


@pytest.mark.slow
def test_busy_run_directory_and_a_second_interrupt(tmp_path, digits_dir, cli):
    """While a job runs, a second launch into its run directory is refused (exit 2, naming the holder)
    and changes nothing; two Ctrl-C to the first stop it at once (exit 130), leaving no process: the launch and
    the report say it stopped, resumable from its last checkpoint, and how to resume it."""
    run_dir = tmp_path / "runs" / "busy"
    job = preemptible_job(tmp_path / "runs", digits_dir, "busy")
    job["schedule"]["steps"], job["batch"]["per_gpu"] = 1000, 64  # slow steps: the ranks must not stop first
    job["checkpoint"]["every_steps"] = 10
    path = write_job(tmp_path, job)
    first = start_launch(path, tmp_path / "first.log")
    _wait_for_step(run_dir, 2, first, tmp_path / "first.log")
    _all_running(run_dir, path)
    written = (run_dir / "job.json").read_text()
    second = cli("launch", path, "--set", "optimizer.lr=0.5")  # in-process: it is refused before any rank starts
    assert second.exit_code == 2, second.output[-3000:]
    assert squeezed(f"is in use by pid {first.pid} on {socket.gethostname()}") in squeezed(second.output)
    assert (run_dir / "job.json").read_text() == written
    running = _report(cli, run_dir, tmp_path)  # `fsdpclip report` on the live run
    assert running["state"] == "running" and running["holder"].startswith(f"pid {first.pid} ")
    assert running["total_steps"] == 1000 and running["eta_s"] > 0
    _wait_just_past_a_stop_check(run_dir, first, tmp_path / "first.log")
    os.killpg(first.pid, signal.SIGINT)
    time.sleep(0.3)  # two signals at once would be one
    os.killpg(first.pid, signal.SIGINT)
    code, output = finish_launch(first, tmp_path / "first.log", timeout=60)
    assert code == 130, output[-3000:]
    _none_left(run_dir, path)
    kept = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert _exit_report(run_dir)["code"] == 130
    assert f"‖ stopped at once (a second interrupt), resumable from its last checkpoint, {kept}" in output
    printed = printed_commands(output)
    assert printed["resume"] == [["fsdpclip", "launch", str(path)]] and "logs:" not in output, output[-3000:]
    code, shown = run_printed(printed["progress"][0], cli)
    step = int(kept.removeprefix("step-"))
    assert code == 0 and f"stopped at once (a second interrupt), resumable from step {step}" in shown, shown
    assert printed_commands(shown)["resume"] == [["fsdpclip", "launch", str(run_dir / "job.json")]]
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(steps) == len(set(steps))  # one job wrote them


# `fsdpclip launch` on a terminal of its own: a session leader whose controlling terminal is the pty on fds
# 0-2 (as a login shell's job is), so that the pty hanging up sends it SIGHUP. argv: the launch's arguments.
_ON_A_TERMINAL = """
import fcntl, os, sys, termios
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
os.execv(sys.executable, [sys.executable, "-m", "fsdpclip", "launch", *sys.argv[1:]])
"""


class Terminal:
    """A pseudo-terminal that `fsdpclip launch` runs on (`_ON_A_TERMINAL`); what it shows is kept in `log`
    until it hangs up (`hang_up`: its master side closed, as sshd does when a connection drops)."""

    def __init__(self, path: Path, log: Path):
        import threading

        master, slave = os.openpty()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([sys.executable, "-c", _ON_A_TERMINAL, str(path)], cwd=REPO, env=env,
                                        stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.master, self.log, self.open = master, log, threading.Event()
        self.open.set()
        self.reader = threading.Thread(target=self._show, daemon=True)
        self.reader.start()

    def _show(self) -> None:
        import select

        with open(self.log, "ab") as log:
            while self.open.is_set():
                if select.select([self.master], [], [], 0.1)[0]:
                    try:
                        log.write(os.read(self.master, 65536))
                    except OSError:
                        return

    def hang_up(self) -> None:
        self.open.clear()
        self.reader.join()
        os.close(self.master)


def _pause(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["hangup", "sigkill"])
def test_the_lock_outlives_the_launcher_and_the_ranks_stop_cleanly(tmp_path, digits_dir, fault, cli):
    """The launcher's terminal hangs up (SIGHUP to it, EIO to every process writing to the terminal), or the
    launcher is killed with SIGKILL, while 2 ranks with data workers train. The ranks checkpoint and exit 75
    as on a stop request (after a hang-up, writing on to RUN_DIR/logs/; after SIGKILL, once they see their
    launcher gone); while any process of the job runs (held stopped here, so that they still run when it
    starts) a second launch into the run directory is refused, naming them; once they have ended, a
    relaunch resumes from their checkpoint and finishes the run."""
    run_dir = tmp_path / "runs" / fault
    path = write_job(tmp_path, preemptible_job(tmp_path / "runs", digits_dir, fault))
    log = tmp_path / "first.log"
    if fault == "hangup":
        terminal = Terminal(path, log)
        launcher = terminal.process
    else:
        launcher = start_launch(path, log)
    paused: list[int] = []
    try:
        _wait_for_step(run_dir, 2, launcher, log)
        _all_running(run_dir, path)
        _wait_just_past_a_stop_check(run_dir, launcher, log)
        if fault == "hangup":
            terminal.hang_up()
        else:
            launcher.kill()
            launcher.wait()
        paused = [pid for pid in _job_processes(run_dir, path) if pid != launcher.pid]
        _pause(paused, signal.SIGSTOP)
        second = cli("launch", path)  # in-process: it is refused before any rank starts
        assert second.exit_code == 2 and "Traceback" not in second.output, second.output[-3000:]
        refusal = squeezed(second.output)
        assert squeezed(f"is in use by pid {launcher.pid} on {socket.gethostname()}") in refusal
        if fault == "sigkill":
            assert squeezed("which has ended; its processes") in refusal
        _pause(paused, signal.SIGCONT)
        if fault == "hangup":
            assert launcher.wait(timeout=180) == 75
        _none_left(run_dir, path, grace=180)
    finally:
        _pause(paused, signal.SIGCONT)
        _pause(_job_processes(run_dir, path), signal.SIGKILL)
        launcher.wait()
    report = _exit_report(run_dir)
    cause = "a stop was requested" if fault == "hangup" else "the launcher (fsdpclip launch) has ended"
    assert report["code"] == 75 and f"{cause}: stopped after step 20" in report["message"], report
    if fault == "hangup":
        launched = (run_dir / "logs" / "launch.out").read_text()  # the launcher's, its terminal gone
        assert "SIGHUP" in launched and "stopped after step 20" in launched  # said once, by the launcher
        assert "stopped after step 20" not in (run_dir / "logs" / "rank-00000.out").read_text()
    relaunched = _launch(path)
    assert relaunched.returncode == 0, relaunched.stdout[-3000:]
    assert "step-00000020 at step 20" in relaunched.stdout
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, PREEMPTIBLE_STEPS + 1))  # one job at a time wrote them


@pytest.mark.slow
def test_ranks_outlive_a_closed_output_pipe(tmp_path, digits_dir):
    """`fsdpclip launch` piped into a reader that goes away while the ranks train: they do not die of EPIPE
    but train to the end, their output going on in RUN_DIR/logs/rank-NNNNN.out and the launcher's in
    RUN_DIR/logs/launch.out; the launch exits 0."""
    run_dir = tmp_path / "runs" / "piped"
    path = write_job(tmp_path, preemptible_job(tmp_path / "runs", digits_dir, "piped"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "fsdpclip", "launch", str(path)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_step(run_dir, 3, launcher, tmp_path / "none.log")
        launcher.stdout.close()
        code = launcher.wait(timeout=180)
    finally:
        _pause(_job_processes(run_dir, path), signal.SIGKILL)
        launcher.wait()
    assert code == 0 and _exit_report(run_dir)["code"] == 0, _exit_report(run_dir)
    outputs = {name: (run_dir / "logs" / name).read_text() for name in ("rank-00000.out", "launch.out")}
    assert f"step {PREEMPTIBLE_STEPS}/{PREEMPTIBLE_STEPS}" in outputs["rank-00000.out"], outputs
    assert f"finished {PREEMPTIBLE_STEPS} steps" in outputs["launch.out"]
    assert not any("Traceback" in text for text in outputs.values()), outputs


def _short_job(tmp_path, **extra) -> dict:
    """2 epochs of 320 synthetic samples, 16 per rank and step: 20 steps, a checkpoint every 10, saved in
    the background."""
    job = {"run": {"name": "story", "output_dir": str(tmp_path / "runs"), "seed": 1},
           "model": {"config": str(TINY_CONFIG)}, "fsdp": {"param_dtype": "fp32"},
           "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 2, "epochs": 2},
           "data": {"source": "synthetic", "samples": 320}, "batch": {"per_gpu": 16},
           "checkpoint": {"every_steps": 10, "keep": 2, "async_save": True}, "logging": {"every_steps": 1},
           "launch": {"gpus_per_node": 2, "device": "cpu", "collective_timeout_s": 60}}
    job.update(extra)
    return job


def _launch(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_group([sys.executable, "-m", "fsdpclip", "launch", str(path), *extra], timeout=300)


def _cosine_lr(peak: float, warmup: int, total: int, step: int) -> float:
    """open_clip_train's cosine_lr at a step, written out."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) * peak


def _truncate(checkpoint: Path) -> str:
    shard = sorted(checkpoint.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard.name


@pytest.mark.slow
def test_relaunches_of_one_run(tmp_path, cli):
    """One run (its checkpoints saved in the background) relaunched as users do. Another model: refused
    before any rank starts, job.json kept. A truncated shard in the newest checkpoint: export names the
    file (exit 2). A new lr and length: training resumes from the checkpoint before the damaged one,
    with a warning saying why, and applies them from its step (the schedule recomputed, each change
    printed and recorded). The finished epoch-based run with another batch: nothing more to train.
    No readable checkpoint left: exit 2, none replaced."""
    run_dir = tmp_path / "runs" / "story"
    path = write_job(tmp_path, _short_job(tmp_path))
    assert _launch(path).returncode == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-00000010", "step-00000020"]
    written = (run_dir / "job.json").read_text()

    other = tmp_path / "wider.json"
    other.write_text(json.dumps(json.loads(TINY_CONFIG.read_text()) | {"embed_dim": 96}))
    refused = cli("launch", path, "--set", f"model.config={other}")  # launches that start no rank run in-process
    assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output[-3000:]
    assert "model.config" in refused.output and squeezed("differs from") in squeezed(refused.output)
    assert (run_dir / "job.json").read_text() == written
    code, out = cli.validate_json(path, "--set", f"model.config={other}")
    assert code == 2 and out["errors"][0]["location"] == "model.config"

    newest = run_dir / "checkpoints" / "step-00000020"
    shard = _truncate(newest)
    exported = cli("export", run_dir, tmp_path / "out.pt")
    assert exported.exit_code == 2 and "Traceback" not in exported.output
    assert squeezed(f"{shard} is truncated") in squeezed(exported.output)
    assert not list(tmp_path.glob("out.pt*"))

    longer = ("--set", "optimizer.lr=0.002", "--set", "schedule.epochs=3")
    relaunched = _launch(path, *longer)
    assert relaunched.returncode == 0, relaunched.stdout[-3000:]
    assert f"skipping {newest}: {shard} is truncated" in relaunched.stdout
    assert "step-00000010 at step 10" in relaunched.stdout
    for change in ("optimizer.lr: 0.001 → 0.002", "schedule.epochs: 2 → 3"):
        assert change in relaunched.stdout
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert max(records) == 30 and records[11]["lr"] == pytest.approx(_cosine_lr(0.002, 2, 30, 10), rel=1e-6)
    history = sorted((run_dir / "launches").glob("*.json"))
    assert len(history) == 2 and "optimizer.lr: 0.001 → 0.002" in json.loads(history[-1].read_text())["changes"]

    finished = cli("launch", path, *longer, "--set", "batch.per_gpu=8")
    assert finished.exit_code == 0 and "already finished: step 30 of 30" in finished.output, finished.output[-3000:]
    assert max(logged_losses(run_dir)) == 30

    for checkpoint in (run_dir / "checkpoints").glob("step-*"):
        (checkpoint / "meta.json").unlink()
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    stopped = cli("launch", path, *longer)
    assert stopped.exit_code == 2 and "checkpoint.resume" in stopped.output
    code, out = cli.validate_json(path, *longer)
    assert code == 2 and "none can be loaded" in out["errors"][0]["message"]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == kept


@pytest.mark.slow
def test_checkpoint_files_that_would_run_code_or_are_damaged(tmp_path, digits_dir, cli):
    """Checkpoint files planted with a pickle that would create a file (the newest DCP .metadata, a rank's state
    in the one before): validate, launch and eval refuse them, naming each file (exit 2, no traceback), and
    nothing runs. The newest checkpoint's rank state truncated instead: the relaunch resumes from the one
    before with a line saying which file is why. A rank's state file missing: named."""
    run_dir = tmp_path / "runs" / "story"
    path = write_job(tmp_path, _short_job(tmp_path, schedule={"warmup_steps": 2, "steps": 4},
                                          checkpoint={"every_steps": 2, "keep": 2}))
    assert _launch(path).returncode == 0
    older, newest = run_dir / "checkpoints" / "step-00000002", run_dir / "checkpoints" / "step-00000004"
    kept = {file: file.read_bytes() for file in (older / "rank-00001.pt", newest / ".metadata")}
    marker = tmp_path / "code-ran"
    (newest / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    torch.save({"rng": RunsCode(marker), "data": {}}, older / "rank-00001.pt")
    refusals = [squeezed(f"{file} holds a pickle that names {os.system.__module__}.system: refusing to load it")
                for file in (".metadata", "rank-00001.pt")]

    code, out = cli.validate_json(path)
    assert code == 2 and "none can be loaded" in out["errors"][0]["message"]
    assert all(refusal in squeezed(out["errors"][0]["message"]) for refusal in refusals)
    launched = cli("launch", path)  # in-process: it starts no rank
    assert launched.exit_code == 2 and "Traceback" not in launched.output, launched.output[-3000:]
    assert all(refusal in squeezed(launched.output) for refusal in refusals)
    evaluated = cli("eval", run_dir, "--zeroshot", "digits", "--data", digits_dir / "test")
    assert evaluated.exit_code == 2 and "Traceback" not in evaluated.output
    assert squeezed(f"{newest} cannot be read: ") + refusals[0] in squeezed(evaluated.output)
    assert not marker.exists()

    for file, content in kept.items():
        file.write_bytes(content)
    damaged = newest / "rank-00001.pt"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    relaunched = _launch(path, "--set", "schedule.steps=6")
    assert relaunched.returncode == 0, relaunched.stdout[-3000:]
    assert f"skipping {newest}: rank-00001.pt is truncated or damaged" in relaunched.stdout
    assert f"resumed from {older} at step 2" in relaunched.stdout

    (run_dir / "checkpoints" / "step-00000006" / "rank-00000.pt").unlink()
    code, out = cli.validate_json(path, "--set", "schedule.steps=8", "--accept-changes")  # the cosine stretched
    assert code == 0 and [w["message"] for w in out["warnings"] if "rank-00000.pt" in w["message"]] == \
        [f"skipping {run_dir / 'checkpoints' / 'step-00000006'}: rank-00000.pt is missing"]


@pytest.mark.slow
def test_a_relaunch_compares_files_by_content(tmp_path, digits_dir, cli):
    """What a relaunch finds in the files its spec names, compared with what its checkpoint saw: the model
    config copied elsewhere unchanged is the same model (accepted); edited in place it is another (refused,
    naming what differs); a shard rewritten under the same URL (another size and modification time) is said at
    resume, and the data stream restarts its epoch instead of reading other samples from the saved position."""
    shutil.copytree(digits_dir, tmp_path / "digits")
    config = tmp_path / "model.json"
    shutil.copy(TINY_CONFIG, config)
    job = preemptible_job(tmp_path / "runs", tmp_path / "digits", "files")
    job["model"]["config"], job["schedule"]["steps"], job["checkpoint"]["every_steps"] = str(config), 4, 4
    path = write_job(tmp_path, job)
    assert _launch(path).returncode == 0

    shutil.copy(config, tmp_path / "elsewhere.json")
    code, out = cli.validate_json(path, "--set", f"model.config={tmp_path / 'elsewhere.json'}")
    assert (code, out["errors"]) == (0, []), out
    config.write_text(json.dumps(json.loads(TINY_CONFIG.read_text()) | {"embed_dim": 96}))
    code, out = cli.validate_json(path)
    assert code == 2 and [(e["location"], e["value"]) for e in out["errors"]] == [("model.config", {"embed_dim": 96})]
    assert "which was trained with {'embed_dim': 64}" in out["errors"][0]["message"]
    shutil.copy(TINY_CONFIG, config)

    shard = tmp_path / "digits" / "train-000003.tar"
    shard.write_bytes(shard.read_bytes() + bytes(1024))  # a longer end of archive: the same samples, another file
    rewritten = "data.urls: the same URLs name other files than the checkpoint read (8 local shards"
    longer = ("--set", "schedule.steps=6", "--accept-changes")  # the finished cosine's LR goes up again
    code, out = cli.validate_json(path, *longer)
    assert code == 0 and [w["location"] for w in out["warnings"] if rewritten in w["message"]] == ["data.urls"], out
    relaunched = _launch(path, *longer)
    assert relaunched.returncode == 0, relaunched.stdout[-3000:]
    assert f"changed since step-00000004: {rewritten}" in relaunched.stdout
    assert "the data stream restarts at its epoch (data or batch changed)" in relaunched.stdout


@pytest.mark.slow
def test_a_crashing_rank_is_reported(tmp_path, cli):
    """A rank that fails (here: its shard is no tar, so it holds no sample to read) ends the launch with one
    ✗ line naming it and its error, written to exit.json over the previous launch's report, then where its logs
    are and the commands that come next (the report runs as printed, though no step was logged)."""
    import webdataset as wds

    from fsdpclip.data.digits import load_sklearn_digits, to_jpeg

    images, _ = load_sklearn_digits()
    for shard, count in enumerate((40, 3)):
        with wds.TarWriter(str(tmp_path / f"s-{shard}.tar")) as sink:
            for i in range(count):
                sink.write({"__key__": f"{shard}-{i:03d}", "jpg": to_jpeg(images[i]), "txt": "a digit"})
    (tmp_path / "s-1.tar").write_bytes(b"not a tar " * 100)
    job = _short_job(tmp_path, data={"urls": str(tmp_path / "s-{0..1}.tar"), "samples": 43, "workers": 1},
                     schedule={"steps": 5})
    run_dir = tmp_path / "runs" / "story"
    run_dir.mkdir(parents=True)
    (run_dir / "exit.json").write_text(json.dumps({"code": 0, "message": "finished 40 steps", "time": 1.0}))
    path = write_job(tmp_path, job)
    crashed = _launch(path)
    report = _exit_report(run_dir)
    assert crashed.returncode == 1 and report["code"] == 1, crashed.stdout[-3000:]
    assert "failed: RuntimeError: rank" in report["message"] and "hold no readable sample" in report["message"]
    assert f"✗ {report['message'][:60]}" in crashed.stdout
    assert f"logs: {run_dir / 'logs'}" in crashed.stdout and (run_dir / "logs").is_dir()
    printed = printed_commands(crashed.stdout)  # `run again` runs as printed in test_a_full_disk_is_named_once_...
    assert printed["run again (it resumes from the last checkpoint, if any)"] == [["fsdpclip", "launch", str(path)]]
    code, shown = run_printed(printed["progress"][0], cli)  # no step logged: the summary, without curves
    assert code == 0 and "failed (exit 1)" in shown and "no training step logged yet" in shown, shown
    assert printed_commands(shown)["launch again"] == [["fsdpclip", "launch", str(run_dir / "job.json")]]


def _ranks(launcher: int) -> list[int]:
    """The ranks under a launch, in rank order: torchrun's children (the launcher's child), which it starts one
    after another from local rank 0."""
    def children(pid: int) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if entry.isdigit() and int(fields[1]) == pid:
                found.append((int(fields[19]), int(entry)))  # start time (clock ticks), pid
        return [pid for _, pid in sorted(found)]

    torchrun = children(launcher)
    return children(torchrun[0]) if torchrun else []


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named(tmp_path, digits_dir):
    """SIGKILL to one rank of a 2-rank launch (the kernel's out-of-memory killer, a user's kill -9), data workers
    on: the launch ends with exit 1 and one line naming that rank and the signal (exit.json too), not the
    other rank's lost connection; no traceback (gloo's `[/…/pair.cc:545]` in that error is no rich markup
    either); no process of the job is left."""
    job = preemptible_job(tmp_path / "runs", digits_dir, "killed")
    job["schedule"]["steps"] = 100_000
    path, log, run_dir = write_job(tmp_path, job), tmp_path / "launch.log", tmp_path / "runs" / "killed"
    process = start_launch(path, log)
    try:
        _wait_for_step(run_dir, 3, process, log)
        ranks = _ranks(process.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        code, output = finish_launch(process, log, timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    _none_left(run_dir, path)
    assert code == 1, output[-3000:]
    assert _exit_report(run_dir)["message"].startswith("rank 1 was killed by SIGKILL"), _exit_report(run_dir)
    assert "✗ rank 1 was killed by SIGKILL" in output, output[-3000:]
    assert "Traceback" not in output and "Error" not in output.split("✗ rank 1")[1], output[-3000:]
    assert f"resumes from the last checkpoint, if any): fsdpclip launch {path}" in output, output[-3000:]


def test_lock_of_a_finished_process_is_taken_over(tmp_path):
    """A lock left by a process that is gone (same host) is taken over; a live holder's is not."""
    from fsdpclip.run.lock import RunLocked, acquire_lock, lock_holder, release_lock

    (tmp_path / "lock").write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "token": "old",
                                               "since": time.time()}))
    assert acquire_lock(tmp_path, "new") is True and lock_holder(tmp_path).token == "new"
    assert acquire_lock(tmp_path, "new") is False  # the same job again (a requeued Slurm job)
    with pytest.raises(RunLocked, match=f"pid {os.getpid()}"):
        acquire_lock(tmp_path, "third")
    release_lock(tmp_path, "new")
    assert lock_holder(tmp_path) is None


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def _race_for_locks(run_dirs: list[Path], token: str, barrier, results) -> None:
    """One of two processes taking each run directory's lock at the same instant as the other."""
    from fsdpclip.run.lock import RunLocked, acquire_lock

    outcomes = []
    for run_dir in run_dirs:
        barrier.wait(timeout=60)
        try:
            outcomes.append("took" if acquire_lock(run_dir, token) else "joined")
        except RunLocked:
            outcomes.append("refused")
    barrier.wait(timeout=60)  # alive until the other has tried the last lock: a holder that ended is stale
    results.put((token, outcomes))


def test_taking_over_a_stale_lock_is_atomic(tmp_path):
    """200 times, two processes released by one barrier take over a stale lock (its pid is gone) at the
    same instant: exactly one holds it and the other is refused (the take-over was an unlink and a link
    apart, and the second start could unlink the first one's new lock: two holders)."""
    import multiprocessing

    dead = _dead_pid()
    run_dirs = []
    for trial in range(200):
        run_dirs.append(tmp_path / f"{trial:03d}")
        run_dirs[-1].mkdir()
        (run_dirs[-1] / "lock").write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "token": "dead",
                                                       "since": time.time()}))
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    racers = [context.Process(target=_race_for_locks, args=(run_dirs, token, barrier, results)) for token in "ab"]
    for racer in racers:
        racer.start()
    try:
        outcomes = dict(results.get(timeout=120) for _ in racers)
    finally:
        for racer in racers:
            racer.join(timeout=10)
            if racer.is_alive():
                racer.kill()
                racer.join()
    for trial, run_dir in enumerate(run_dirs):
        both = sorted([outcomes["a"][trial], outcomes["b"][trial]])
        assert both == ["refused", "took"], (trial, both)
        winner = "a" if outcomes["a"][trial] == "took" else "b"
        assert json.loads((run_dir / "lock").read_text())["token"] == winner


def test_a_lock_is_held_by_processes_not_pids(tmp_path):
    """The lock names processes by pid and start time: a lock whose pid now belongs to another process (a pid
    reused after a restart) is stale and taken over; a lock whose first process is gone but another process
    of the job (torchrun, a rank) runs is not, and the holder named says which still run; a job process that
    gives the lock back while another runs keeps it theirs; an unreaped (zombie) holder holds nothing; a
    requeued Slurm job on another node takes its own lock afresh."""
    from fsdpclip.run.lock import HeldLock, RunLocked, acquire_lock, lock_holder, process_identity, release_lock

    pid, ticks = process_identity()
    host = socket.gethostname()
    (tmp_path / "lock").write_text(json.dumps({"pid": pid, "host": host, "token": "old", "since": time.time(),
                                               "started": ticks - 1}))
    assert lock_holder(tmp_path) is None and acquire_lock(tmp_path, "new") is True

    member = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    ended_with_a_member = json.dumps({"pid": _dead_pid(), "host": host, "token": "old", "since": time.time(),
                                      "members": [process_identity(member.pid)]})
    try:
        (tmp_path / "lock").write_text(ended_with_a_member)
        with pytest.raises(RunLocked, match=f"which has ended; its processes {member.pid} still run"):
            acquire_lock(tmp_path, "new")
        (tmp_path / "lock").unlink()
        with HeldLock(tmp_path, "job") as lock:
            assert lock.taken and acquire_lock(tmp_path, "job") is False  # the same job's rank 0 joins
            lock.add(member.pid)
        assert json.loads((tmp_path / "lock").read_text())["token"] == "job"  # given back, still held by the member
        with pytest.raises(RunLocked, match=f"pid {pid} on"):
            acquire_lock(tmp_path, "other")
    finally:
        member.kill()
    os.waitid(os.P_PID, member.pid, os.WEXITED | os.WNOWAIT)  # until it has ended, leaving it unreaped
    (tmp_path / "lock").write_text(ended_with_a_member)
    assert lock_holder(tmp_path) is None  # its member killed, not reaped yet: a zombie holds nothing
    member.wait()
    assert acquire_lock(tmp_path, "other") is True
    release_lock(tmp_path, "other")
    assert not (tmp_path / "lock").exists()
    (tmp_path / "lock").write_text(json.dumps({"pid": 1, "host": "another-node", "token": "slurm-7",
                                               "since": time.time()}))
    assert acquire_lock(tmp_path, "slurm-7") is True  # the job requeued on another node takes its lock afresh
    assert lock_holder(tmp_path).processes() == [(pid, ticks)] and lock_holder(tmp_path).host == host


def test_every_fault_row_names_a_test():
    """docs/faults.md: every row names a test, and every test it names exists."""
    import re

    rows = [line for line in (REPO / "docs" / "faults.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith(("| fault", "|---"))]
    assert len(rows) >= 20
    for row in rows:
        tests = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row)
        assert tests, row
        for file, name in tests:
            assert re.search(rf"^def {name}\(", (REPO / file).read_text(), re.M), f"{file}::{name} not found"


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_nothing_behind(tmp_path):
    """write_atomically (exit reports, compile caches, locks): a write that fails half-way raises, keeps
    the previous file whole and leaves no partial file in the run directory."""
    from fsdpclip.run.files import write_atomically

    target = tmp_path / "exit.json"
    write_atomically(target, "old")
    with pytest.raises(UnicodeEncodeError):
        write_atomically(target, "new \ud800")  # a lone surrogate: encoding fails inside the write
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["exit.json"]


# A rank (world of one) whose trainer starts a child process that ignores SIGTERM, as data workers do,
# and then crashes; prints what `train.main` raised and how many children were left. argv: the job file.
_CRASH_WITH_A_CHILD = """
import json, multiprocessing, signal, sys, time
from fsdpclip.launch import entry as train
from fsdpclip.train import trainer

def stubborn():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)

class Crashing:
    def __init__(self, *args, **kwargs):
        multiprocessing.Process(target=stubborn, daemon=True).start()

    def fit(self):
        raise RuntimeError("crashed on purpose")

    def close(self):
        pass

trainer.Trainer = Crashing
try:
    train.main([sys.argv[1]])
except RuntimeError as exc:
    print(json.dumps({"error": str(exc), "children": len(multiprocessing.active_children())}))
"""


@pytest.mark.slow
def test_a_crashing_rank_stops_its_children_and_exits(tmp_path, tiny_job):
    """A rank that crashes while a child that ignores the stop signals runs (a data worker) kills it and
    ends: multiprocessing would otherwise wait for it at exit forever, the rank keeping SIGTERM for itself."""
    tiny_job["launch"]["gpus_per_node"] = 1
    result = json_result([sys.executable, "-c", _CRASH_WITH_A_CHILD, str(write_job(tmp_path, tiny_job))], timeout=60)
    assert result == {"error": "crashed on purpose", "children": 0}


@pytest.mark.slow
def test_a_crash_in_an_evaluation_during_training_ends_the_run(tmp_path, digits_dir):
    """Both ranks fail in their first evaluation (an out-of-memory on the first batch) while the training's
    and the evaluation's data workers run (they ignore SIGTERM): each rank reports its crash and ends, and
    torchrun with it; no process of the job is left (any that is, is killed by pid and fails the test)."""
    job = preemptible_job(tmp_path / "runs", digits_dir, "evalcrash")
    job["eval"] = {"zeroshot": [{"dataset": "digits", "path": str(digits_dir / "test"), "max_samples": 8}],
                   "every_steps": 2, "batch_per_gpu": 8}
    path = write_job(tmp_path, job)
    command = torchrun_command(["tests/workers/faults.py", str(path), "eval-crash"])
    with open(tmp_path / "run.log", "w") as log:  # a file: ranks left running would hold a pipe open
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            code = process.wait(timeout=180)
        finally:
            left = _processes_naming(path)  # ranks run in sessions of their own: not in torchrun's group
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.wait()
    assert left == [] and code != 0, (left, (tmp_path / "run.log").read_text()[-3000:])
    logs = tmp_path / "runs" / "evalcrash" / "logs"
    for rank in (0, 1):
        report = json.loads((logs / f"crash-rank-{rank:05d}.json").read_text())
        assert "out of memory in the evaluation (injected)" in report["error"]


@pytest.mark.slow
def test_a_full_disk_is_named_once_and_loses_nothing(tmp_path, cli):
    """A run directory on a 64 MB disk where the second checkpoint (~41 MB) does not fit beside the first: the
    ranks agree on it before writing anything of it, the launch ends with exit 74 and one line naming the device,
    the mount point, the checkpoint's path, the space needed and free (no OSError or traceback from any
    rank); the first checkpoint stays latest and whole, and once the disk is larger the launch's own `run again`
    command, run as printed, resumes from it and finishes."""
    with small_disk(tmp_path / "disk", 64) as disk:
        job = _short_job(tmp_path, run={"name": "full", "output_dir": str(disk), "seed": 1}, schedule={"steps": 8},
                         checkpoint={"every_steps": 4, "keep": 2})
        path, run_dir = write_job(tmp_path, job), disk / "full"
        full = _launch(path)
        output = full.stdout
        assert full.returncode == 74, output[-3000:]
        needed = r"needed ~\d+ MB, \d+ MB free"
        line = f"✗ no space left on tmpfs ({disk}) writing {run_dir}/checkpoints/step-00000008: "
        assert line in output and len(re.findall(needed, output)) <= 2, output[-3000:]  # the trainer's, the last line
        assert "Traceback" not in output and "Errno" not in output and "rank 1" not in output, output[-3000:]
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000004"
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-00000004"]
        assert _exit_report(run_dir)["code"] == 74
        subprocess.run(["mount", "-o", "remount,size=160m", str(disk)], check=True)
        [again] = printed_commands(output)["run again (it resumes from the last checkpoint, if any)"]
        code, resumed = run_printed(again, cli)  # as the failed launch printed it
        assert code == 0, resumed[-3000:]
        assert "resumed from" in resumed and _exit_report(run_dir)["step"] == 8


@pytest.mark.slow
def test_a_disk_that_fills_while_metrics_are_written_leaves_no_torn_line(tmp_path):
    """Another writer fills the run directory's disk just before rank 0 appends a metrics record that needs a
    block more (after the checkpoint of step 10): the record is taken back rather than left half written, the run
    ends with exit 74 and exit.json names the disk and the checkpoint kept; once there is room, a relaunch resumes
    from it and metrics.jsonl holds whole records only, with every step logged."""
    with small_disk(tmp_path / "disk", 128) as disk:
        job = _short_job(tmp_path, run={"name": "torn", "output_dir": str(disk), "seed": 1},
                         schedule={"warmup_steps": 2, "steps": 30}, checkpoint={"every_steps": 10, "keep": 1})
        path, run_dir = write_job(tmp_path, job), disk / "torn"
        full = torchrun(["tests/workers/faults.py", str(path), "fill-disk:10"], timeout=300)
        assert "exitcode  : 74" in full.stdout, full.stdout[-3000:]  # rank 0 (torchrun names it)
        assert (run_dir / "metrics.jsonl").read_bytes().endswith(b"\n")
        report, kept = _exit_report(run_dir), (run_dir / "checkpoints" / "latest").read_text().strip()
        assert report["code"] == 74 and report["checkpoint"] == str(run_dir / "checkpoints" / kept), report
        assert report["message"].startswith(f"rank 0: no space left on tmpfs ({disk}) writing {run_dir}/metrics.jsonl")
        assert f"the last complete checkpoint, {kept}, is kept: make room" in report["message"], report
        (disk / "filler").unlink()
        resumed = _launch(path)
        assert resumed.returncode == 0 and f"resumed from {run_dir}/checkpoints/{kept}" in resumed.stdout, \
            resumed.stdout[-3000:]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records if "loss" in r} == set(range(1, 31))


def test_a_launch_whose_ranks_could_not_report_on_a_full_disk_names_it_and_the_checkpoint(tmp_path):
    """Under `fsdpclip launch` a rank out of space cannot write exit.json either (the launch's lock takes the last
    block), and torchrun ends with 1: once the lock is released, the launcher's report names the full disk and the
    run's last complete checkpoint instead of only the status."""
    from fsdpclip.launch.local import last_checkpoint
    from fsdpclip.run.reports import finish_exit_report

    with small_disk(tmp_path / "disk", 1) as disk:
        run_dir = disk / "run"
        kept = run_dir / "checkpoints" / "step-00000010"
        kept.mkdir(parents=True)
        (kept / "meta.json").write_text("{}")
        (run_dir / "lock").write_text("held by the launch")
        with open(disk / "filler", "wb", buffering=0) as file, contextlib.suppress(OSError):
            while file.write(b"\0" * 4096):
                pass
        (run_dir / "lock").unlink()  # the launch lets go of the run directory, then reports
        report = finish_exit_report(run_dir, 0, 1, checkpoint=last_checkpoint(run_dir))
    assert report["message"] == (f"the job ended with exit status 1 before the trainer could report; no space left "
                                 f"on tmpfs ({disk}) writing {run_dir}: 0.00 MB free (see the output above)"), report
    assert report["checkpoint"] == str(kept)


@pytest.mark.slow
def test_a_disk_that_fills_during_the_write_is_named_like_a_full_one(tmp_path):
    """Another writer fills the disk after the ranks agreed that a checkpoint fits: the failed write, synchronous
    or asynchronous (reported when it is waited for, once), is DiskFull naming the disk, not DCP's
    CheckpointException with every rank's traceback, nor a traceback of DCP's writer threads printed after it;
    the last complete checkpoint stays latest."""
    with small_disk(tmp_path / "disk", 16) as disk:
        result = run_group([sys.executable, "tests/workers/disk_fills.py", str(disk / "run")], timeout=240)
    assert result.returncode == 0 and "Traceback" not in result.stdout, result.stdout[-3000:]
    ended = last_json(result.stdout)
    for save, step in (("synchronous", 2), ("asynchronous", 3)):
        assert ended[save].startswith(f"DiskFull: no space left on tmpfs ({disk}) writing "
                                      f"{disk}/run/checkpoints/step-{step:08d}: needed ~"), ended
    assert ended["waited_again"] == "ok" and ended["latest"] == "step-00000001", ended


def test_a_crash_report_keeps_the_cause_of_a_data_workers_failure(tmp_path):
    """A data worker fails deep in its pipeline (as a mixture's weights that are not finite do): DataLoader raises
    it again in the rank with the worker's whole traceback in its message, and the launch's exit report still ends
    with the worker's own error, not with a cut through the traceback; a long one-line error keeps its end too."""
    import torch.utils.data

    from fsdpclip.run.reports import finish_exit_report, write_crash_report

    class Mixture(torch.utils.data.IterableDataset):
        def __iter__(self, depth: int = 12):
            if depth:
                yield from self.__iter__(depth - 1)
            raise ValueError("Total of weights must be finite")

    with pytest.raises(ValueError) as raised:
        next(iter(torch.utils.data.DataLoader(Mixture(), num_workers=1)))
    assert len(str(raised.value)) > 1000  # more than a crash report keeps
    write_crash_report(tmp_path, 1, raised.value)
    message = finish_exit_report(tmp_path, 0, 1)["message"]
    assert message.startswith("rank 1 failed: ValueError: Caught ValueError in DataLoader worker process 0.")
    assert message.endswith("ValueError: Total of weights must be finite") and "\n" not in message, message
    write_crash_report(tmp_path / "long", 0, RuntimeError("x" * 2000 + " the cause"))
    assert finish_exit_report(tmp_path / "long", 0, 1)["message"].endswith("x the cause")
