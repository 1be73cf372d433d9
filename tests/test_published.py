"""OpenCLIP's published weights as model.pretrained: tags checked without the network, found in a Hugging
Face cache laid out as huggingface_hub lays it out (built here: these tests never reach a hub)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from conftest import write_job
from fsdpclip.launch.launcher import resolve_paths
from fsdpclip.jobspec.job import Job, ModelSpec


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face home for this test, offline."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def put_in_cache(home: Path, hf_hub: str, filename: str, content: bytes) -> Path:
    """A file of a hub repository as huggingface_hub caches it: the blob by its hash, a snapshot's symlink
    to it, and refs/main naming the snapshot."""
    repo_id = os.path.dirname(hf_hub)
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(content)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    link = repo / "snapshots" / commit / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    return link


def published_job(tiny_job: dict, name: str, tag: str) -> dict:
    return {**tiny_job, "model": {"name": name, "pretrained": tag}, "batch": {"per_gpu": 2}}


def test_a_tag_is_found_in_the_cache_offline_and_never_fetched_by_validate(cli, tiny_job, tmp_path, hf_home):
    path = write_job(tmp_path, published_job(tiny_job, "RN50-quickgelu", "openai"))
    code, out = cli.validate_json(path)
    assert code == 2
    [error] = [e for e in out["errors"] if e["location"] == "model.pretrained"]
    assert "HF_HUB_OFFLINE" in error["message"] and "fsdpclip fetch RN50-quickgelu openai" in error["hint"]
    assert not (hf_home / "hub").exists()  # nothing downloaded, nothing written
    put_in_cache(hf_home, "timm/resnet50_clip.openai/", "open_clip_model.safetensors", b"weights")
    code, out = cli.validate_json(path)
    assert code == 0, out["errors"]
    assert not [w for w in out["warnings"] if w["location"] == "model.pretrained"]


def test_not_cached_while_online_is_said_not_fetched(cli, tiny_job, tmp_path, hf_home, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    code, out = cli.validate_json(write_job(tmp_path, published_job(tiny_job, "RN50-quickgelu", "openai")))
    assert code == 0, out["errors"]
    [warning] = [w for w in out["warnings"] if w["location"] == "model.pretrained"]
    assert "fsdpclip launch fetches it" in warning["message"]
    assert not (hf_home / "hub").exists()


@pytest.mark.parametrize("model, location, words, hint", [
    ({"name": "RN50", "pretrained": "laion2b"}, "model.pretrained", "nor a tag OpenCLIP publishes for 'RN50'",
     "openai, yfcc15m, cc12m"),
    ({"name": "ViT-B-32", "pretrained": "laion2b_s34b_b79"}, "model.pretrained", "nor a tag", "laion2b_s34b_b79k"),
    ({"config": "CONFIG", "pretrained": "openai"}, "model.pretrained", "need model.name", "./weights.pt"),
    ({"name": "RN50", "pretrained": "missing/weights"}, "model.pretrained", "file not found", None),
])
def test_a_tag_that_is_not_published_is_located(cli, tiny_job, tmp_path, hf_home, model, location, words, hint):
    model = {k: tiny_job["model"]["config"] if v == "CONFIG" else v for k, v in model.items()}
    code, out = cli.validate_json(write_job(tmp_path, {**tiny_job, "model": model}))
    assert code == 2
    [error] = [e for e in out["errors"] if e["location"] == location]
    assert words in error["message"]
    assert hint is None or hint in error["hint"]


def test_weights_trained_with_quick_gelu_on_a_gelu_model_are_warned(cli, tiny_job, tmp_path, hf_home):
    put_in_cache(hf_home, "timm/resnet50_clip.openai/", "open_clip_model.safetensors", b"weights")
    code, out = cli.validate_json(write_job(tmp_path, published_job(tiny_job, "RN50", "openai")))
    assert code == 0, out["errors"]
    [warning] = [w for w in out["warnings"] if w["location"] == "model.pretrained"]
    assert "trained with QuickGELU" in warning["message"] and "RN50-quickgelu" in warning["hint"]
    job = published_job(tiny_job, "RN50", "openai")
    job["model"]["quick_gelu"] = True
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert not [w for w in out["warnings"] if w["location"] == "model.pretrained"]


def test_fetch_offline_names_the_cached_file_or_says_why_not(cli, hf_home):
    result = cli("fetch", "RN50-quickgelu", "openai")
    assert result.exit_code == 2 and "HF_HUB_OFFLINE" in result.output
    link = put_in_cache(hf_home, "timm/resnet50_clip.openai/", "open_clip_model.safetensors", b"weights")
    result = cli("fetch", "RN50-quickgelu", "openai")
    assert result.exit_code == 0 and "already cached" in result.output
    assert link.name in result.output.replace("\n", "")


def test_fetch_names_a_cache_path_with_brackets_as_it_is(cli, tmp_path, monkeypatch):
    """A Hugging Face home whose path holds rich markup characters is named exactly in fetch's one-line error."""
    home = tmp_path / "hf[cache]"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = cli("fetch", "RN50-quickgelu", "openai")
    assert result.exit_code == 2 and f"({home / 'hub'})" in result.output.replace("\n", ""), result.output


def test_a_tag_is_kept_where_launch_makes_paths_absolute(tiny_job, tmp_path):
    job = Job.model_validate({**tiny_job, "model": {"name": "ViT-B-32", "pretrained": "laion2b_s34b_b79k"}})
    assert resolve_paths(job, tmp_path).model.pretrained == "laion2b_s34b_b79k"
    job = Job.model_validate({**tiny_job, "model": {"name": "ViT-B-32", "pretrained": "weights.pt"}})
    assert resolve_paths(job, tmp_path).model.pretrained == str(tmp_path / "weights.pt")


@pytest.mark.slow
def test_published_weights_load_into_the_initial_model(hf_home):
    """The smallest architecture with a published tag: its cached file is what the run starts from."""
    import torch
    from safetensors.torch import save

    from fsdpclip.model.build import build_model
    from fsdpclip.model.published import published_config
    from fsdpclip.model.weights import initial_model

    spec = ModelSpec(name="ViTamin-S", pretrained="datacomp1b")
    torch.manual_seed(1)
    published = {k: v.to(torch.bfloat16) for k, v in build_model(spec, device="cpu").state_dict().items()}
    hf_hub = published_config("ViTamin-S", "datacomp1b")["hf_hub"]
    assert hf_hub.endswith("/pytorch_model.bin")  # open_clip takes a safetensors sibling first
    put_in_cache(hf_home, hf_hub, "pytorch_model.safetensors", save(published))
    model = initial_model(spec, seed=2, init="openclip")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, published[name].to(value.dtype), msg=name)


def test_fetch_asks_the_hub_only_for_what_the_cache_lacks(hf_home, monkeypatch):
    """Online (the hub stood in for by a function that writes what the real one would), a missing file is
    fetched once into the cache; a cached one is taken from there."""
    import open_clip.pretrained

    from fsdpclip.model.published import fetch

    monkeypatch.delenv("HF_HUB_OFFLINE")
    asked = []

    def hub(repo_id, filename, revision=None, cache_dir=None):
        asked.append((repo_id, filename, cache_dir))
        return str(put_in_cache(hf_home, f"{repo_id}/", filename, b"weights"))

    monkeypatch.setattr(open_clip.pretrained, "hf_hub_download", hub)
    file, downloaded = fetch("RN50-quickgelu", "openai")
    assert downloaded and Path(file).read_bytes() == b"weights"
    assert asked == [("timm/resnet50_clip.openai", "open_clip_model.safetensors", str(hf_home / "hub"))]
    assert fetch("RN50-quickgelu", "openai") == (file, False) and len(asked) == 1


@pytest.mark.slow
def test_a_rank_whose_cache_lacks_the_weights_stops_in_one_line(hf_home, tmp_path):
    """A node that launch's fetch did not reach (another node's HF_HOME): the rank building the initial
    weights says which weights and how to fetch them, and the job ends with the spec's exit code, no traceback."""
    import sys

    from fsdpclip.run.directory import EXIT_SPEC
    from ranks import run_group

    job = Job.model_validate({"run": {"name": "p", "output_dir": str(tmp_path / "runs")},
                              "model": {"name": "ViTamin-S", "pretrained": "datacomp1b"},
                              "fsdp": {"param_dtype": "fp32"}, "data": {"source": "synthetic"},
                              "schedule": {"steps": 2}, "batch": {"per_gpu": 2},
                              "launch": {"device": "cpu", "collective_timeout_s": 60}})
    job.save(tmp_path / "job.json")
    proc = run_group([sys.executable, "-m", "fsdpclip.launch.torchrun", "--nproc-per-node=1", "--standalone", "-m",
                      "fsdpclip.launch.entry", str(tmp_path / "job.json")], timeout=300,
                     env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == EXIT_SPEC, proc.stdout[-3000:]
    assert "the 'datacomp1b' weights of ViTamin-S are not in the Hugging Face cache" in proc.stdout
    assert "fsdpclip fetch ViTamin-S datacomp1b" in proc.stdout and "Traceback" not in proc.stdout
