"""Towers beyond OpenCLIP's configs: Hugging Face text towers and timm image towers, all local.

A tiny T5 and a tiny timm ViT, built from local directories with their own weights, train on
2 CPU ranks with only their last blocks trainable; `validate` checks every other case on the
meta device, the several-billion-parameter example included.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
import torch

from conftest import REPO, TINY_CONFIG, write_job
from ranks import torchrun

T5_TINY = REPO / "tests" / "assets" / "t5-tiny"
GIANT = REPO / "examples" / "mt5-xxl-eva02-e-14.json"
SEED, STEPS = 3, 3


def _hf_dir(tmp_path, name: str = "t5", weights: bool = True, config: dict | None = None, **edits) -> str:
    """A local Hugging Face directory with the stand-in tokenizer: the tiny T5's config (or `config`),
    edited, and optionally random weights saved as save_pretrained saves them."""
    from transformers import AutoConfig, AutoModel

    out = tmp_path / name
    shutil.copytree(T5_TINY, out)
    raw = (config or json.loads((out / "config.json").read_text())) | edits
    (out / "config.json").write_text(json.dumps(raw))
    if weights:
        torch.manual_seed(11)
        AutoModel.from_config(AutoConfig.from_pretrained(out)).save_pretrained(out)
    return str(out)


def _timm_dir(tmp_path) -> str:
    """A local timm directory (timm's own format): EVA02-E-14's trunk architecture shrunk to 3 blocks
    of width 64 at 28 px, with its weights and classifier."""
    import timm
    from safetensors.torch import save_file

    out = tmp_path / "timm-eva"
    out.mkdir()
    args = {"img_size": 28, "depth": 3, "embed_dim": 64, "num_heads": 2}
    config = {"architecture": "eva02_enormous_patch14_clip_224", "model_args": args,
              "pretrained_cfg": {"classifier": "head", "input_size": [3, 28, 28]}}
    (out / "config.json").write_text(json.dumps(config))
    torch.manual_seed(12)
    save_file(timm.create_model("eva02_enormous_patch14_clip_224", **args).state_dict(),
              str(out / "model.safetensors"))
    return str(out)


def _job(tmp_path, model: dict, **extra) -> dict:
    job = {"run": {"name": "towers", "output_dir": str(tmp_path / "runs"), "seed": SEED},
           "model": model, "fsdp": {"param_dtype": "fp32", "unit_size": 1},
           "optimizer": {"lr": 1e-2}, "schedule": {"kind": "constant", "steps": STEPS},
           "data": {"source": "synthetic"}, "batch": {"per_gpu": 4},
           "launch": {"gpus_per_node": 2, "device": "cpu", "collective_timeout_s": 60}}
    job.update(extra)
    return job


# ------------------------------------------------------------------------- training
@pytest.mark.slow
def test_t5_and_timm_towers_train_only_their_last_blocks(tmp_path):
    """embed_dim + a local T5 (3 blocks) + a local timm EVA (3 blocks), both from their own weights,
    in bf16, activation-checkpointed; all but the last block of each tower and their embeddings frozen."""
    from safetensors.torch import load_file

    from fsdpclip.model.weights import initial_model
    from fsdpclip.jobspec.jobfile import parse_job

    hf, timm_dir = _hf_dir(tmp_path), _timm_dir(tmp_path)
    model = {"embed_dim": 48, "text": {"hf": {"path": hf, "pretrained": True}, "context_length": 12},
             "image": {"timm": {"path": timm_dir, "pretrained": True}}}
    freeze = {"text": {"blocks": "0:-1", "embeddings": True}, "image": {"blocks": "0:-1", "embeddings": True}}
    job = _job(tmp_path, model, freeze=freeze)
    job["fsdp"].update(param_dtype="bf16", activation_checkpointing={"text": True, "image": True})
    out = tmp_path / "result.json"
    proc = torchrun(["tests/workers/train_checks.py", "parity", str(out), str(write_job(tmp_path, job))])
    assert proc.returncode == 0, proc.stdout[-5000:]
    losses = json.loads(out.read_text())["losses"]
    trained = torch.load(str(out) + ".pt")

    initial = initial_model(parse_job(job).model, SEED, init="openclip").state_dict()
    hf_weights = load_file(f"{hf}/model.safetensors")
    timm_weights = load_file(f"{timm_dir}/model.safetensors")
    # The towers started from their local weights (classifier dropped), the projections from random.
    assert torch.equal(initial["text.transformer.block.0.layer.0.SelfAttention.q.weight"],
                       hf_weights["encoder.block.0.layer.0.SelfAttention.q.weight"])
    assert torch.equal(initial["visual.trunk.blocks.0.attn.qkv.weight"], timm_weights["blocks.0.attn.qkv.weight"])

    def trainable(name: str) -> bool:  # written out from the model layouts, independently of fsdpclip
        return bool(re.match(r"text\.transformer\.block\.2\.|text\.transformer\.final_layer_norm|text\.proj\."
                             r"|visual\.trunk\.blocks\.2\.|visual\.trunk\.(norm|fc_norm)\.|visual\.head\."
                             r"|logit_scale", name))

    changed = {name for name, value in initial.items() if not torch.equal(trained[name].reshape(value.shape), value)}
    expected = {name for name in initial if trainable(name)}
    assert changed == expected
    assert any(n.startswith("text.transformer.block.2.") for n in expected)
    assert any(n.startswith("visual.trunk.blocks.2.") for n in expected)
    assert len(losses) == STEPS and all(map(torch.isfinite, torch.tensor(losses)))


# ------------------------------------------------------------------------- validate
def _tiny_model(text_hf: dict, **model) -> dict:
    return {"config": str(TINY_CONFIG), "text": {"hf": text_hf}, **model}


def _validate(cli, tmp_path, model: dict, *args, **extra):
    return cli.validate_json(write_job(tmp_path, _job(tmp_path, model, **extra)), *args)


def _error(out: dict, location: str) -> dict:
    match = [e for e in out["errors"] if e["location"] == location]
    assert match, f"no error at {location}: {out['errors']}"
    return match[0]


@pytest.mark.slow
def test_giant_spec_on_the_meta_device(cli):
    """mT5-XXL's encoder + EVA02-E-14's image tower: ~10B parameters, checked on the meta device.
    Unsharded (what DDP keeps per GPU) it cannot fit a 141 GiB H200; sharded over 2 it does."""
    code, out = cli.validate_json(GIANT, "--world-size", "2")
    assert code == 0, out["errors"]
    summary = out["summary"]
    # mT5-XXL's encoder from its config: 250112×4096 embedding; 24 blocks of q,k,v,o (4096²),
    # gated FF (2·4096·10240 + 10240·4096) and 2 norms; block 0's 32×64 relative bias; a final norm.
    block = 4 * 4096 * 4096 + 3 * 4096 * 10240 + 2 * 4096
    encoder = 250112 * 4096 + 24 * block + 32 * 64 + 4096
    head = 4096 * 2560 + 2560 * 1024  # OpenCLIP's MLP projection to embed_dim 1024
    assert summary["towers"]["text"]["parameters"] == encoder + head
    assert summary["towers"]["text"]["blocks"] == 24 and summary["towers"]["text"]["block_classes"] == ["MT5Block"]
    assert summary["towers"]["image"]["blocks"] == 64
    assert summary["parameters"]["parameters"] > 9_900_000_000
    sharded = summary["memory_gib"]
    on_gpus = [w for w in out["warnings"] if "host memory" not in w["message"]]  # a small machine validating
    assert on_gpus == [] and sharded["total"] < 141
    code, out = cli.validate_json(GIANT, "--world-size", "1")
    assert code == 0
    assert out["summary"]["memory_gib"]["total"] > 141
    assert out["summary"]["memory_gib"]["parameters"] == pytest.approx(2 * sharded["parameters"], rel=1e-3)
    assert [w["location"] for w in out["warnings"] if "host memory" not in w["message"]] == ["launch.gpu_memory_gib"]


def test_t5_freeze_and_decay_counts(cli, tmp_path):
    hf = _hf_dir(tmp_path, weights=False)
    d, ff = 32, 64
    block = 4 * d * d + 2 * d * ff + 2 * d  # attention, ReLU FF, 2 norms
    head = d + d * 48 + 48 * 64  # final norm; MLP projection 32 -> (32+64)//2 -> 64
    code, out = _validate(cli, tmp_path, _tiny_model({"path": hf}))
    assert code == 0, out["errors"]
    text = out["summary"]["towers"]["text"]
    assert (text["blocks"], text["block_classes"]) == (3, ["T5Block"])
    assert text["parameters"] == 128 * d + 3 * block + 32 * 4 + head
    # No decay by name for a 2-d tensor: T5's relative position bias (32 buckets × 4 heads), as
    # open_clip_train's rule ('bias' in the name); norms and biases are 1-d (rule 0); embeddings decay.
    groups = {g["rule"]: g["parameters"] for g in out["summary"]["decay_groups"]}
    assert groups["decay_rules[1]"] == 32 * 4

    code, out = _validate(cli, tmp_path, _tiny_model({"path": hf}),
                          freeze={"text": {"blocks": "0:-1", "embeddings": True}})
    assert code == 0, out["errors"]
    assert out["summary"]["towers"]["text"]["trainable"] == block + head


def test_flops_of_a_hugging_face_tower_are_counted_on_fake_tensors(tmp_path, monkeypatch):
    """A T5 tower reads its attention mask: plain meta tensors cannot run it, so the FLOP count (and
    validate's activation trace) takes a FakeTensorMode for any model that holds a transformers module."""
    import fsdpclip.model.build
    from fsdpclip.model.build import build_model, holds_hugging_face_modules, training_flops_per_sample
    from fsdpclip.jobspec.job import ModelSpec

    model = build_model(ModelSpec(config=str(TINY_CONFIG), text={"hf": {"path": _hf_dir(tmp_path, weights=False)}}))
    assert holds_hugging_face_modules(model)
    assert training_flops_per_sample(model) > 0
    monkeypatch.setattr(fsdpclip.model.build, "holds_hugging_face_modules", lambda model: False)
    with pytest.raises(RuntimeError, match="meta"):
        training_flops_per_sample(model)


def test_convnext_downsampling_goes_with_the_next_block(cli, tmp_path):
    """timm's test_convnext: stages of 1, 2, 4 and 2 ConvNeXtBlocks, stages 1-3 starting with a
    downsampling layer. Freezing all but the last block leaves that block, the trunk's head norm
    and OpenCLIP's projection trainable; the last stage's downsampling (before its first block) is frozen."""
    import timm

    trunk = timm.create_model("test_convnext")
    count = lambda prefix: sum(p.numel() for n, p in trunk.named_parameters() if n.startswith(prefix))  # noqa: E731
    model = {"config": str(TINY_CONFIG), "image": {"timm": {"name": "test_convnext"}}}
    freeze = {"image": {"blocks": "0:-1", "embeddings": True}}
    code, out = _validate(cli, tmp_path, model, freeze=freeze)
    assert code == 0, out["errors"]
    image = out["summary"]["towers"]["image"]
    assert (image["blocks"], image["block_classes"]) == (9, ["ConvNeXtBlock"])
    projection = trunk.num_features * 64  # linear, no bias, to the tiny config's embed_dim
    assert image["trainable"] == count("stages.3.blocks.1.") + count("head.norm.") + projection
    code, out = _validate(cli, tmp_path, model, freeze={"image": {"blocks": "0:-2", "embeddings": True}})
    assert out["summary"]["towers"]["image"]["trainable"] == \
        count("stages.3.") + count("head.norm.") + projection  # its first block takes the downsampling along


BERT_LIKE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "vocab_size": 64, "max_position_embeddings": 40}


@pytest.mark.parametrize("family,config,block_class,max_tokens", [
    ("bert", BERT_LIKE, "BertLayer", 40),
    ("roberta", BERT_LIKE | {"pad_token_id": 1}, "RobertaLayer", 38),  # positions start after the pad id
    ("xlm-roberta", BERT_LIKE | {"pad_token_id": 1}, "XLMRobertaLayer", 38),
    ("mt5", None, "MT5Block", None),  # relative positions: no limit
])
def test_hf_families_find_their_blocks(cli, tmp_path, family, config, block_class, max_tokens):
    hf = _hf_dir(tmp_path, family, weights=False, config=config, model_type=family)
    code, out = _validate(cli, tmp_path, _tiny_model({"path": hf}, text={"hf": {"path": hf}, "context_length": 16}),
                          freeze={"text": {"blocks": "0:-1"}})
    assert code == 0, out["errors"]
    assert out["summary"]["towers"]["text"]["block_classes"] == [block_class]
    assert out["summary"]["towers"]["text"]["blocks"] == (2 if config else 3)
    code, out = _validate(cli, tmp_path, _tiny_model({"path": hf}, text={"hf": {"path": hf}, "context_length": 39}))
    if max_tokens is not None and max_tokens < 39:
        assert _error(out, "model.text.context_length")["message"] == "39 tokens, but the text tower takes at most 38"
    else:
        assert code == 0, out["errors"]


def test_wrong_block_class_lists_the_towers_blocks(cli, tmp_path):
    hf = _hf_dir(tmp_path, weights=False)
    code, out = _validate(cli, tmp_path, _tiny_model({"path": hf}),
                          fsdp={"param_dtype": "fp32", "wrap": {"text": ["T5Blok"]},
                                "activation_checkpointing": {"text": ["T5Stack", "Nope"]}})
    assert code == 2
    assert "T5Block" in _error(out, "fsdp.wrap.text[0]")["hint"]
    assert "T5Block" in _error(out, "fsdp.activation_checkpointing.text[1]")["hint"]
    assert not [e for e in out["errors"] if e["location"] == "fsdp.activation_checkpointing.text[0]"]


@pytest.mark.parametrize("model,location,words", [
    (_tiny_model({"path": "google/mt5-xl"}), "model.text.hf.path", "never downloads"),
    ({"name": "xlm-roberta-base-ViT-B-32"}, "model.name", "hub id"),
    ({"config": str(TINY_CONFIG), "image": {"timm": {"name": "vit_base_patch16_22"}}}, "model.image.timm.name",
     "vit_base_patch16_224"),
    ({"config": str(TINY_CONFIG), "image": {"timm": {"name": "hf-hub:timm/vit_base_patch16_224"}}},
     "model.image.timm.name", "hub id"),
    ({"config": str(TINY_CONFIG), "image": {"timm": {"name": "test_vit", "pretrained": True}}}, "model.image.timm",
     "weights file"),
    ({"image": {"timm": {"name": "test_vit"}}, "text": {"hf": {"path": "x"}}}, "model", "embed_dim"),
    (_tiny_model({"path": "x", "pooling": "mean"}), "model.text.hf.pooling", "pooler"),
])
def test_tower_mistakes_are_located(cli, tmp_path, model, location, words):
    code, out = _validate(cli, tmp_path, model)
    assert code == 2
    problem = _error(out, location)
    assert words in problem["message"] + (problem["hint"] or "")


def test_tokenizer_larger_than_the_vocabulary(cli, tmp_path):
    hf = _hf_dir(tmp_path, weights=False, vocab_size=16)  # the stand-in tokenizer has 40 tokens
    code, out = _validate(cli, tmp_path, _tiny_model({"path": hf}))
    assert code == 2
    assert "more than the model's vocab_size 16" in _error(out, "model.text.hf.path")["message"]


def test_without_transformers_validate_names_the_extra(cli, tmp_path, monkeypatch):
    hf = _hf_dir(tmp_path, weights=False)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    code, out = _validate(cli, tmp_path, _tiny_model({"path": hf}))
    assert code == 2
    problem = _error(out, "model.text.hf.path")
    assert "transformers" in problem["message"] and problem["hint"] == "pip install 'fsdpclip[hf]'"
