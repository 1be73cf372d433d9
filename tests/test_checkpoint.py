"""Sharded checkpoints: exact resume, other world sizes, preemption, bad steps, crashes, export."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from conftest import TINY_CONFIG, squeezed, write_job
from ranks import run_group, torchrun
from fsdpclip.checkpoint import complete_checkpoints, latest_checkpoint

STEPS = 12


def _job(tmp_path, digits_dir, name: str, synthetic: bool = False, **extra) -> dict:
    """A tiny 2-rank job on the digits shards (or, where the data position does not matter, on
    the faster synthetic source)."""
    job = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32"},
        "optimizer": {"lr": 1e-3},
        "schedule": {"warmup_steps": 2, "steps": STEPS},
        "data": {"urls": str(digits_dir / "train-{000000..000007}.tar"), "samples": 1438, "workers": 2,
                 "shuffle_buffer": 50},
        "batch": {"per_gpu": 16},
        "checkpoint": {"every_steps": 4, "keep": 2},
        "logging": {"every_steps": 1},
        "launch": {"gpus_per_node": 2, "device": "cpu", "collective_timeout_s": 60},
    }
    if synthetic:
        job["data"] = {"source": "synthetic"}
    for key, value in extra.items():
        job[key] = {**job.get(key, {}), **value}
    return job


def _plain_job(tmp_path, **extra) -> dict:
    """A tiny 2-rank fp32 job on synthetic data that ends with a checkpoint."""
    job = {
        "run": {"name": "parity", "output_dir": str(tmp_path / "runs"), "seed": 7},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32", "reduce_dtype": "fp32"},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.2, "grad_clip_norm": 1.0},
        "schedule": {"kind": "cosine", "warmup_steps": 2, "steps": 6},
        "data": {"source": "synthetic"},
        "batch": {"per_gpu": 8},
        "launch": {"gpus_per_node": 2, "device": "cpu", "collective_timeout_s": 60},
    }
    job.update(extra)
    return job


def _launch(path, *extra: str):
    return run_group([sys.executable, "-m", "fsdpclip", "launch", str(path), *extra], timeout=300)


def _with_fault(path, fault: str, nproc: int = 2):
    return torchrun(["tests/workers/faults.py", str(path), fault], nproc=nproc, timeout=300)


def _losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, digits_dir):
    """A run of STEPS steps in one go (and its spec), shared by the resume tests."""
    tmp = tmp_path_factory.mktemp("straight")
    path = write_job(tmp, _job(tmp, digits_dir, "straight"))
    proc = _launch(path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return tmp / "runs" / "straight"


def test_preempted_run_resumes_exactly(tmp_path, digits_dir, straight):
    path = write_job(tmp_path, _job(tmp_path, digits_dir, "split", checkpoint={"keep": 3}))
    first = _with_fault(path, "signal:1:5")  # SIGUSR1 on rank 1 only
    run_dir = tmp_path / "runs" / "split"
    report = json.loads((run_dir / "exit.json").read_text())
    assert report["code"] == 75, first.stdout[-4000:]
    assert "SIGUSR1 received" in report["message"] and "step-00000010" in report["message"]
    assert latest_checkpoint(run_dir).name == "step-00000010"  # the ranks agree every 10 steps
    shutil.copytree(run_dir, tmp_path / "copy")
    # Same run directory: resumes from `latest`, which rank 0 chooses for all: rank 1 sees a stale one.
    second = _with_fault(path, "stale-latest:1:8")
    assert second.returncode == 0, second.stdout[-4000:]
    assert "resumed from" in second.stdout and "step-00000010" in second.stdout
    got, want = _losses(run_dir), _losses(straight)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], abs=1e-5), step

    # The same checkpoint on one rank (global batch kept): loads and finishes.
    one = json.loads(path.read_text())
    one["run"]["output_dir"] = str(tmp_path / "one")
    (tmp_path / "one").mkdir()
    shutil.copytree(tmp_path / "copy", tmp_path / "one" / "split")
    one_path = write_job(tmp_path, one, "one.json")
    third = _launch(one_path, "--nproc-per-node", "1", "--set", "batch.per_gpu=32")
    assert third.returncode == 0, third.stdout[-4000:]
    assert "saved by 2 ranks, this run has 1" in third.stdout
    resumed = _losses(tmp_path / "one" / "split")
    assert max(resumed) == STEPS and all(torch.isfinite(torch.tensor(v)) for v in resumed.values())


def test_one_rank_checkpoint_resumes_on_two(tmp_path, digits_dir):
    path = write_job(tmp_path, _job(tmp_path, digits_dir, "grow", batch={"per_gpu": 32},
                                    launch={"gpus_per_node": 1}))
    first = _with_fault(path, "signal:0:3", nproc=1)
    run_dir = tmp_path / "runs" / "grow"
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 75, first.stdout[-4000:]
    second = _launch(path, "--nproc-per-node", "2", "--set", "batch.per_gpu=16")
    assert second.returncode == 0, second.stdout[-4000:]
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, digits_dir):
    path = write_job(tmp_path, _job(tmp_path, digits_dir, "crash", synthetic=True))
    crashed = _with_fault(path, "crash-save:1:2")  # dies in its second save (step 8)
    assert crashed.returncode != 0
    run_dir = tmp_path / "runs" / "crash"
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-00000004"]
    assert latest_checkpoint(run_dir).name == "step-00000004"
    assert (run_dir / "checkpoints" / "step-00000008.partial").is_dir()
    resumed = _launch(path)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "resumed from" in resumed.stdout and "step-00000004" in resumed.stdout
    assert not list((run_dir / "checkpoints").glob("*.partial"))
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-00000008", "step-00000012"]


def test_non_finite_step_is_skipped(tmp_path, digits_dir):
    path = write_job(tmp_path, _job(tmp_path, digits_dir, "skip", synthetic=True, schedule={"steps": 6}))
    proc = _with_fault(path, "nan:3")
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["skipped_steps"] == 1 and records[-1]["step"] == 6
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if r["step"] != 3)


def test_non_finite_step_stops_with_last_checkpoint(tmp_path, digits_dir):
    path = write_job(tmp_path, _job(tmp_path, digits_dir, "stop", synthetic=True, optimizer={"on_nonfinite": "stop"}))
    proc = _with_fault(path, "nan:6")
    run_dir = tmp_path / "runs" / "stop"
    report = json.loads((run_dir / "exit.json").read_text())
    assert report["code"] == 65, proc.stdout[-4000:]
    assert "step 6" in report["message"] and str(run_dir / "checkpoints" / "step-00000004") in report["message"]
    assert latest_checkpoint(run_dir).name == "step-00000004"


@pytest.fixture(scope="module")
def trained_for_export(tmp_path_factory):
    """A checkpointed 2-rank run and the encodings of its sharded model."""
    tmp = tmp_path_factory.mktemp("export")
    out = tmp / "trained.json"
    proc = torchrun(["tests/workers/train_checks.py", "export", str(out), str(write_job(tmp, _plain_job(tmp)))])
    assert proc.returncode == 0, proc.stdout[-4000:]
    return tmp / "runs" / "parity", json.loads(out.read_text())


@pytest.mark.parametrize("target", ["model.pt", "model.safetensors", "local-dir"])
def test_export_loads_in_open_clip(tmp_path, target, cli, trained_for_export):
    import open_clip

    run_dir, trained = trained_for_export
    exported = tmp_path / target
    result = cli("export", run_dir, exported)
    assert result.exit_code == 0, result.output
    if target == "local-dir":
        model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{exported}")
    else:
        open_clip.add_model_config(TINY_CONFIG)
        model, _, _ = open_clip.create_model_and_transforms(TINY_CONFIG.stem, pretrained=str(exported))
    assert model.logit_scale.shape == ()
    torch.manual_seed(123)
    images = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        model.eval()
        assert torch.allclose(model.encode_image(images), torch.tensor(trained["encode_image"]), atol=1e-5)
        texts = torch.randint(1, 1000, (3, 16))
        assert torch.allclose(model.encode_text(texts), torch.tensor(trained["encode_text"]), atol=1e-5)
    if target == "model.pt":
        _starts_from(exported, model.state_dict(), tmp_path)


def _starts_from(exported, weights: dict, tmp_path) -> None:
    """A new run's initial model from `model.pretrained` (the whole exported file) is those weights; from
    `model.image.pretrained` / `model.text.pretrained` (keys relative to the tower) only that tower's."""
    from fsdpclip.spec import ModelSpec
    from fsdpclip.weights import initial_model

    def state(**spec) -> dict:
        return {k: v.reshape(weights[k].shape) for k, v in
                initial_model(ModelSpec(config=str(TINY_CONFIG), **spec), seed=1).state_dict().items()}

    assert all(torch.equal(v, weights[k]) for k, v in state(pretrained=str(exported)).items())
    fresh = state()
    image = {k.removeprefix("visual."): v for k, v in weights.items() if k.startswith("visual.")}
    text = {k: v for k, v in weights.items() if not k.startswith("visual.") and not k.startswith("logit_")}
    torch.save(image, tmp_path / "image.pt")
    torch.save(text, tmp_path / "text.pt")
    for tower, part in (("image", state(image={"pretrained": str(tmp_path / "image.pt")})),
                        ("text", state(text={"pretrained": str(tmp_path / "text.pt")}))):
        for key, value in part.items():
            loaded = key.startswith("visual.") == (tower == "image") and not key.startswith("logit_")
            assert torch.equal(value, weights[key] if loaded else fresh[key]), (tower, key)


def test_export_rejects_what_is_not_a_checkpoint(tmp_path, cli):
    result = cli("export", tmp_path, tmp_path / "out.pt")
    assert result.exit_code == 2
    assert squeezed("neither a complete checkpoint") in squeezed(result.output)


def test_launch_exits_with_the_trainers_code_on_divergence(tmp_path):
    """A real divergence (absurd LR) stops the run; `fsdpclip launch` returns the documented 65."""
    job = _plain_job(tmp_path, optimizer={"lr": 1e12, "on_nonfinite": "stop"},
                      schedule={"kind": "constant", "steps": 20})
    proc = _launch(write_job(tmp_path, job))
    assert proc.returncode == 65, proc.stdout[-4000:]
    assert "is not finite" not in proc.stdout  # stopped, not skipped
    assert "stopped; the last good checkpoint is none" in proc.stdout


def test_asynchronous_saves_complete_and_resume(tmp_path):
    job = _plain_job(tmp_path, checkpoint={"every_steps": 2, "keep": 2, "async_save": True},
                      schedule={"kind": "constant", "steps": 6})
    path = write_job(tmp_path, job)
    assert _launch(path).returncode == 0
    run_dir = tmp_path / "runs" / "parity"
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-00000004", "step-00000006"]
    again = _launch(path, "--set", "schedule.steps=8")
    assert again.returncode == 0, again.stdout[-4000:]
    assert "resumed from" in again.stdout and "at step 6" in again.stdout
    assert latest_checkpoint(run_dir).name == "step-00000008"
