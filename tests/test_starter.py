"""A user's first commands: --version, `models` (architectures and their published tags) and `init`, whose spec
passes `validate` as written."""

from __future__ import annotations

import json

import open_clip

from conftest import squeezed
from fsdpclip.model.published import published_tags


def test_version_names_fsdpclip_openclip_and_torch(cli):
    from fsdpclip import __version__

    result = cli("--version")
    assert result.exit_code == 0
    assert f"fsdpclip {__version__}" in result.output and f"open_clip_torch {open_clip.__version__}" in result.output


def test_models_lists_architectures_and_their_published_tags(cli):
    untagged = next(n for n in open_clip.list_models() if n not in published_tags())
    everything = cli("models").output
    assert untagged in everything and "laion2b_s34b_b79k" in everything.replace("\n", "")
    published = cli("models", "--pretrained").output
    assert untagged not in published
    only = cli("models", "--pretrained", "vit-b-32-quick").output
    assert "ViT-B-32-quickgelu" in only and "metaclip_400m" in only and "ViT-L-14" not in only


def test_init_writes_a_spec_that_validates(cli, tmp_path, digits_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    synthetic = tmp_path / "synthetic.json"
    result = cli("init", synthetic, "--model", "RN50", "--gpus", "0")
    assert result.exit_code == 0, result.output
    assert "Micro batch per GPU" in result.output  # each value with what it means
    code, out = cli.validate_json(synthetic)
    assert code == 0, out["errors"]
    shards = tmp_path / "shards.json"
    result = cli("init", shards, "--model", "RN50", "--gpus", "0", "--data",
                 str(digits_dir / "train-{000000..000007}.tar"), "--samples", "1438", "--per-gpu", "16")
    assert result.exit_code == 0, result.output
    code, out = cli.validate_json(shards)
    assert code == 0, out["errors"]
    spec = json.loads(shards.read_text())
    assert spec["data"]["samples"] == 1438 and spec["launch"]["device"] == "cpu"


def test_init_fine_tunes_published_weights_at_a_lower_rate(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    out = tmp_path / "finetune.json"
    result = cli("init", out, "--model", "RN50-quickgelu", "--pretrained", "openai", "--gpus", "0")
    assert result.exit_code == 0, result.output
    spec = json.loads(out.read_text())
    assert spec["model"]["pretrained"] == "openai" and spec["optimizer"]["lr"] < 1e-4
    code, result = cli.validate_json(out)
    assert code == 0, result["errors"]
    assert not (tmp_path / "hf" / "hub").exists()  # neither init nor validate fetched it


def test_init_refuses_in_one_line(cli, tmp_path):
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    result = cli("init", taken)
    assert result.exit_code == 2 and "--force" in result.output and taken.read_text() == "{}"
    bracketed = tmp_path / "spec[draft].json"
    bracketed.write_text("{}")
    result = cli("init", bracketed)
    assert result.exit_code == 2 and f"{bracketed} exists" in result.output.replace("\n", ""), result.output
    dangling = tmp_path / "link.json"
    dangling.symlink_to(tmp_path / "elsewhere.json")
    result = cli("init", dangling, "--gpus", "0", "--force")  # the write would make the link's target
    assert result.exit_code == 2 and "a symlink to" in result.output and "which does not exist" in result.output
    assert not (tmp_path / "elsewhere.json").exists()
    result = cli("init", tmp_path / "new.json", "--gpus", "0", "--per-gpu", "999999999999999999999")  # overflowed
    assert result.exit_code == 2 and "batch.per_gpu" in result.output and not (tmp_path / "new.json").exists()
    result = cli("init", tmp_path / "new.json", "--data", "/shards/{0..9}.tar")
    assert result.exit_code == 2 and "--samples" in result.output and not (tmp_path / "new.json").exists()
    result = cli("init", tmp_path / "new.json", "--model", "ViT-B-32x", "--gpus", "0")
    assert result.exit_code == 2 and "ViT-B-32" in result.output and not (tmp_path / "new.json").exists()


def test_init_writes_the_specs_defaults_or_says_why_not(cli, tmp_path):
    """Every value `init` writes on a CPU machine, on 8 GPUs, with shards and fine-tuning published weights is the
    spec's default (its weight decay too), or unset by default, or its line says why it differs."""
    from fsdpclip.jobspec.starter import described_fields, starter_spec

    explained = {(0, None): {"run.name", "fsdp.param_dtype", "schedule.warmup_steps", "launch.device"},
                 (8, "openai"): {"run.name", "optimizer.lr", "schedule.warmup_steps", "launch.gpus_per_node"}}
    for (gpus, pretrained), fields in explained.items():
        data = ("/d/{0..9}.tar", 10 ** 6) if gpus else (None, None)
        rows = {field: (value, why) for field, value, _, why in
                described_fields(starter_spec("ViT-B-32", gpus, *data, pretrained))}
        assert {field for field, (_, why) in rows.items() if why} == fields
        assert rows["optimizer.weight_decay"] == (0.2, None)
    assert rows["optimizer.lr"][1] == "not the default 0.0005: published weights are fine-tuned at a lower rate"
    result = cli("init", tmp_path / "cpu.json", "--model", "RN50", "--gpus", "0")
    assert result.exit_code == 0, result.output
    assert squeezed('(not the default "bf16": the CPU trains in fp32)') in squeezed(result.output)
