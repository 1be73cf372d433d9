"""The sharded EMA against timm's ModelEmaV3 (the EMA open_clip main uses, and refuses under FSDP2)."""

from __future__ import annotations

import json

import pytest
from timm.utils.model_ema import ModelEmaV3
from torch import nn

from fsdpclip.train.ema import ema_decay
from ranks import torchrun


@pytest.mark.parametrize("decay, start, warmup", [(0.9999, 0, False), (0.999, 5, False), (0.9999, 3, True),
                                                  (0.99, 0, True)])
def test_the_decay_of_each_step_is_timms(decay, start, warmup):
    reference = ModelEmaV3(nn.Linear(1, 1), decay=decay, update_after_step=start, use_warmup=warmup)
    for step in [0, 1, 2, 3, 4, 5, 6, 7, 10, 100, 10_000, 10**6]:
        assert ema_decay(step, decay, start, warmup) == pytest.approx(reference.get_decay(step), abs=0, rel=1e-15)


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
