"""The CLI surface, the committed JSON Schema and the example specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdpclip.jobspec.job import Job, json_schema
from fsdpclip.jobspec.jobfile import load_job

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.json"))


def test_schema_file_is_in_sync():
    committed = json.loads((REPO / "schemas" / "job.schema.json").read_text())
    assert committed == json_schema(), "run `make schema` and commit schemas/job.schema.json"


def test_schema_command_prints_the_schema(cli):
    result = cli("schema")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == json_schema()


def _fields(schema: dict):
    for name, definition in [("Job", schema)] + list(schema["$defs"].items()):
        for key, prop in definition.get("properties", {}).items():
            yield f"{name}.{key}", prop


def test_every_field_is_described():
    undocumented = [name for name, prop in _fields(json_schema()) if not prop.get("description")]
    assert undocumented == []


def test_help_lists_every_command(cli):
    out = cli("--help").stdout
    for command in ("validate", "schema", "data"):
        assert command in out


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_examples_validate(cli, example, monkeypatch):
    monkeypatch.chdir(REPO)
    job = load_job(example)
    assert isinstance(job, Job)
    code, out = cli.validate_json(example, "--no-check-paths")
    assert code == 0, out["errors"]


def test_resolved_spec_round_trips(tmp_path):
    job = load_job(REPO / "examples" / "vit-bigg-14.json")
    again = Job.model_validate_json(job.to_json())
    assert again == job.model_copy(update={"schema_ref": None})


def test_text_that_reads_as_markup_is_printed_as_it_is(cli, tmp_path):
    """Paths and messages are the user's text, never rich markup: `[bold]` is printed as typed, and a closing tag
    without its opening one (gloo's `[/…/pair.cc:545]` in a rank's error) is no MarkupError."""
    from conftest import TINY_CONFIG

    folder = tmp_path / "[bold]runs[" / "bold]"  # …/[bold]runs[/bold]
    folder.mkdir(parents=True)
    job = {"run": {"name": "x", "output_dir": str(folder)}, "model": {"config": str(TINY_CONFIG)},
           "data": {"source": "synthetic"}, "batch": {"per_gpu": 4}, "schedule": {"steps": 2},
           "launch": {"gpus_per_node": 1, "device": "cpu"}}
    (folder / "job.json").write_text(json.dumps(job))
    valid = cli("validate", folder / "job.json")
    assert valid.exit_code == 0 and f"{folder / 'job.json'} is valid" in valid.output.replace("\n", ""), valid.output
    missing = cli("report", folder / "[" / "x]")
    assert missing.exit_code == 2 and f"✗ {folder}/[/x] has no metrics.jsonl" in missing.output, missing.output
    (folder / "bad.json").write_text(json.dumps({**job, "run": {"name": "[/y]"}}))
    invalid = cli("validate", folder / "bad.json")
    assert invalid.exit_code == 2 and "'[/y]'" in invalid.output, invalid.output
