"""The seams of eval.tasks and launch.launcher: a launcher backend and an eval task registered from outside the package (here, this test
module) are flags of `fsdpclip launch` and `fsdpclip eval`, dispatched to as the built-in ones are."""

from __future__ import annotations

import json
import shlex

import pytest

from conftest import TINY_CONFIG, write_job
from fsdpclip.eval import tasks
from fsdpclip.eval.tasks import EvalTask, register_task
from fsdpclip.launch import launcher
from fsdpclip.launch.launcher import LaunchError, LauncherBackend, register_backend
from fsdpclip.spec.job import Section


class ScriptBackend(LauncherBackend):
    """Writes this node's torchrun command into a shell script and starts nothing."""

    name = "script"
    help = "Write the torchrun command into FILE and start nothing."
    metavar = "FILE"

    def check_flags(self) -> None:
        if self.flags.node_rank is not None:
            raise LaunchError("--script writes one node's script: no --node-rank")

    def start(self, job, console):
        from pathlib import Path

        from fsdpclip.launch.local import node_torchrun

        script = Path(self.flags.backend_value)
        script.write_text("#!/bin/sh\n" + shlex.join(node_torchrun(job, self.flags)) + "\n")
        console.print(f"wrote {script}", highlight=False, soft_wrap=True)


class NormSpec(Section):
    path: str

    @property
    def label(self) -> str:
        return "norm"


class LogitScaleTask(EvalTask):
    """The model's temperature as a 'result': no data read, every rank measures the same."""

    kind = "scale"
    task = "logit_scale"
    title = "logit scale"
    spec = NormSpec
    flag_help = "Report the model's logit scale (VALUE: any name)."
    usage = "--scale NAME (the logit scale)"
    panel = "logit scale"

    def spec_from_flags(self, value, data, classnames, templates, max_samples):
        if data is not None:
            raise ValueError("--scale reads no data")
        return NormSpec(path=value)

    def load(self, spec, transform):
        from types import SimpleNamespace

        return SimpleNamespace(name=spec.path, kind=self.kind, size=1)

    def measure(self, model, tokenizer, dataset, device, batch_size, workers=2, progress=None):
        progress(1)
        return {"scale": model.logit_scale.exp().item(), "samples": 1}

    def line(self, name, values):
        return f"logit scale {name}: {values['scale']:.2f}"

    def curves(self, name, values):
        return {name: values["scale"]}


@pytest.fixture
def registered(monkeypatch):
    """The two seams' registries with the test's backend and task added, as they were after the test."""
    monkeypatch.setattr(launcher, "BACKENDS", dict(launcher.backends()))
    monkeypatch.setattr(tasks, "TASKS", dict(tasks.eval_tasks()))
    register_backend(ScriptBackend)
    register_task(LogitScaleTask)


def test_a_registered_launcher_backend_is_a_flag_of_launch(registered, tiny_job, tmp_path, cli):
    job = write_job(tmp_path, tiny_job)
    assert "--script FILE" in cli("launch", "--help").output
    script = tmp_path / "start.sh"
    result = cli("launch", job, "--script", script, "--no-check-paths")
    assert result.exit_code == 0, result.output
    assert f"wrote {script}" in result.output
    assert "-m fsdpclip.launch.torchrun --nproc-per-node=2 --standalone -m fsdpclip.train.entry" in script.read_text()
    assert str(tmp_path / "runs" / "t" / "job.json") in script.read_text()

    refused = cli("launch", job, "--script", script, "--node-rank", "0", "--master-addr", "h")
    assert refused.exit_code == 2 and "--script writes one node's script: no --node-rank" in refused.output
    both = cli("launch", job, "--script", script, "--slurm", "--dry-run")
    assert both.exit_code == 2 and "give one of --slurm, --script, not several" in both.output


def test_a_registered_eval_task_is_a_flag_of_eval(registered, tmp_path, digits_dir, cli):
    import open_clip
    import torch

    open_clip.add_model_config(TINY_CONFIG)
    model = open_clip.create_model(TINY_CONFIG.stem)
    weights = tmp_path / "tiny.pt"
    torch.save(model.state_dict(), weights)
    out = tmp_path / "scale.json"
    result = cli("eval", weights, "--model-config", TINY_CONFIG, "--scale", "temperature", "--output", out)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["task"] == "logit_scale" and record["dataset"] == "temperature"
    assert record["metrics"] == {"scale": pytest.approx(model.logit_scale.exp().item())}

    usage = cli("eval", weights, "--model-config", TINY_CONFIG)
    assert usage.exit_code == 2
    assert ("give --zeroshot KIND --data DIR (classification), --retrieval DIR (image-text retrieval) or "
            "--scale NAME (the logit scale)") in " ".join(usage.output.split())
    refused = cli("eval", weights, "--scale", "t", "--data", digits_dir)
    assert refused.exit_code == 2 and "--scale reads no data" in refused.output
    assert tasks.result_line("scale/temperature", {"scale": 14.3}) == "logit scale temperature: 14.30"


def test_the_test_seams_are_gone_after_their_test(cli):
    """The registries the fixture replaced are the package's again: no --script, no --scale."""
    assert "--script" not in cli("launch", "--help").output
    assert "--scale" not in cli("eval", "--help").output
