"""The demo job (examples/tiny-cpu.json) through `fsdpclip launch`, shortened to 40 steps."""

from __future__ import annotations

import json
import re
import sys

from ranks import REPO, run_group


def test_demo_job_learns_digits(tmp_path, digits_dir):
    overrides = {
        "run.output_dir": str(tmp_path / "runs"),
        "schedule": json.dumps({"warmup_steps": 10, "steps": 40}),
        "data.urls": str(digits_dir / "train-{000000..000007}.tar"),
        "eval": json.dumps({"zeroshot": [{"dataset": "digits", "path": str(digits_dir / "test")}]}),
        "launch.collective_timeout_s": "60",
    }
    command = [sys.executable, "-m", "fsdpclip", "launch", str(REPO / "examples" / "tiny-cpu.json")]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    proc = run_group(command, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:]
    accuracy = float(re.search(r"zero-shot digits: acc1 ([0-9.]+)", proc.stdout).group(1))
    assert accuracy > 0.3  # chance is 0.1
    records = [json.loads(line) for line in (tmp_path / "runs" / "tiny-cpu" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert train[-1]["step"] == 40 and train[-1]["loss"] < train[0]["loss"]
    assert abs(records[-1]["zeroshot/digits"]["acc1"] - accuracy) < 1e-3
    for key in ("samples_per_s", "samples_per_s_per_gpu", "data_wait_fraction", "peak_memory_gib", "lr",
                "logit_scale", "samples_seen"):
        assert key in train[-1]
    assert "time_to_first_step_s" in train[0]
