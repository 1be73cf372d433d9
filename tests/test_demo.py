"""The demo job (examples/tiny-cpu.json) through `fsdpclip launch`, shortened to 40 steps (conftest)."""

from __future__ import annotations

import json
import re


def test_demo_job_learns_digits(demo_run):
    run_dir, output = demo_run
    accuracy = float(re.findall(r"step 40 zero-shot digits: acc1 ([0-9.]+)", output)[-1])
    assert accuracy > 0.3  # chance is 0.1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert train[-1]["step"] == 40 and train[-1]["loss"] < train[0]["loss"]
    assert abs(records[-1]["zeroshot/digits"]["acc1"] - accuracy) < 1e-3
    assert [r["step"] for r in records if "zeroshot/digits" in r] == [20, 40]  # eval.every_steps and at_end
    for key in ("samples_per_s", "samples_per_s_per_gpu", "data_wait_fraction", "peak_memory_gib", "lr",
                "logit_scale", "samples_seen"):
        assert key in train[-1]
    assert "time_to_first_step_s" in train[0]
