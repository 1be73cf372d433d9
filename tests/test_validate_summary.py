"""What a successful `validate` reports, computed on the meta device."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY_CONFIG, write_job


def _vit_job(model: str, **extra) -> dict:
    job = {"model": {"name": model}, "data": {"source": "synthetic"}, "schedule": {"steps": 100},
           "batch": {"per_gpu": 32}}
    job.update(extra)
    return job


def test_vit_b_32_counts(cli, tmp_path):
    code, out = cli.validate_json(write_job(tmp_path, _vit_job("ViT-B-32")), "--world-size", "8")
    assert code == 0, out
    summary = out["summary"]
    assert summary["parameters"] == {"parameters": 151_277_313, "trainable": 151_277_313, "frozen": 0}
    assert summary["towers"]["image"]["blocks"] == 12 and summary["towers"]["text"]["blocks"] == 12
    # On CUDA, compile 'auto' makes each tower's block container one unit, compiled whole, as the trainer
    # will: the estimate counts the units the run builds.
    units = {(u["tower"], u["class"]): u for u in summary["fsdp_units"]}
    assert units[("image", "Transformer")]["count"] == 1 and units[("image", "Transformer")]["modules_each"] == 1
    assert units[("image", "Transformer")]["parameters_each"] == 12 * 7_087_872
    total = sum(u["count"] * u["parameters_each"] for u in summary["fsdp_units"])
    assert total == 151_277_313
    # Without compile, 'auto' units hold up to ~400M parameters: all 12 blocks (7,087,872 each) of a tower in one
    code, out = cli.validate_json(write_job(tmp_path, _vit_job("ViT-B-32", fsdp={"compile": False})), "--world-size", "8")
    assert code == 0, out
    units = {(u["tower"], u["class"]): u for u in out["summary"]["fsdp_units"]}
    assert units[("image", "ResidualAttentionBlock")]["count"] == 1
    assert units[("image", "ResidualAttentionBlock")]["modules_each"] == 12
    assert units[("image", "ResidualAttentionBlock")]["parameters_each"] == 12 * 7_087_872
    assert out["summary"]["mesh"]["traffic_gib_per_step"]["all_gather"] > \
        summary["mesh"]["traffic_gib_per_step"]["all_gather"]  # resharded blocks gather again in backward
    assert summary["batch"]["global"] == 256


def test_blocks_grouped_into_larger_units(cli, tmp_path):
    code, out = cli.validate_json(write_job(tmp_path, _vit_job("ViT-B-32", fsdp={"unit_size": 5})))
    assert code == 0, out
    image = [u for u in out["summary"]["fsdp_units"] if u["tower"] == "image"]
    assert [(u["count"], u["modules_each"]) for u in image] == [(2, 5), (1, 2)]
    assert image[0]["parameters_each"] == 5 * 7_087_872
    total = sum(u["count"] * u["parameters_each"] for u in out["summary"]["fsdp_units"])
    assert total == 151_277_313


def test_freeze_ranges_counted(cli, tmp_path):
    job = _vit_job("ViT-B-32", freeze={"image": {"blocks": "0:-1", "embeddings": True},
                                       "text": {"blocks": ":", "embeddings": True, "head": True},
                                       "logit_scale": True})
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert code == 0, out
    image, text = out["summary"]["towers"]["image"], out["summary"]["towers"]["text"]
    # Last block (7,087,872) + ln_post (2 × 768) + proj (768 × 512) stay trainable.
    assert image["trainable"] == 7_087_872 + 2 * 768 + 768 * 512
    assert text["trainable"] == 0
    assert out["summary"]["towers"]["shared"]["trainable"] == 0


def test_default_decay_rules_on_open_clip_names(cli, tmp_path):
    """The default rules leave out of weight decay what open_clip_train's main.py leaves out."""
    import open_clip

    code, out = cli.validate_json(write_job(tmp_path, _vit_job("ViT-B-32")))
    with torch.device("meta"):
        model = open_clip.create_model("ViT-B-32", device="meta")
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n  # noqa: E731
    excluded = sum(p.numel() for n, p in model.named_parameters() if exclude(n, p))
    groups = out["summary"]["decay_groups"]
    assert sum(g["parameters"] for g in groups if g["weight_decay"] == 0) == excluded
    assert sum(g["parameters"] for g in groups) == 151_277_313
    assert [g["weight_decay"] for g in groups if g["rule"] == "default"] == [0.2]


def test_memory_estimate_shrinks_with_world_size(cli, tmp_path):
    path = write_job(tmp_path, _vit_job("ViT-L-14"))
    small = cli.validate_json(path, "--world-size", "2")[1]["summary"]["memory_gib"]
    large = cli.validate_json(path, "--world-size", "64")[1]["summary"]["memory_gib"]
    assert large["optimizer"] < small["optimizer"] / 16
    assert large["activations"] == pytest.approx(small["activations"], rel=0.05)
    offloaded = cli.validate_json(path, "--world-size", "2", "--set", "fsdp.cpu_offload=true")[1]
    assert offloaded["summary"]["memory_gib"]["optimizer"] == 0
    assert offloaded["summary"]["memory_gib"]["host"] > 0


def test_activation_checkpointing_lowers_the_estimate(cli, tmp_path):
    path = write_job(tmp_path, _vit_job("ViT-L-14"))
    plain = cli.validate_json(path)[1]["summary"]["memory_gib"]["activations"]
    ckpt = cli.validate_json(path, "--set", 'fsdp.activation_checkpointing={"image": ["ResidualAttentionBlock"]}')
    assert ckpt[1]["summary"]["memory_gib"]["activations"] < plain / 2


def test_accumulation_in_the_estimate(cli, tmp_path):
    """grad_accum 4 × 32 against 128 × 1: activations of one 32-sample micro batch, but all 128 samples'
    inputs held on the device (224² fp32 pixels and 77 int64 tokens each), their 512-d image and text
    features cached, and every micro batch's logits against the whole batch."""
    path = write_job(tmp_path, _vit_job("ViT-B-32"))
    whole = cli.validate_json(path, "--set", "batch.per_gpu=128")[1]["summary"]["memory_gib"]
    accumulated = cli.validate_json(path, "--set", "batch.grad_accum=4")[1]["summary"]["memory_gib"]
    per_sample = (3 * 224 * 224 * 4 + 77 * 8) / 2 ** 30
    assert whole["inputs"] == pytest.approx(128 * per_sample, abs=1e-3)
    assert accumulated["inputs"] == pytest.approx(128 * (per_sample + 2 * 512 * 4 / 2 ** 30), abs=1e-3)
    assert accumulated["activations"] < whole["activations"] / 3


def test_memory_limit_warns(cli, tmp_path):
    job = _vit_job("ViT-L-14", launch={"gpu_memory_gib": 1})
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert code == 0
    assert out["warnings"][0]["location"] == "launch.gpu_memory_gib"


@pytest.mark.parametrize("model", ["ViT-bigG-14", "EVA02-E-14"])
def test_huge_models_at_world_size_1024(cli, tmp_path, model):
    code, out = cli.validate_json(write_job(tmp_path, _vit_job(model)), "--world-size", "1024")
    assert code == 0, out
    assert out["summary"]["parameters"]["parameters"] > 2_500_000_000
    assert out["summary"]["memory_gib"]["parameters"] < 0.1


def test_minimal_spec_validates(cli, tmp_path, digits_dir):
    job = {"model": {"name": "ViT-B-32"},
           "data": {"urls": str(digits_dir / "train-{000000..000007}.tar"), "samples": 1438, "workers": 1},
           "batch": {"per_gpu": 4}}
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert code == 0, out


def test_host_memory_of_the_first_node(cli, tmp_path, monkeypatch):
    """The host memory the first node needs: 2 GiB per rank process, the ranks' offloaded fp32 state (parameters,
    gradients and AdamW's two moments: 16 bytes a parameter, over all its ranks) and the whole fp32 model the first
    rank builds the initial weights in. Over launch.host_memory_gib it is an error; over this machine's memory a
    warning in validate (the nodes may be other machines) and an error in a launch here."""
    path = write_job(tmp_path, _vit_job("ViT-B-32", fsdp={"cpu_offload": True}, launch={"gpus_per_node": 8}))
    code, out = cli.validate_json(path, "--set", "launch.host_memory_gib=512")
    assert code == 0, out
    host, parameters = out["summary"]["host_memory_gib"], out["summary"]["parameters"]["parameters"]
    assert host["ranks"] == 8 and host["processes"] == 16
    assert host["offloaded_state"] == pytest.approx(16 * parameters / 2 ** 30, rel=0.01)
    assert host["initial_weights"] == pytest.approx(4 * parameters / 2 ** 30, rel=0.001)
    assert host["total"] == pytest.approx(host["processes"] + host["offloaded_state"] + host["initial_weights"], abs=0.01)

    code, out = cli.validate_json(path, "--set", "launch.host_memory_gib=16")
    assert code == 2
    [error] = [e for e in out["errors"] if e["location"] == "launch.host_memory_gib"]
    assert f"{host['total']:.1f} GiB" in error["message"] and "exceeds launch.host_memory_gib 16.0 GiB" in error["message"]

    monkeypatch.setattr("fsdpclip.validate.summary.host_memory", lambda: 16 * 2 ** 30)
    code, out = cli.validate_json(path)
    assert code == 0
    [warning] = [w for w in out["warnings"] if w["location"] == "fsdp.cpu_offload"]
    assert "this machine's memory 16.0 GiB" in warning["message"] and "launch.host_memory_gib" in warning["hint"]
    assert not [w for w in cli.validate_json(path, "--no-check-paths")[1]["warnings"] if "host" in w["message"]]
    launched = cli("launch", path)
    assert launched.exit_code == 2 and "this machine's memory 16.0 GiB" in " ".join((launched.stdout + launched.stderr).split())
    code, out = cli.validate_json(path, "--set", "fsdp.cpu_offload=false")  # 8 processes and the initial weights
    assert [w["location"] for w in out["warnings"]] == ["launch.gpus_per_node"]
    assert out["summary"]["host_memory_gib"]["offloaded_state"] == 0


def test_the_moving_average_and_the_host_copy_in_the_estimates(cli, tmp_path):
    """An `ema` block adds its fp32 averages of the trained shards to each GPU's estimate and its peak: 4 bytes a
    trainable parameter over the shard degree (ViT-B-32's text tower and temperature here, the image tower frozen;
    on the host with CPU offload). Asynchronous saves (checkpoint.async_save true, with periodic saves) add each
    rank's host copy to the first node's host memory: its fp32 shards, AdamW's two moments and the averages."""
    frozen = {"image": {"blocks": ":", "embeddings": True, "head": True}}
    path = write_job(tmp_path, _vit_job("ViT-B-32", freeze=frozen, launch={"gpus_per_node": 8}))
    ema = 'ema={"decay": 0.9999}'
    plain = cli.validate_json(path)[1]["summary"]
    averaged = cli.validate_json(path, "--set", ema)[1]["summary"]
    parameters, trainable = plain["parameters"]["parameters"], plain["parameters"]["trainable"]
    assert 0 < trainable < parameters / 2
    before, after = plain["memory_gib"], averaged["memory_gib"]
    assert before["ema"] == 0 and after["ema"] == pytest.approx(4 * trainable / 8 / 2 ** 30, abs=0.001)
    assert after["total"] == pytest.approx(before["total"] + after["ema"], abs=0.002)
    assert {k: v for k, v in after.items() if k not in ("ema", "total")} == \
        {k: v for k, v in before.items() if k not in ("ema", "total")}
    offloaded = cli.validate_json(path, "--set", ema, "--set", "fsdp.cpu_offload=true")[1]["summary"]["memory_gib"]
    assert offloaded["ema"] == 0 and offloaded["host"] == pytest.approx(16 * trainable / 8 / 2 ** 30 + before[
        "parameters"], abs=0.002)

    saves = '--set=checkpoint={"every_steps": 100, "async_save": true}'
    host = cli.validate_json(path, "--set", ema, saves)[1]["summary"]["host_memory_gib"]
    assert plain["host_memory_gib"]["checkpoint_staging"] == averaged["host_memory_gib"]["checkpoint_staging"] == 0
    assert host["checkpoint_staging"] == pytest.approx((4 * parameters + 12 * trainable) / 2 ** 30, rel=0.01)
    assert host["total"] == pytest.approx(averaged["host_memory_gib"]["total"] + host["checkpoint_staging"], abs=0.01)
    unsaved = cli.validate_json(path, "--set", ema, "--set", 'checkpoint={"async_save": true}')[1]
    assert unsaved["summary"]["host_memory_gib"]["checkpoint_staging"] == 0  # no periodic save: none in the background


def test_the_data_workers_and_the_rate_the_gpus_ask_of_them(cli, tmp_path, monkeypatch):
    """validate's summary: the workers a rank starts (data.workers 'auto' settled for this machine's cores and the
    ranks of a node) and, on CUDA, the samples/s each GPU asks of them at the plan's step time (its sustained rate
    over the FLOPs of a sample); none asked on the CPU, and no workers for synthetic data."""
    monkeypatch.setattr("fsdpclip.validate.summary.usable_cores", lambda: 16)
    data = {"urls": "/data/{000..099}.tar", "samples": 10 ** 6}
    code, out = cli.validate_json(write_job(tmp_path, _vit_job("ViT-B-32", data=data)), "--no-check-paths")
    assert code == 0, out
    supply = out["summary"]["supply"]
    assert supply["workers"] == 15 and supply["auto"] and supply["cores"] == 16
    flops = 3 * 2 * (4.41e9 + 2.95e9)  # ViT-B-32's forward: image ~4.4, text ~2.9 GFLOP a sample
    assert supply["asked_per_gpu"] == pytest.approx(315e12 / flops, rel=0.05)
    cpu = _vit_job("ViT-B-32", data={**data, "workers": 3}, launch={"device": "cpu"})
    supply = cli.validate_json(write_job(tmp_path, cpu), "--no-check-paths")[1]["summary"]["supply"]
    assert supply["workers"] == 3 and not supply["auto"] and supply["asked_per_gpu"] is None
    assert cli.validate_json(write_job(tmp_path, _vit_job("ViT-B-32")))[1]["summary"]["supply"] is None


def test_the_runs_duration_at_the_plans_step_time(cli, tmp_path):
    """On GPUs the summary gives the run's expected duration: its steps at the step time `plan` gives the job's shard
    degree, with that basis; on the CPU, none."""
    job = {"model": {"config": str(TINY_CONFIG)}, "data": {"source": "synthetic"}, "schedule": {"steps": 500},
           "batch": {"per_gpu": 32}, "launch": {"gpus_per_node": 2}}
    path = write_job(tmp_path, job)
    code, out = cli.validate_json(path)
    assert code == 0, out
    duration, degree = out["summary"]["duration"], out["summary"]["mesh"]["shard_degree"]
    plan = json.loads(cli("plan", path, "--nodes", "1", "--gpus-per-node", "2", "--json").stdout)
    assert duration["step_s"] == pytest.approx(next(r["step_s"] for r in plan["rows"] if r["degree"] == degree))
    assert duration["steps"] == 500 and duration["seconds"] == pytest.approx(500 * duration["step_s"])
    assert "steps at the plan's" in cli("validate", path).stdout
    assert cli.validate_json(path, "--set", "launch.device=\"cpu\"")[1]["summary"]["duration"] is None
