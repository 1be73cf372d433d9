"""The seams of spec.registry: a data source and a tower family written and registered in this one module
(as a plugin would be) are validated by `fsdpclip validate`, shown in the JSON schema, trained on and built."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal, Optional

import pytest
from pydantic import Field

from conftest import REPO, write_job
from fsdpclip.problems import Report
from fsdpclip.spec.registry import DATA_SOURCES, TOWER_FAMILIES, DataSource, RankData, TowerFamily
from fsdpclip.spec.section import Section


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


def register() -> None:
    """What a plugin's module does when it is imported: register its source and family."""
    DATA_SOURCES.register(ConstantSource())
    TOWER_FAMILIES.register(SmallVit())


@pytest.fixture(autouse=True, scope="module")
def registered():
    """The source and family registered for this module's tests only (the spec and schema are as shipped
    for every other test)."""
    register()
    yield
    DATA_SOURCES.unregister(ConstantSource.name)
    TOWER_FAMILIES.unregister(SmallVit.name)


# ------------------------------------------------------------------------------ tests
def _job(tiny_job: dict, **data) -> dict:
    return {**tiny_job, "data": {"source": "constant", **data}, "schedule": {"steps": 3},
            "launch": {"gpus_per_node": 1, "device": "cpu"}}


def test_validate_reads_a_registered_source_fields_and_its_checks(cli, tiny_job, tmp_path):
    code, out = cli.validate_json(write_job(tmp_path, _job(tiny_job, level=0.25)))
    assert code == 0, out["errors"]
    code, out = cli.validate_json(write_job(tmp_path, _job(tiny_job, level=2.0)))
    assert code != 0 and [e["location"] for e in out["errors"]] == ["data.level"]
    code, out = cli.validate_json(write_job(tmp_path, _job(tiny_job, level=0.0)))
    assert [(e["location"], e["message"]) for e in out["errors"]] == [("data.level", "a black image teaches nothing")]
    code, out = cli.validate_json(write_job(tmp_path, _job(tiny_job, levels=0.5)))
    assert [e["location"] for e in out["errors"]] == ["data.levels"]


def test_the_schema_holds_the_registered_blocks():
    from fsdpclip.spec.job import json_schema

    schema = json_schema()["$defs"]
    assert schema["ConstantSpec"]["properties"]["level"]["maximum"] == 1.0
    assert schema["ImageTowerSpec"]["properties"]["small_vit"]["description"] == SmallVit.description
    assert "small_vit" not in schema["TextTowerSpec"]["properties"]


def test_a_registered_tower_family_builds_and_is_validated(cli, tiny_job, tmp_path):
    from fsdpclip.model.build import build_model, find_towers
    from fsdpclip.spec.job import ModelSpec

    spec = ModelSpec(config=str(REPO / "examples/models/tiny-clip.json"), image={"small_vit": {"layers": 3}})
    model = build_model(spec)
    assert len(find_towers(model, spec.block_classes)["image"].blocks) == 3
    assert model.visual.transformer.width == 32 and spec.label == "tiny-clip+small-vit-3x32"
    job = {**tiny_job, "model": {**tiny_job["model"], "image": {"small_vit": {"width": 0}}}}
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert [e["location"] for e in out["errors"]] == ["model.image.small_vit.width"]


@pytest.mark.slow
def test_a_rank_trains_on_a_registered_source(tiny_job, tmp_path):
    """A short CPU run of the rank entry in a process that imported this module (as a plugin's is)."""
    from ranks import run_group

    job = {**_job(tiny_job, level=0.75), "logging": {"every_steps": 1},
           "checkpoint": {"at_end": False}}
    path = write_job(tmp_path, job)
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_seams; test_seams.register(); "
            f"from fsdpclip.train.entry import main; sys.exit(main([{str(path)!r}]))")
    result = run_group([sys.executable, "-c", code], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
