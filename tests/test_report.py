"""`fsdpclip report` on the demo run: its summary agrees with the run's own files, and its plot holds
every curve the run logged (the stopped, resumed and running cases are in tests/test_faults.py)."""

from __future__ import annotations

import json
import subprocess

import pytest

from fsdpclip.cli.report import read_run, summary
from PIL import Image

from conftest import small_disk, synthetic_job, write_job


@pytest.mark.slow
def test_report_of_the_demo_run(demo_run, cli, tmp_path):
    run_dir, _ = demo_run
    result = cli("report", run_dir, "--json", "--png", tmp_path / "report.png")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "zeroshot/digits" in r]
    assert info["state"] == "finished" and info["step"] == info["total_steps"] == 40
    assert info["last_checkpoint"] == "step-00000040" and info["launches"] == 1 and info["restarts_at"] == []
    assert info["zeroshot"]["digits"] == evaluations[-1]["zeroshot/digits"] and len(evaluations) == 2
    assert info["retrieval"]["digits"] == evaluations[-1]["retrieval/digits"]
    assert info["panels"] == ["loss", "learning rate", "logit scale (1 / temperature)", "samples/s per GPU",
                              "MFU", "data wait fraction", "zero-shot acc1", "retrieval recall@1"]  # demo_run: peak set
    with Image.open(tmp_path / "report.png") as image:
        assert image.size[0] > 1000 and image.size[1] > 500

    shown = cli("report", run_dir, "--png", tmp_path / "again.png")
    assert shown.exit_code == 0 and "finished" in shown.stdout and "step 40/40" in shown.stdout
    recall = evaluations[-1]["retrieval/digits"]["text_retrieval_recall@1"]
    assert "retrieval digits: recall@1/5/10" in shown.stdout and f"image→text {recall:.3f}/" in shown.stdout


def test_report_of_what_is_not_a_run(cli, tmp_path):
    result = cli("report", tmp_path)
    assert result.exit_code == 2 and "has no metrics.jsonl" in result.output


def test_report_of_a_run_cut_short(cli, tmp_path):
    """A crash mid-write leaves a cut metrics line, launch record and exit report: the report reads what
    is whole and says the run ended without a report."""
    run_dir = tmp_path / "cut"
    (run_dir / "launches").mkdir(parents=True)
    record = {"step": 3, "total_steps": 10, "time": 1.0, "loss": 4.5, "lr": 1e-3}
    (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n" + '{"step": 4, "lo')
    (run_dir / "launches" / "0001.json").write_text('{"resumed_from": "/x/step-0000')
    (run_dir / "exit.json").write_text('{"code": 1')
    result = cli("report", run_dir, "--json", "--png", tmp_path / "cut.png")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["state"] == "ended without a report" and info["step"] == 3 and info["launches"] == 1
    assert info["restarts_at"] == [] and info["panels"] == ["loss", "learning rate"]


def test_report_of_a_run_stopped_at_once_names_the_step_it_resumes_from(cli, tmp_path):
    """A launch stopped by a second Ctrl-C (exit 130) after its checkpoint of step 2: the report says it stopped,
    resumable from step 2, and gives the command that resumes it; before any checkpoint, that it starts afresh."""
    run_dir = tmp_path / "run"
    _cut_run(run_dir)
    (run_dir / "job.json").write_text("{}")
    (run_dir / "exit.json").write_text(json.dumps({"code": 130, "message": "stopped at once", "time": 5.0}))
    info = summary(read_run(run_dir))
    assert info["state"] == "stopped at once (a second interrupt), before any checkpoint: launched again, it starts " \
                            "afresh"
    (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-00000002" / "meta.json").write_text("{}")
    info = summary(read_run(run_dir))
    assert info["state"] == "stopped at once (a second interrupt), resumable from step 2"
    assert info["relaunch"] == f"fsdpclip launch {run_dir / 'job.json'}"
    shown = cli("report", run_dir, "--png", tmp_path / "r.png")
    assert shown.exit_code == 0 and f"resume: fsdpclip launch {run_dir / 'job.json'}" in shown.stdout, shown.output


def test_report_says_a_run_waits_for_its_data_and_what_would_feed_it(cli, tmp_path):
    """A run whose step waited for its batches over 10% of its time (the median of its last windows, the
    start-up's first one left out): the report says so with the rate and the fixes its spec leaves open."""
    run_dir = tmp_path / "waits"
    run_dir.mkdir()
    job = {"model": {"name": "ViT-B-32"}, "data": {"urls": "/data/{0..99}.tar", "samples": 10 ** 6, "workers": 4},
           "batch": {"per_gpu": 256}}
    (run_dir / "job.json").write_text(json.dumps(job))
    waits = [0.0, 0.8, 0.7, 0.75, 0.02]
    records = [{"step": 10 * i, "total_steps": 100, "time": float(i), "loss": 5.0, "samples_per_s_per_gpu": 1500.0,
                "data_wait_fraction": wait} for i, wait in enumerate(waits, 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    info = summary(read_run(run_dir))
    assert info["data_wait_fraction"] == 0.75
    assert info["data_bound"].startswith("data-bound: the step waited for its batches 75% of the time: the data "
                                         "supplies ~1,500 samples/s per GPU")
    assert "data.workers 'auto'" in info["data_bound"] and "fsdpclip data resize" in info["data_bound"]
    result = cli("report", run_dir, "--png", tmp_path / "waits.png")
    assert result.exit_code == 0 and "data-bound: the step waited for its batches 75%" in result.output
    fed = [{**r, "data_wait_fraction": 0.01} for r in records]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fed))
    assert summary(read_run(run_dir))["data_bound"] is None


def test_a_relaunch_appends_no_record_to_a_cut_line(cli, tmp_path):
    """metrics.jsonl whose last line a crash cut (no newline): the next launch's log cuts it off when it opens the
    file, so its first record is a line of its own, which the report reads."""
    from fsdpclip.run.files import LineLog

    run_dir = tmp_path / "cut"
    run_dir.mkdir()
    first, again = ({"step": step, "total_steps": 10, "time": 1.0, "loss": 4.5, "lr": 1e-3} for step in (3, 4))
    (run_dir / "metrics.jsonl").write_text(json.dumps(first) + "\n" + '{"step": 4, "lo')
    log = LineLog(run_dir / "metrics.jsonl")
    log.append(json.dumps(again))
    log.close()
    assert (run_dir / "metrics.jsonl").read_text().splitlines() == [json.dumps(first), json.dumps(again)]
    result = cli("report", run_dir, "--json", "--png", tmp_path / "cut.png")
    assert result.exit_code == 0 and json.loads(result.stdout)["step"] == 4, result.output


def test_report_of_metrics_with_bytes_that_are_not_utf8(cli, tmp_path):
    """metrics.jsonl, a launch record and exit.json holding bytes that are not UTF-8: the report reads every
    line it can (bad bytes inside a string as U+FFFD; a line they break is skipped as a cut one), no
    UnicodeDecodeError."""
    run_dir = tmp_path / "bytes"
    (run_dir / "launches").mkdir(parents=True)
    lines = [json.dumps({"step": step, "total_steps": 10, "time": float(step), "loss": 4.0, "lr": 1e-3}).encode()
             for step in (1, 2, 3)]
    lines[1] = b'{"step": 2, \xff\xfe "loss": 4.0}'
    (run_dir / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (run_dir / "launches" / "0001.json").write_bytes(b'{"resumed_from": null, "note": "\xc3\x28"}')
    (run_dir / "exit.json").write_bytes(b'{"code": 1, "message": "rank 0 failed: \xff", "time": 5.0}')
    result = cli("report", run_dir, "--json", "--png", tmp_path / "bytes.png")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["step"] == 3 and info["launches"] == 1 and info["exit"]["message"] == "rank 0 failed: \ufffd"


def _cut_run(run_dir) -> None:
    """A run directory of three logged steps and no exit report."""
    run_dir.mkdir(parents=True, exist_ok=True)
    records = [{"step": step, "total_steps": 10, "time": float(step), "loss": 4.0, "lr": 1e-3} for step in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


def test_report_to_a_file_that_is_no_png(cli, tmp_path):
    """`--png out.txt` ended in matplotlib's traceback: one line, exit 2, nothing written."""
    _cut_run(tmp_path / "run")
    result = cli("report", tmp_path / "run", "--png", tmp_path / "out.txt")
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "the curves are drawn as a PNG: give a path ending in .png" in result.output
    assert not (tmp_path / "out.txt").exists()


def test_a_read_only_run_directory(cli, tmp_path):
    """A run directory on a filesystem mounted read-only: `report` prints its summary and says only that the plot
    could not be written (it printed nothing else); `validate` says the run directory cannot be written into (not
    that it cannot be created)."""
    with small_disk(tmp_path / "disk", 4) as disk:
        _cut_run(disk / "runs" / "t")
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        result = cli("report", disk / "runs" / "t")
        assert result.exit_code == 0, result.output
        assert "step 3/10, loss 4" in result.stdout and "ended without a report" in result.stdout
        assert f"! cannot write the plot {disk / 'runs' / 't' / 'report.png'}: Read-only file system" in result.output
        code, out = cli.validate_json(write_job(tmp_path, synthetic_job(disk)))
        errors = {error["location"]: error["message"] for error in out["errors"]}
        assert code == 2 and errors["run.output_dir"] == "cannot write into the run directory: a read-only filesystem"
