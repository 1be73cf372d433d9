"""The sharded EMA against timm's ModelEmaV3 (the EMA open_clip main uses, and refuses under FSDP2)."""

from __future__ import annotations

import json

import pytest
from timm.utils.model_ema import ModelEmaV3
from torch import nn

from conftest import TINY_CONFIG, synthetic_job, write_job
from fsdpclip.optim.ema import ema_decay
from ranks import torchrun


@pytest.mark.parametrize("decay, start, warmup", [(0.9999, 0, False), (0.999, 5, False), (0.9999, 3, True),
                                                  (0.99, 0, True)])
def test_the_decay_of_each_step_is_timms(decay, start, warmup):
    reference = ModelEmaV3(nn.Linear(1, 1), decay=decay, update_after_step=start, use_warmup=warmup)
    for step in [0, 1, 2, 3, 4, 5, 6, 7, 10, 100, 10_000, 10**6]:
        assert ema_decay(step, decay, start, warmup) == pytest.approx(reference.get_decay(step), abs=0, rel=1e-15)


def test_the_first_update_copies_the_weights_where_updates_come_every_few_steps():
    """Updates every 4th step from step 0: the one after step 4 copies the weights (timm's rule would blend in the
    weights from before training with d), the one after step 8 averages with d."""
    import torch

    from fsdpclip.optim.ema import ShardedEma

    assert [ema_decay(step, 0.9, 0, False, 4) for step in (4, 8)] == [0.0, 0.9]
    assert ema_decay(8, 0.9, 0, True, 4) == pytest.approx(1 - 8 ** (-2 / 3))
    model = nn.Linear(2, 2)
    ema = ShardedEma(model, 0.9, every_steps=4)
    with torch.no_grad():
        for step in range(1, 9):
            model.weight.add_(1.0)
            ema.update(step)
            if step == 4:
                assert torch.equal(ema.averages["weight"], model.weight)
    assert torch.allclose(ema.averages["weight"], 0.9 * (model.weight - 4) + 0.1 * model.weight)


@pytest.mark.slow
@pytest.mark.parametrize("decay, every, start, warmup, steps", [(0.9, 1, 0, 0, 6), (0.99, 2, 3, 1, 9)])
def test_a_sharded_ema_on_two_ranks_is_timms_on_the_whole_model(decay, every, start, warmup, steps):
    """Uneven shards, a frozen layer (left out) and batch-norm statistics (averaged) on 2 CPU ranks; the averages
    gathered equal timm's within 1e-6, while they stand well apart from the weights themselves."""
    result = torchrun(["tests/workers/ema.py", str(decay), str(every), str(start), str(warmup), str(steps)])
    assert result.returncode == 0, result.stdout[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["names"] == ["1.bias", "1.running_mean", "1.running_var", "1.weight", "3.bias", "3.weight"]
    assert seen["difference"] <= 1e-6 < 1e-3 < seen["moved"]
    assert seen["swapped_in"] and seen["put_back"] and seen["frozen_untouched"]


@pytest.mark.slow
def test_the_trainers_average_skips_a_skipped_step_and_its_evaluation_puts_the_weights_back(tmp_path, digits_dir):
    """The real Trainer on 2 CPU ranks with an `ema` block (every 2nd step after step 1, timm's warmup), a frozen
    temperature and a non-finite gradient at step 4: its averages are timm's ModelEmaV3 on the gathered weights,
    updated after the steps the optimizer took, within 1e-6, and stand apart from a timm average that took the
    skipped step too. `eval.ema` evaluates the averages (the frozen temperature as trained), says so in
    metrics.jsonl, and leaves the weights trained bitwise as they were."""
    job = {"run": {"name": "ema", "output_dir": str(tmp_path / "runs"), "seed": 3},
           "model": {"config": str(TINY_CONFIG)}, "fsdp": {"param_dtype": "fp32"}, "freeze": {"logit_scale": True},
           "optimizer": {"lr": 5e-3}, "schedule": {"steps": 8}, "data": {"source": "synthetic"},
           "batch": {"per_gpu": 8}, "ema": {"decay": 0.9, "every_steps": 2, "start_step": 1, "warmup": True},
           "eval": {"zeroshot": [{"dataset": "digits", "path": str(digits_dir / "test"), "max_samples": 16}],
                    "batch_per_gpu": 8, "ema": True},
           "launch": {"gpus_per_node": 2, "device": "cpu", "collective_timeout_s": 60}}
    result = torchrun(["tests/workers/ema_training.py", str(write_job(tmp_path, job)), "4"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert "logit_scale" not in seen["names"] and "visual.conv1.weight" in seen["names"]
    assert seen["skipped_step_left_the_weights"] and seen["skipped_steps"] == 1
    assert seen["difference"] <= 1e-6 < 1e-4 < seen["apart_from_unskipped"]
    assert seen["moved"] > 1e-3
    assert seen["evaluated_the_averages"] and seen["evaluated_frozen_as_trained"]
    assert seen["weights_after_evaluation_bitwise"]
    assert seen["record"]["step"] == 8 and seen["record"]["weights"] == "ema"
    assert seen["record"]["zeroshot/digits"]["samples"] == 16


def test_the_ema_block_is_off_by_default_and_on_once_given(tmp_path):
    """`ema` is 'auto' (no average) unless given; `--set ema.decay=...` gives the block with timm's other defaults
    (every step, from the first, no warmup); 'auto' turns it off again; job.json keeps it as it was read."""
    from fsdpclip.jobspec.job import EmaSpec, Job
    from fsdpclip.jobspec.jobfile import load_job

    path = write_job(tmp_path, synthetic_job(tmp_path))
    assert load_job(path).ema == "auto" and load_job(path).moving_average is None
    on = load_job(path, ["ema.decay=0.999"])
    assert on.moving_average == EmaSpec(decay=0.999, every_steps=1, start_step=0, warmup=False)
    assert Job.model_validate_json(on.to_json()).moving_average == on.moving_average
    assert load_job(path, ["ema=auto"]).moving_average is None
