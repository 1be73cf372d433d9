"""Weights & Biases (logging.wandb): a preempted and resumed single-process run logs to one W&B run,
offline, without touching the network; `validate` names a missing wandb package."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import TINY_CONFIG, write_job
from ranks import run_group

from fsdpclip.train.stops import STOP_CHECK_STEPS

STEPS = 3 * STOP_CHECK_STEPS  # two stop checks: the signal, sent after the first step, lands before the last


@contextlib.contextmanager
def _listener():
    """A local port that records every connection made to it: (port, connections)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    connections, done = [], threading.Event()

    def accept():
        while not done.is_set():
            with contextlib.suppress(socket.timeout):
                conn, peer = server.accept()
                connections.append(peer)
                conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], connections
    finally:
        done.set()
        thread.join()
        server.close()


def _offline_runs(wandb_dir, env: dict) -> list[list[dict]]:
    """The records of each offline W&B run in `wandb_dir`/wandb, read with wandb's own reader."""
    runs = []
    for run in sorted((wandb_dir / "wandb").glob("offline-run-*")):
        log = next(run.glob("run-*.wandb"))
        proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        runs.append([json.loads(line) for line in proc.stdout.splitlines()])
    return runs


def _of_type(records: list[dict], kind: str) -> list[dict]:
    return [r[kind] for r in records if r["type"] == kind]


def _scalars(record: dict, prefix: str = "") -> dict:
    """A metrics.jsonl record's numbers, nested keys joined with '/'."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out |= _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)):
            out[prefix + key] = value
    return out


@pytest.mark.slow
def test_preempted_and_resumed_run_is_one_offline_wandb_run(tmp_path, digits_dir, monkeypatch):
    """A run preempted as schedulers do it (SIGTERM to its whole process group, W&B's own service process
    included) stops at a stop check (exit 75) and, started again (to step 30) writes two offline pieces of one W&B
    run (the id kept in RUN_DIR/wandb-id): every scalar of metrics.jsonl, training and evaluation, in order;
    the resolved spec as config; the preemption marked and each exit code recorded. Files go to RUN_DIR/wandb
    by default and to WANDB_DIR when set. No connection reaches the W&B server or any HTTP(S) proxy."""
    from fsdpclip.run.directory import WANDB_ID_FILE

    for name in [name for name in os.environ if name.startswith("WANDB_")]:  # W&B settings: this test's own only
        monkeypatch.delenv(name)
    test_split = str(digits_dir / "test")
    job = {
        "run": {"name": "wb", "output_dir": str(tmp_path / "runs")},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32"},
        "schedule": {"steps": STEPS, "warmup_steps": 2},
        "data": {"source": "synthetic"},
        "batch": {"per_gpu": 32},  # steps slow enough that the signal lands before the last stop check
        "eval": {"zeroshot": [{"dataset": "digits", "path": test_split, "max_samples": 20}],
                 "retrieval": [{"path": test_split, "name": "digits", "max_samples": 20}], "batch_per_gpu": 16},
        "logging": {"every_steps": 1, "wandb": {"project": "fsdpclip-tests", "entity": "fsdpclip-team",
                                                "name": "preempted", "tags": ["ci"], "mode": "offline"}},
        "launch": {"gpus_per_node": 1, "device": "cpu"},
    }
    path = write_job(tmp_path, job)
    run_dir, elsewhere = tmp_path / "runs" / "wb", tmp_path / "wandb-dir"
    run_dir.mkdir(parents=True)
    with _listener() as (port, connections):
        url = f"http://127.0.0.1:{port}"
        env = {"WANDB_BASE_URL": url, "HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url,
               "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache")}
        train = [sys.executable, "-m", "fsdpclip.launch.entry", str(path)]
        first = _preempted(train, run_dir, env | {"FSDPCLIP_LAUNCH_TIME": str(time.time())})
        assert first.returncode == 75, first.stdout[-3000:]
        second = run_group(train, timeout=240, env=env | {"FSDPCLIP_LAUNCH_TIME": str(time.time()),
                                                          "WANDB_DIR": str(elsewhere)})
        assert second.returncode == 0, second.stdout[-3000:]
        assert connections == []
    reader_env = {**os.environ, **env}
    (stopped,), (resumed,) = _offline_runs(run_dir, reader_env), _offline_runs(elsewhere, reader_env)

    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    launches = [json.loads(p.read_text())["job"] for p in sorted((run_dir / "launches").glob("*.json"))]
    for records, spec in zip((stopped, resumed), launches):
        (run,) = _of_type(records, "run")
        assert run["run_id"] == run_id and run["project"] == "fsdpclip-tests" and run["display_name"] == "preempted"
        assert run["entity"] == "fsdpclip-team" and run["tags"] == ["ci"]
        assert {k: v for k, v in run["config"]["update"].items() if k != "_wandb"} == spec
    assert _of_type(stopped, "preempting") and not _of_type(resumed, "preempting")
    assert [e["exit_code"] for e in _of_type(stopped, "exit") + _of_type(resumed, "exit")] == [75, 0]

    logged = [{k: v for k, v in h["item"].items() if not k.startswith("_")}
              for h in _of_type(stopped, "history") + _of_type(resumed, "history")]
    records = [_scalars(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r.get("step") for r in records if "checkpoint_blocked_s" not in r]  # not the checkpoints' records
    assert steps == list(range(1, STEPS + 1)) + [STEPS]  # every step, then the evaluation
    assert logged == records
    evaluated = [r for r in logged if "zeroshot/digits/acc1" in r][-1]
    assert "retrieval/digits/image_retrieval_recall@1" in evaluated
    assert evaluated["retrieval/digits/samples"] == 20 and evaluated["retrieval/digits/texts"] == 40  # max_samples


def _preempted(command: list[str], run_dir, env: dict) -> subprocess.CompletedProcess:
    """Run `command` in its own process group and send SIGTERM to the whole group once a step is logged."""
    process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 180
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert process.poll() is None and time.time() < deadline, "the run ended or hung before its first step"
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def test_validate_names_a_missing_wandb(tiny_job, tmp_path, cli, monkeypatch):
    """Without the wandb package, a spec that logs to W&B fails validation at logging.wandb (naming the
    extra); with mode 'disabled' it is not needed."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    tiny_job["logging"] = {"wandb": {"project": "p", "mode": "offline"}}
    code, out = cli.validate_json(write_job(tmp_path, tiny_job))
    assert code == 2
    (error,) = [e for e in out["errors"] if e["location"] == "logging.wandb"]
    assert "wandb" in error["message"] and "fsdpclip[wandb]" in error["hint"]
    tiny_job["logging"]["wandb"]["mode"] = "disabled"
    code, out = cli.validate_json(write_job(tmp_path, tiny_job))
    assert code == 0, out["errors"]
