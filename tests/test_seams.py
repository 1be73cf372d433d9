"""The seams of the spec and of training: a data source, a tower family and a loss written in this one module and
registered by its `register`, the entry point of a plugin (`plugins.install`), are validated by `fsdpclip
validate`, shown in the JSON schema, built and trained on, in the processes where the plugin is installed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal, Optional

import pytest
from pydantic import Field

from conftest import REPO, write_job
from fsdpclip.jobspec.source import DATA_SOURCES, DataSource, RankData
from fsdpclip.jobspec.family import TOWER_FAMILIES, TowerFamily
from fsdpclip.jobspec.problems import Report
from fsdpclip.jobspec.section import Section
from fsdpclip.jobspec.losses import LOSSES, Loss
from plugins import PluginProcess, install


# --------------------------------------------------------------------- a data source
class ConstantSpec(Section):
    source: Literal["constant"] = Field(description="Images of one grey level, every caption the same tokens.")
    level: float = Field(0.5, ge=0.0, le=1.0, description="The images' grey level.")
    samples: Optional[int] = Field(None, gt=0, description="Samples in one epoch.")


class ConstantBatches:
    def __init__(self, spec: ConstantSpec, rank: RankData):
        from fsdpclip.model.build import image_shape, text_shape

        self.spec, self.rank, self.index, self.broken = spec, rank, 0, 0
        self.shape, (self.context, _) = image_shape(rank.model), text_shape(rank.model)

    def __iter__(self):
        import torch

        while True:
            self.index += 1
            size = self.rank.batch_size
            yield (torch.full((size, *self.shape), self.spec.level, device=self.rank.device),
                   torch.ones(size, self.context, dtype=torch.long, device=self.rank.device))

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]

    def restart(self, micro_batches: int, epoch: int) -> None:
        self.index = micro_batches

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


class ConstantSource(DataSource):
    name, spec = "constant", ConstantSpec

    def batches(self, spec: ConstantSpec, rank: RankData):
        return ConstantBatches(spec, rank), None

    def check(self, spec: ConstantSpec, job, report: Report, check_paths: bool) -> None:
        if spec.level == 0.0:
            report.error("data.level", "a black image teaches nothing", 0.0)


# -------------------------------------------------------------------- a tower family
class SmallVitSpec(Section):
    layers: int = Field(1, gt=0, description="Transformer blocks.")
    width: int = Field(32, gt=0, description="Width of the blocks.")


class SmallVit(TowerFamily):
    name, tower, spec = "small_vit", "image", SmallVitSpec
    description = "An OpenCLIP ViT of the given depth and width on 32-px images."

    def config(self, spec: SmallVitSpec) -> dict:
        return {"image_size": 32, "patch_size": 8, "layers": spec.layers, "width": spec.width, "head_width": 16}

    def label(self, spec: SmallVitSpec) -> str:
        return f"small-vit-{spec.layers}x{spec.width}"


# ----------------------------------------------------------------------------- a loss
class CosineLossSpec(Section):
    kind: Literal["cosine"] = Field(description="1 - the cosine of each image's and its caption's features.")
    weight: float = Field(1.0, gt=0, description="What the mean is multiplied by.")


class CosineLoss(Loss):
    name, spec = "cosine", CosineLossSpec

    def build(self, spec: CosineLossSpec, rank: int, world_size: int):
        import torch

        class Cosine(torch.nn.Module):
            def forward(self, images, texts, *scale_and_bias):
                return spec.weight * (1 - torch.nn.functional.cosine_similarity(images, texts)).mean()

        return Cosine()

    def check(self, spec: CosineLossSpec, model, report: Report) -> None:
        if spec.weight > 1000:
            report.error("loss.weight", f"more than 1000 would swamp {type(model).__name__}'s gradients", spec.weight)


def register() -> None:
    """The plugin's entry point (`plugins.install`): its source, family and loss registered."""
    DATA_SOURCES.register(ConstantSource())
    TOWER_FAMILIES.register(SmallVit())
    LOSSES.register(CosineLoss())


def built_small_vit(layers: int) -> tuple[int, int, str]:
    """(blocks of the image tower, its width, the model's label) of the tiny model with a `small_vit` image tower
    of `layers` blocks, built where the plugin is installed."""
    from fsdpclip.model.build import build_model, find_towers
    from fsdpclip.jobspec.job import ModelSpec

    spec = ModelSpec(config=str(REPO / "examples/models/tiny-clip.json"), image={"small_vit": {"layers": layers}})
    model = build_model(spec)
    return len(find_towers(model, spec.block_classes)["image"].blocks), model.visual.transformer.width, spec.label


@pytest.fixture(scope="module")
def plugged(tmp_path_factory):
    """A process where this module is installed as a plugin, for this module's tests."""
    process = PluginProcess(install(tmp_path_factory.mktemp("plugin"), f"{__name__}:register"))
    yield process
    process.close()


# ------------------------------------------------------------------------------ tests
def _job(tiny_job: dict, **data) -> dict:
    return {**tiny_job, "data": {"source": "constant", **data}, "schedule": {"steps": 3},
            "launch": {"gpus_per_node": 1, "device": "cpu"}}


def test_validate_reads_a_registered_source_fields_and_its_checks(plugged, tiny_job, tmp_path):
    code, out = plugged.validate_json(write_job(tmp_path, _job(tiny_job, level=0.25)))
    assert code == 0, out["errors"]
    code, out = plugged.validate_json(write_job(tmp_path, _job(tiny_job, level=2.0)))
    assert code != 0 and [e["location"] for e in out["errors"]] == ["data.level"]
    code, out = plugged.validate_json(write_job(tmp_path, _job(tiny_job, level=0.0)))
    assert [(e["location"], e["message"]) for e in out["errors"]] == [("data.level", "a black image teaches nothing")]
    code, out = plugged.validate_json(write_job(tmp_path, _job(tiny_job, levels=0.5)))
    assert [e["location"] for e in out["errors"]] == ["data.levels"]


def test_the_schema_holds_the_registered_blocks(plugged):
    schema = json.loads(plugged("schema").stdout)
    defs = schema["$defs"]
    assert defs["ConstantSpec"]["properties"]["level"]["maximum"] == 1.0
    assert defs["ImageTowerSpec"]["properties"]["small_vit"]["description"] == SmallVit.description
    assert "small_vit" not in defs["TextTowerSpec"]["properties"]
    assert {"$ref": "#/$defs/CosineLossSpec"} in schema["properties"]["loss"]["oneOf"]
    assert defs["CosineLossSpec"]["properties"]["weight"]["exclusiveMinimum"] == 0


def test_a_registered_tower_family_builds_and_is_validated(plugged, tiny_job, tmp_path):
    assert plugged.call(f"{__name__}:built_small_vit", 3) == [3, 32, "tiny-clip+small-vit-3x32"]
    job = {**tiny_job, "model": {**tiny_job["model"], "image": {"small_vit": {"width": 0}}}}
    code, out = plugged.validate_json(write_job(tmp_path, job))
    assert [e["location"] for e in out["errors"]] == ["model.image.small_vit.width"]


def test_a_registered_loss_is_validated_with_its_checks(plugged, tiny_job, tmp_path):
    code, out = plugged.validate_json(write_job(tmp_path, {**tiny_job, "loss": {"kind": "cosine", "weight": 0.5}}))
    assert code == 0, out["errors"]
    code, out = plugged.validate_json(write_job(tmp_path, {**tiny_job, "loss": {"kind": "cosine", "weight": 0}}))
    assert [e["location"] for e in out["errors"]] == ["loss.weight"]
    code, out = plugged.validate_json(write_job(tmp_path, {**tiny_job, "loss": {"kind": "cosine", "weight": 5000}}))
    assert [(e["location"], e["message"]) for e in out["errors"]] == [
        ("loss.weight", "more than 1000 would swamp CLIP's gradients")]
    code, out = plugged.validate_json(write_job(tmp_path, {**tiny_job, "loss": {"kind": "cosin"}}))
    assert [(e["location"], e["hint"]) for e in out["errors"]] == [("loss", "one of 'clip', 'siglip', 'cosine'")]


def test_the_package_spec_holds_none_of_them(cli, tiny_job, tmp_path):
    """This process did not install the plugin: its spec is the package's, and no registration changes it now."""
    from fsdpclip.jobspec.job import json_schema
    from fsdpclip.jobspec.registry import RegistryError

    code, out = cli.validate_json(write_job(tmp_path, _job(tiny_job, level=0.25)))
    assert [(e["location"], e["message"]) for e in out["errors"]] == [("data", "unknown data source 'constant'")]
    assert "ConstantSpec" not in json_schema()["$defs"]
    with pytest.raises(RegistryError, match="'constant' is registered after fsdpclip assembled its job spec"):
        DATA_SOURCES.register(ConstantSource())


def test_a_registry_refuses_a_name_twice_and_names_what_it_lacks():
    from fsdpclip.jobspec.registry import Registry, RegistryError

    sources = Registry("data source", ())
    sources.register(ConstantSource())
    with pytest.raises(RegistryError, match="a data source named 'constant' is registered already"):
        sources.register(ConstantSource())
    with pytest.raises(RegistryError, match="no data source is named 'constnt': did you mean 'constant'?"):
        sources["constnt"]
    with pytest.raises(RegistryError, match="no data source is named 'webdataset': known: constant"):
        sources["webdataset"]


@pytest.mark.slow
def test_a_rank_trains_on_a_registered_source_with_a_registered_loss(tiny_job, tmp_path):
    """A short CPU run of the rank entry in a process where this module is installed as a plugin: the constant
    images and the cosine loss (CLIP's over identical rows would be log 16)."""
    from ranks import run_group

    job = {**_job(tiny_job, level=0.75), "loss": {"kind": "cosine", "weight": 1000.0},
           "logging": {"every_steps": 1}, "checkpoint": {"at_end": False}}
    path = write_job(tmp_path, job)
    env = install(tmp_path / "plugin", f"{__name__}:register")
    result = run_group([sys.executable, "-m", "fsdpclip", "train", str(path)], timeout=180, env=env)
    assert result.returncode == 0, result.stdout[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert all(r["loss"] > 10 for r in records if "loss" in r), records
