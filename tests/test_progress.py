"""Training's progress on rank 0 (a live bar on a terminal, plain lines with rate and time left elsewhere), and
a launch whose output holds only what a user can act on."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
from rich.console import Console

from conftest import REPO, write_job
from fsdpclip.run.node import usable_cores
from fsdpclip.jobspec.source import DATA_SOURCES
from fsdpclip.jobspec.webdataset_spec import WebDatasetSpec
from fsdpclip.train.metrics import MetricsLog, live_progress


def test_a_live_bar_only_on_a_terminal_outside_slurm():
    terminal, pipe = Console(file=io.StringIO(), force_terminal=True), Console(file=io.StringIO())
    assert live_progress(terminal, {})
    assert not live_progress(terminal, {"SLURM_JOB_ID": "42"})
    assert not live_progress(pipe, {})


def test_plain_lines_carry_the_rate_and_the_time_left(tmp_path, capsys):
    log = MetricsLog(tmp_path, total_steps=100, tensorboard=False, enabled=True)
    log.advance(40)
    log.write({"step": 40, "loss": 2.5, "samples_per_s": 1234.0, "step_time_s": 2.0})
    log.close()
    line = capsys.readouterr().out.strip()
    assert line == "step 40/100 loss 2.5 1,234 samples/s eta 0:02:00"


def test_a_checkpoint_record_leaves_the_bar_showing_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("fsdpclip.train.metrics.live_progress", lambda console, environ: True)
    log = MetricsLog(tmp_path, total_steps=100, tensorboard=False, enabled=True)
    log.write({"step": 40, "loss": 2.5, "samples_per_s": 1234.0, "step_time_s": 2.0})
    log.write({"step": 40, "checkpoint": "step-00000040", "checkpoint_blocked_s": 0.7})
    [task] = log.progress.tasks
    log.close()
    assert task.description == "loss 2.5" and task.fields["rate"] == "1,234 samples/s"
    assert "step 40 checkpoint_blocked_s 0.7" in capsys.readouterr().out  # said once, above the bar


@pytest.mark.parametrize("width", [80, 200])
def test_the_bar_keeps_the_step_rate_and_time_left_at_any_width(tmp_path, monkeypatch, width):
    """On a terminal of 80 columns the bar shows step of total, samples/s and time left whole, and as much of the
    log line as fits; of 200, all of it."""
    monkeypatch.setattr("fsdpclip.train.metrics.live_progress", lambda console, environ: True)
    log = MetricsLog(tmp_path, total_steps=330, tensorboard=False, enabled=True)
    log.advance(186)
    log.write({"step": 186, "loss": 2.741, "lr": 0.0005, "samples_per_s": 1234.0, "samples_per_s_per_gpu": 617.0,
               "mfu": 0.0012, "peak_memory_gib": 0.8123})
    screen = Console(file=io.StringIO(), width=width)
    screen.print(log.progress.get_renderable())
    log.close()
    [line] = screen.file.getvalue().splitlines()
    assert re.match(r"train ━+.* 186/330 1,234 samples/s (-:--:--|\d+:\d\d:\d\d) loss 2.741 lr ", line), line
    assert line.endswith("…" if width == 80 else "peak_memory_gib 0.8123"), line


def test_a_data_bound_window_is_said_with_its_rate_and_the_fixes(tmp_path, capsys):
    """A log window whose step waited for its batches over 10% of its time shows the wait on its line, and the
    first such window after the start-up's (then every NOTICE_EVERY-th) says so with the rate the data supplies, the step's own and
    the fixes that apply; a window that waited less says nothing."""
    log = MetricsLog(tmp_path, total_steps=100, tensorboard=False, enabled=True, data_hints=("more data workers",))
    record = {"loss": 2.5, "samples_per_s": 1500.0, "samples_per_s_per_gpu": 1500.0, "step_time_s": 0.2}
    log.write({"step": 5, **record, "data_wait_fraction": 0.9, "time_to_first_step_s": 30.0})  # the start-up's
    for step, wait in ((10, 0.79), (20, 0.05), (30, 0.5)):
        log.write({"step": step, **record, "data_wait_fraction": wait})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    notices = [line for line in lines if line.startswith("data-bound")]
    assert notices == ["data-bound: the step waited for its batches 79% of the time: the data supplies ~1,500 "
                       "samples/s per GPU, the step alone would take ~7,143 (to feed it: more data workers)"]
    steps = [line for line in lines if line.startswith("step ")][1:]
    assert "data wait 79%" in steps[0] and "data wait" not in steps[1] and "data wait 50%" in steps[2]


def test_the_webdataset_sources_fixes_for_a_waiting_step():
    """More workers where they are written below the rank's cores, the device's resize where the workers also
    resize, and smaller images (fsdpclip data resize) always."""
    source = DATA_SOURCES["webdataset"]
    spec = WebDatasetSpec(urls="s-{0..99}.tar", samples=100, workers=4, decode="cpu")
    hints = source.waiting_hints(spec, world_size=1, local_ranks=1, cores=16)
    assert [hint.split(" (")[0] for hint in hints] == ["data.workers 'auto'", "data.decode 'auto'",
                                                        "shards of smaller images: fsdpclip data resize SHARDS OUT --size N"]
    settled = source.waiting_hints(spec.model_copy(update={"workers": "auto", "decode": "auto"}), 1, 1, 16)
    assert [hint.split(":")[0] for hint in settled] == ["shards of smaller images"]
    assert source.waiting_hints(spec.model_copy(update={"workers": 15}), 1, 1, 16)[0].startswith("data.decode")


def test_validate_weighs_every_ranks_workers_against_the_cores(cli, tiny_job, tmp_path, monkeypatch):
    monkeypatch.setattr("fsdpclip.validate.checks.usable_cores", lambda: 4)
    job = {**tiny_job, "data": {**tiny_job["data"], "workers": 3}}
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert code == 0, out["errors"]
    [warning] = [w for w in out["warnings"] if w["location"] == "data.workers"]
    assert "3 workers × 2 ranks per node = 6" in warning["message"] and "at most 2 per rank" in warning["hint"]
    code, out = cli.validate_json(write_job(tmp_path, job), "--no-check-paths")  # another machine's cores
    assert not [w for w in out["warnings"] if w["location"] == "data.workers"]


@pytest.mark.slow
def test_the_launch_output_holds_no_banner_or_warning_a_user_cannot_act_on(digits_dir, tmp_path):
    """The tiny CPU job, without OMP_NUM_THREADS, with more data workers per rank than the machine has cores:
    no torchrun banner, no FutureWarning from OpenCLIP's losses, no DataLoader warning from the ranks."""
    from ranks import run_group

    overrides = {"run.output_dir": str(tmp_path / "runs"), "schedule": json.dumps({"warmup_steps": 1, "steps": 4}),
                 "data.urls": str(digits_dir / "train-{000000..000007}.tar"), "data.workers": str(usable_cores() + 1),
                 "data.shuffle_buffer": "10", "eval": "{}", "logging.every_steps": "2", "checkpoint.every_steps": "null",
                 "launch.collective_timeout_s": "60"}
    command = [sys.executable, "-m", "fsdpclip", "launch", str(REPO / "examples" / "tiny-cpu.json")]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    proc = run_group(command, timeout=300, unset=("OMP_NUM_THREADS",))
    assert proc.returncode == 0, proc.stdout[-5000:]
    for noise in ("OMP_NUM_THREADS", "Warning", "warnings.warn", "worker processes in total"):
        assert noise not in proc.stdout, proc.stdout
    assert "step 4/4 loss" in proc.stdout  # plain lines in a pipe
