"""What the Trainer's parts (train/building, sizing, feeding, saving, evaluating, stops) read of one another
through `self`, declared once so that the type checker sees each part's reads; `train.trainer.Trainer` sets
them (and defines the methods through its parts)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from fsdpclip.checkpoint.sharded import Checkpointer
    from fsdpclip.model.build import OpenClip
    from fsdpclip.model.trainable import DecayGroup
    from fsdpclip.parallel.distributed import Dist
    from fsdpclip.plan.resolved import RunPlan
    from fsdpclip.run.lock import StartupClock
    from fsdpclip.spec.job import Job
    from fsdpclip.train.ema import ShardedEma
    from fsdpclip.train.metrics import MetricsLog
    from fsdpclip.train.optim import ShardedAdamW


class TrainerState:
    job: Job
    env: Dist
    signals: Any  # what tells the loop a stop signal came (`received`), or None
    startup: StartupClock
    model_config: dict
    checkpointer: Checkpointer
    tokenizer: Any
    model: OpenClip  # sharded
    decay_groups: list[DecayGroup]
    plan: RunPlan  # the run plan, settled as start-up goes on
    optimizer: ShardedAdamW
    scaler: Any  # train.optim.build_grad_scaler's, or None
    ema: Optional[ShardedEma]  # the `ema` block's moving average, or None
    async_saves: bool
    batches: Any  # the data source's batches (or train.feeding.HostedStreams), None until opened
    data_ranks: int
    shards: Optional[dict]
    step: int
    skipped_steps: torch.Tensor
    metrics: Optional[MetricsLog]

    if TYPE_CHECKING:
        def save(self, asynchronous: bool = False) -> Path: ...

        def _sample_counts(self) -> tuple[int, dict[str, int]]: ...

        def _raise_if_write_failed(self, writes: int) -> None: ...

        def _recorded_batch(self) -> Optional[tuple[int, int]]: ...

        def _open_batches(self, model: torch.nn.Module, start: bool, data_ranks: Optional[int] = None) -> None: ...

        def _close_batches(self) -> None: ...

        def _minutes_passed(self) -> int: ...
