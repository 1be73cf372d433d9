"""The demo job (examples/tiny-cpu.json) through `fsdpclip launch`, shortened to 40 steps (conftest), and what its
launch prints to do next."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import REPO, printed_commands, run_printed


@pytest.mark.slow
def test_demo_job_learns_digits(demo_run):
    run_dir, output = demo_run
    accuracy = float(re.findall(r"step 40 zero-shot digits: acc1 ([0-9.]+)", output)[-1])
    assert accuracy > 0.3  # chance is 0.1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert train[-1]["step"] == 40 and train[-1]["loss"] < train[0]["loss"]
    assert abs([r for r in records if "zeroshot/digits" in r][-1]["zeroshot/digits"]["acc1"] - accuracy) < 1e-3
    assert [r["step"] for r in records if "zeroshot/digits" in r] == [20, 40]  # eval.every_steps and at_end
    for key in ("samples_per_s", "samples_per_s_per_gpu", "data_wait_fraction", "peak_memory_gib", "lr",
                "logit_scale", "samples_seen"):
        assert key in train[-1]
    # start-up: each phase ends after the one before it, the last with the first step
    phases = train[0]["startup_s"]
    assert list(phases) == ["process", "imports", "distributed", "trainer_imported", "meta_model", "initial_weights",
                            "parallelized", "model", "ready", "first_batch", "first_step"]
    assert list(phases.values()) == sorted(phases.values()) and phases["process"] >= 0
    assert abs(phases["first_step"] - train[0]["time_to_first_step_s"]) < 0.05
    assert "start-up, seconds since launch" in output and "startup_s" not in train[1]
    # MFU from the FLOPs per sample the last rank counted and sent to rank 0
    from fsdpclip.model.build import model_config, training_flops_per_sample
    from fsdpclip.model.trainable import frozen_meta_model
    from fsdpclip.jobspec.jobfile import load_job

    job = load_job(run_dir / "job.json")
    flops = training_flops_per_sample(frozen_meta_model(model_config(job.model), job)[0])
    for record in train:
        assert abs(record["mfu"] - record["samples_per_s_per_gpu"] * flops / 1e12) <= 1e-9 * record["mfu"]


def test_the_demo_validates_on_two_cores_without_a_warning(cli, digits_dir, tmp_path, monkeypatch):
    """examples/tiny-cpu.json where the README's `make demo` lies (data/digits beside examples/), on 2 cores: its
    data workers are left to the cores, so validate (and launch, which runs it) warns of nothing."""
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "digits").symlink_to(digits_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("fsdpclip.validate.checks.usable_cores", lambda: 2)
    code, out = cli.validate_json(Path("examples/tiny-cpu.json"))
    assert code == 0 and out["warnings"] == [], out


@pytest.mark.slow
def test_every_command_a_finished_launch_prints_runs_as_printed(demo_run, cli, tmp_path, monkeypatch):
    """The demo launch's `next:` commands (its report, its zero-shot set evaluated again, its export into the current
    folder) exit 0 as printed; the digits' evaluation says nothing of class names."""
    _, output = demo_run
    commands = printed_commands(output)["next"]
    assert [command[1] for command in commands] == ["report", "eval", "export"], output[-2000:]
    monkeypatch.chdir(tmp_path)
    for command in commands:
        code, printed = run_printed(command, cli)
        assert code == 0, (command, printed[-3000:])
        assert "class names" not in printed
    assert (tmp_path / "tiny-cpu.safetensors").is_file() and (tmp_path / "tiny-clip.json").is_file()
