"""The seams of launching and evaluation: a launcher backend and an eval task written in this one module and
registered by its `register`, the entry point of a plugin (`plugins.install`), are flags of `fsdpclip launch` and
`fsdpclip eval` with their blocks in the spec, dispatched to as the built-in ones are, and the task evaluates during
training, in the processes where the plugin is installed."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from pydantic import Field

from conftest import TINY_CONFIG, synthetic_job, write_job
from fsdpclip.jobspec.task import EVAL_TASKS, EvalTask
from fsdpclip.jobspec.backend import LAUNCHER_BACKENDS, LaunchError, LauncherBackend
from fsdpclip.jobspec.section import Section
from plugins import PluginProcess, install


class ScriptSpec(Section):
    shell: str = Field("/bin/sh", description="The interpreter on the script's first line.")


class ScriptBackend(LauncherBackend):
    """Writes this node's torchrun command into a shell script and starts nothing."""

    name = "script"
    help = "Write the torchrun command into FILE and start nothing."
    metavar = "FILE"
    spec = ScriptSpec
    description = "How `launch --script` writes its script."

    def check_flags(self) -> None:
        if self.flags.node_rank is not None:
            raise LaunchError("--script writes one node's script: no --node-rank")

    def start(self, job, console):
        from pathlib import Path

        from fsdpclip.launch.local import node_torchrun

        script = Path(self.flags.backend_value)
        script.write_text(f"#!{job.launch.script.shell}\n" + shlex.join(node_torchrun(job, self.flags)) + "\n")
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
    description = "The model's logit scale, under each name given."
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
        if progress is not None:
            progress(1)
        return {"scale": model.logit_scale.exp().item(), "samples": 1}

    def line(self, name, values):
        return f"logit scale {name}: {values['scale']:.2f}"

    def curves(self, name, values):
        return {name: values["scale"]}


def register() -> None:
    """The plugin's entry point (`plugins.install`): its backend and task registered."""
    LAUNCHER_BACKENDS.register(ScriptBackend)
    EVAL_TASKS.register(LogitScaleTask())


@pytest.fixture(scope="module")
def plugged(tmp_path_factory):
    """A process where this module is installed as a plugin, for this module's tests."""
    process = PluginProcess(install(tmp_path_factory.mktemp("plugin"), f"{__name__}:register"))
    yield process
    process.close()


def test_a_registered_launcher_backend_is_a_flag_of_launch(plugged, tiny_job, tmp_path):
    job = write_job(tmp_path, tiny_job)
    assert "--script FILE" in plugged("launch", "--help").output
    script = tmp_path / "start.sh"
    result = plugged("launch", job, "--script", script, "--no-check-paths")
    assert result.exit_code == 0, result.output
    assert f"wrote {script}" in result.output
    assert "-m fsdpclip.launch.torchrun --nproc-per-node=2 --standalone -m fsdpclip.launch.entry" in script.read_text()
    assert str(tmp_path / "runs" / "t" / "job.json") in script.read_text()
    assert script.read_text().startswith("#!/bin/sh\n")

    refused = plugged("launch", job, "--script", script, "--node-rank", "0", "--master-addr", "h")
    assert refused.exit_code == 2 and "--script writes one node's script: no --node-rank" in refused.output
    both = plugged("launch", job, "--script", script, "--slurm", "--dry-run")
    assert both.exit_code == 2 and "give one of --slurm, --script, not several" in both.output


def test_a_registered_backend_has_its_block_in_the_spec(plugged, tiny_job, tmp_path):
    launch = {**tiny_job["launch"], "script": {"shell": "/bin/bash"}}
    job = write_job(tmp_path, {**tiny_job, "launch": launch})
    script = tmp_path / "start.sh"
    result = plugged("launch", job, "--script", script, "--no-check-paths")
    assert result.exit_code == 0, result.output
    assert script.read_text().startswith("#!/bin/bash\n")
    code, out = plugged.validate_json(write_job(tmp_path, {**tiny_job, "launch": {**launch, "script": {"shel": "x"}}}))
    assert [(e["location"], e["hint"]) for e in out["errors"]] == [("launch.script.shel", "did you mean 'shell'?")]
    defs = json.loads(plugged("schema").stdout)["$defs"]
    assert defs["LaunchSpec"]["properties"]["script"]["description"] == ScriptBackend.description


def test_a_registered_eval_task_is_a_flag_of_eval(plugged, tmp_path, digits_dir):
    import open_clip
    import torch

    open_clip.add_model_config(TINY_CONFIG)
    model = open_clip.create_model(TINY_CONFIG.stem)
    weights = tmp_path / "tiny.pt"
    torch.save(model.state_dict(), weights)
    out = tmp_path / "scale.json"
    result = plugged("eval", weights, "--model-config", TINY_CONFIG, "--scale", "temperature", "--output", out)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["task"] == "logit_scale" and record["dataset"] == "temperature"
    assert record["metrics"] == {"scale": pytest.approx(model.logit_scale.exp().item())}

    usage = plugged("eval", weights, "--model-config", TINY_CONFIG)
    assert usage.exit_code == 2
    assert ("give --zeroshot KIND --data DIR (classification), --retrieval DIR (image-text retrieval), "
            "--validation SHARDS (contrastive loss) or --scale NAME (the logit scale)") in \
        " ".join(usage.output.split())
    refused = plugged("eval", weights, "--scale", "t", "--data", digits_dir)
    assert refused.exit_code == 2 and "--scale reads no data" in refused.output
    assert plugged.call("fsdpclip.jobspec.task:result_line", "scale/temperature", {"scale": 14.3}) == \
        "logit scale temperature: 14.30"


def test_a_registered_eval_task_has_its_list_in_the_spec(plugged, tmp_path):
    job = synthetic_job(tmp_path)
    code, out = plugged.validate_json(write_job(tmp_path, {**job, "eval": {"scale": [{}], "every_steps": 2}}))
    assert [e["location"] for e in out["errors"]] == ["eval.scale[0].path"]
    code, out = plugged.validate_json(write_job(tmp_path, {**job, "eval": {"every_steps": 2}}))
    assert [(e["location"], e["message"]) for e in out["errors"]] == [
        ("eval.every_steps", ("set, but eval.zeroshot and eval.retrieval and eval.validation and eval.scale list no "
                              "dataset"))]


def test_the_test_seams_are_gone_after_their_test(cli):
    """This process did not install the plugin: no --script, no --scale."""
    assert "--script" not in cli("launch", "--help").output
    assert "--scale" not in cli("eval", "--help").output


@pytest.mark.slow
def test_a_registered_eval_task_runs_during_training(tmp_path):
    """A short CPU run of the rank entry in a process where this module is installed as a plugin: the task's set
    evaluated every step and logged."""
    from ranks import run_group

    job = {**synthetic_job(tmp_path), "eval": {"scale": [{"path": "temperature"}], "every_steps": 1},
           "schedule": {"steps": 2}, "logging": {"every_steps": 1}, "checkpoint": {"at_end": False}}
    path = write_job(tmp_path, job)
    env = install(tmp_path / "plugin", f"{__name__}:register")
    result = run_group([sys.executable, "-m", "fsdpclip", "train", str(path)], timeout=180, env=env)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "step 1 logit scale temperature: 14." in result.stdout
    records = [json.loads(line) for line in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    evaluated = [(r["step"], r["scale/temperature"]["scale"]) for r in records if "scale/temperature" in r]
    assert [step for step, _ in evaluated] == [1, 2]
    assert all(scale == pytest.approx(1 / 0.07, rel=0.01) for _, scale in evaluated), evaluated
