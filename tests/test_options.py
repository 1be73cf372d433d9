"""Spec options that shape the model or the logs, against OpenCLIP's own meaning of them, and the
option table of docs/options.md, which must name every field of the spec and a test for it."""

from __future__ import annotations

import os
import re

import pytest
import torch

from conftest import REPO, TINY_CONFIG
from fsdpclip.jobspec.job import ModelSpec
from fsdpclip.jobspec.jobfile import spec_fields, spelled_default

OPTIONS = REPO / "docs" / "options.md"
ROW = re.compile(r"^\| `(?P<field>[^`]+)` \|.*\| (?P<tests>.*) \|$")
DEFAULT_CELL = re.compile(r"^\| `(?P<field>[^`]+)` \| (?P<default>[^|]*) \|")  # in any table of a field per row
UPDATE = os.environ.get("FSDPCLIP_UPDATE_GOLDEN") == "1"


def table_rows() -> dict[str, re.Match]:
    """docs/options.md's rows by field (`tests`: the tests that verify it)."""
    rows = {}
    for line in OPTIONS.read_text().splitlines():
        match = ROW.match(line)
        if match:
            assert match["field"] not in rows, f"{match['field']} has two rows"
            rows[match["field"]] = match
    return rows


def test_every_field_has_a_row_and_every_row_a_test():
    rows = table_rows()
    fields = spec_fields()
    assert sorted(set(fields) - set(rows)) == [], "fields without a row in docs/options.md"
    assert sorted(set(rows) - set(fields)) == [], "rows for fields the spec does not have"
    for field, row in rows.items():
        tests = re.findall(r"`(tests/[\w/]+\.py)::(\w+)", row["tests"])
        assert tests, f"{field}: names no test"
        for file, name in tests:
            assert re.search(rf"^def {name}\(", (REPO / file).read_text(), re.M), f"{field}: {file}::{name} not found"


@pytest.mark.parametrize("page", [OPTIONS, REPO / "docs" / "guide.md"], ids=lambda page: page.name)
def test_every_row_gives_the_fields_default(page):
    """The default column of options.md and of the guide's first-run options is the pydantic models'
    (FSDPCLIP_UPDATE_GOLDEN=1 writes it)."""
    fields = spec_fields()

    def with_default(line: str) -> str:
        match = DEFAULT_CELL.match(line)
        if match is None or match["field"] not in fields:
            return line
        start, end = match.span("default")
        return f"{line[:start]}`{spelled_default(fields[match['field']])}`{line[end:]}"

    text = page.read_text()
    expected = "\n".join(map(with_default, text.split("\n")))
    if UPDATE:
        page.write_text(expected)
    assert text == expected, f"{page.name}'s defaults differ from the spec's: rerun with FSDPCLIP_UPDATE_GOLDEN=1"


def _meta_pair(spec: ModelSpec, **forced):
    """fsdpclip's model for `spec` and OpenCLIP's create_model with the same options, both on meta."""
    import open_clip

    from fsdpclip.model.build import build_model

    ours = build_model(spec, "meta")
    with torch.device("meta"):
        theirs = open_clip.create_model(spec.name, device="meta", **forced)
    return ours, theirs


def _shapes(model) -> dict:
    return {k: tuple(v.shape) if k not in ("logit_scale", "logit_bias") else () for k, v in model.state_dict().items()}


def test_model_options_mean_what_open_clip_means():
    """quick_gelu, image.image_size, image.patch_dropout, text.context_length and embed_dim build the model
    OpenCLIP's create_model builds with its force_* options and model arguments."""
    spec = ModelSpec(name="ViT-B-32", quick_gelu=True, embed_dim=256, image={"image_size": 160, "patch_dropout": 0.5},
                     text={"context_length": 32})
    ours, theirs = _meta_pair(spec, force_quick_gelu=True, force_image_size=160, force_patch_dropout=0.5,
                              force_context_length=32, embed_dim=256)
    assert _shapes(ours) == _shapes(theirs)
    assert type(ours.visual.transformer.resblocks[0].mlp.gelu) is type(theirs.visual.transformer.resblocks[0].mlp.gelu)
    assert type(ours.visual.transformer.resblocks[0].mlp.gelu).__name__ == "QuickGELU"
    assert ours.visual.patch_dropout.prob == theirs.visual.patch_dropout.prob == 0.5
    assert ours.context_length == theirs.context_length == 32
    assert ours.visual.preprocess_cfg["size"] == theirs.visual.preprocess_cfg["size"] == (160, 160)
    plain, _ = _meta_pair(ModelSpec(name="ViT-B-32"))
    assert _shapes(plain) != _shapes(ours)  # the options changed something


@pytest.mark.parametrize("proj", ["linear", "mlp", "head", "none"])
def test_timm_options_build_open_clips_timm_tower(proj):
    """image.timm pool, proj, proj_bias and drop_path give OpenCLIP's own TimmModel with those arguments."""
    from open_clip.timm_model import TimmModel

    from fsdpclip.model.build import build_model

    spec = ModelSpec(embed_dim=64 if proj != "none" else 192,
                     image={"timm": {"name": "vit_tiny_patch16_224", "pool": "token", "proj": proj, "proj_bias": True,
                                     "drop_path": 0.1}}, name="ViT-B-32")
    ours = build_model(spec, "meta").visual
    with torch.device("meta"):
        theirs = TimmModel("vit_tiny_patch16_224", spec.embed_dim, image_size=224, pool="token",
                           proj=None if proj == "head" else proj, proj_bias=True, drop_path=0.1)
    assert _shapes(ours) == _shapes(theirs)
    assert ours.trunk.global_pool == "token"
    assert ours.trunk.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    if proj == "linear":
        assert ours.head.proj.bias is not None


@pytest.mark.parametrize("pooler, proj", [("mean_pooler", "mlp"), ("cls_pooler", "linear"), ("max_pooler", "mlp")])
def test_hf_options_build_open_clips_text_tower(pooler, proj):
    """model.text.hf pooler and proj give OpenCLIP's own HFTextEncoder with those arguments."""
    from open_clip.hf_model import HFTextEncoder

    from fsdpclip.model.build import build_model
    from fsdpclip.model.towers import register_hf_families

    hf = str(REPO / "tests" / "assets" / "t5-tiny")
    spec = ModelSpec(config=str(TINY_CONFIG), text={"hf": {"path": hf, "pooler": pooler, "proj": proj},
                                                    "context_length": 16})
    ours = build_model(spec, "meta").text
    register_hf_families()
    with torch.device("meta"):
        theirs = HFTextEncoder(hf, output_dim=64, pooler_type=pooler, proj_type=proj, pretrained=False)
    assert _shapes(ours) == _shapes(theirs)
    assert type(ours.pooler) is type(theirs.pooler)


def test_tensorboard_and_peak_tflops(tmp_path):
    """logging.tensorboard writes the scalars of metrics.jsonl as TensorBoard events; logging.peak_tflops is
    the peak MFU is taken against."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fsdpclip.train.metrics import MetricsLog, Window, peak_tflops

    assert peak_tflops(torch.device("cpu"), 123.0) == 123.0 and peak_tflops(torch.device("cpu"), None) is None
    window = Window()
    window.samples, window.steps = 1000, 1
    rates = window.rates(world_size=2, flops_per_sample=1e9, peak=10.0)
    assert rates["mfu"] == pytest.approx(rates["samples_per_s_per_gpu"] * 1e9 / 10e12)
    log = MetricsLog(tmp_path, total_steps=2, tensorboard=True, enabled=True)
    log.write({"step": 1, "loss": 2.5, "lr": 1e-3})
    log.write({"step": 2, "loss": 2.0, "lr": 5e-4, "zeroshot/digits": {"acc1": 0.5}})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == [2.5, 2.0]
    assert [e.step for e in events.Scalars("zeroshot/digits/acc1")] == [2]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_parallel_init_is_deterministic_and_draws_the_same_distributions(monkeypatch):
    """model.init 'parallel': the same weights for a seed whatever the core count (chunks forced small
    so the tiny model's tensors are split), other weights for another seed, OpenCLIP's distributions
    tensor by tensor (constant inits equal, random ones of the same spread), and torch's methods back
    afterwards. 'auto' keeps OpenCLIP's own init below its size threshold."""
    from fsdpclip.model import weights
    from fsdpclip.model.build import build_model
    from fsdpclip.model.weights import ParallelDraws, init_kind, initial_model

    monkeypatch.setattr(ParallelDraws, "CHUNK", 100)
    spec = ModelSpec(config=str(TINY_CONFIG), init="parallel")
    by_cores = []
    for cores in (1, 3):
        monkeypatch.setattr(weights, "usable_cores", lambda cores=cores: cores)
        by_cores.append(initial_model(spec, seed=4, init="parallel").state_dict())
    assert "normal_" not in torch.Tensor.__dict__ and torch.randn is torch._C._VariableFunctions.randn
    parallel, again = by_cores
    assert all(torch.equal(parallel[k], again[k]) for k in parallel)
    other_seed = initial_model(spec, seed=5, init="parallel").state_dict()
    openclip = initial_model(ModelSpec(config=str(TINY_CONFIG)), seed=4, init="openclip").state_dict()
    random_tensors = 0
    for key, reference in openclip.items():
        if reference.numel() < 1000 or not reference.is_floating_point():
            continue
        if reference.std() == 0:  # a constant init
            assert torch.equal(parallel[key], reference), key
            continue
        random_tensors += 1
        assert not torch.equal(parallel[key], reference) and not torch.equal(parallel[key], other_seed[key]), key
        assert abs(parallel[key].std() / reference.std() - 1) < 0.15, key
        assert abs(parallel[key].mean() - reference.mean()) < 0.2 * reference.std() + 1e-3, key
    assert random_tensors >= 10
    tiny = sum(p.numel() for p in build_model(ModelSpec(config=str(TINY_CONFIG))).parameters())
    assert init_kind(ModelSpec(config=str(TINY_CONFIG)), tiny) == "openclip"
    monkeypatch.setattr(weights, "OPENCLIP_INIT_MAX_PARAMETERS", 1000)
    assert init_kind(ModelSpec(config=str(TINY_CONFIG)), tiny) == "parallel"
    assert init_kind(ModelSpec(config=str(TINY_CONFIG), init="openclip"), tiny) == "openclip"
