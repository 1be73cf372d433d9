"""docs/benchmarks.md and README.md's performance table are what benchmarks/render.py makes of the rows."""

from __future__ import annotations

import importlib.util
import json

from conftest import REPO

RESULTS = REPO / "benchmarks" / "results"
OWN_FILES = {"index.json", "README.md", "plan_curves.json"}  # plan_curves.json: docs/plan-curves.png's


def load_render():
    spec = importlib.util.spec_from_file_location("render", REPO / "benchmarks" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_and_the_readme_table_are_rendered_from_the_rows():
    render = load_render()
    index = render.load_index()
    assert (REPO / "docs" / "benchmarks.md").read_text() == render.render_page(index), \
        "docs/benchmarks.md is not what benchmarks/results gives: run python benchmarks/render.py"
    readme = (REPO / "README.md").read_text()
    assert readme == render.render_readme(index, readme), \
        "README.md's performance table is not what benchmarks/results gives: run python benchmarks/render.py"


def test_every_table_names_its_command_machine_torch_and_date():
    for table in json.loads((RESULTS / "index.json").read_text())["tables"]:
        missing = [key for key in ("title", "command", "machine", "torch", "date", "rows") if not table.get(key)]
        assert not missing, f"index.json's table {table.get('id')!r} lacks {', '.join(missing)}"


def test_the_results_hold_only_the_rows_the_docs_cite():
    cited = {name for table in json.loads((RESULTS / "index.json").read_text())["tables"] for name in table["rows"]}
    present = {str(path.relative_to(RESULTS)) for path in RESULTS.rglob("*") if path.is_file()}
    assert not cited - present, f"index.json names row files that are not there: {sorted(cited - present)}"
    uncited = sorted(present - cited - OWN_FILES)
    assert not uncited, f"benchmarks/results holds files no table cites: {uncited[:10]}"
    assert len(present) <= 80


def test_a_sidebyside_variant_sets_its_fsdp_block_and_dotted_fields(tmp_path):
    """benchmarks/sidebyside.py's variants: an fsdp block whose dotted keys set other fields as `--set` does, so that
    one process runs the trainer with and without a moving average (the `ema` block) side by side."""
    import sys

    import pytest

    from fsdpclip.jobspec.problems import SpecError

    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("sidebyside", REPO / "benchmarks" / "sidebyside.py")
    sidebyside = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sidebyside)
    plain = sidebyside.variant_job("ViT-L-14", 128, {}, 1, str(tmp_path))
    averaged = sidebyside.variant_job("ViT-L-14", 128, {"unit_size": 1, "ema.decay": 0.9999}, 1, str(tmp_path))
    assert plain.moving_average is None and plain.fsdp.unit_size == "auto"
    assert averaged.moving_average.decay == 0.9999 and averaged.fsdp.unit_size == 1
    with pytest.raises(SpecError):
        sidebyside.variant_job("ViT-L-14", 128, {"ema.decay": 2}, 1, str(tmp_path))
