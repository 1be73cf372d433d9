"""The trainer's evaluation (`Evaluator`): the spec's eval sets, run by every rank inside training (of the moving
average's weights with `eval.ema`)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from fsdpclip.jobspec.task import evaluate_set, load_eval_set, result_line
from fsdpclip.model.build import OpenClip, image_transform
from fsdpclip.jobspec.job import EvalSpec
from fsdpclip.optim.ema import ShardedEma
from fsdpclip.train.metrics import MetricsLog


class Evaluator:
    """Evaluates `model` on the sets of `spec` (eval), when they are due; the sets are loaded by their tasks at
    the first evaluation."""

    def __init__(self, model: OpenClip, tokenizer: Callable, spec: EvalSpec, device: torch.device,
                 averaged: Optional[ShardedEma] = None):
        """`averaged`: the moving average evaluated in the weights' place (eval.ema), or None."""
        self.model, self.tokenizer, self.spec, self.device, self.averaged = model, tokenizer, spec, device, averaged
        self.sets: Optional[list] = None

    def due(self, step: int, last: bool) -> bool:
        """Whether the sets are evaluated after `step` (`last`: the run's last): every eval.every_steps but the
        last step, and after the last one where eval.at_end."""
        every, at_end = self.spec.every_steps, self.spec.at_end
        return bool(self.spec.sets) and ((bool(every) and step % every == 0 and not last) or (last and at_end))

    def report(self, metrics: MetricsLog, step: int) -> None:
        """Evaluate, and write and announce the results as those of `step`: of the moving average's weights where
        it is given (so labelled, the trained weights put back after), else of the weights trained."""
        if self.averaged is not None:
            with self.averaged.swapped_in():
                results = self.evaluate()
            label, weights = "EMA ", {"weights": "ema"}
        else:
            results, label, weights = self.evaluate(), "", {}
        metrics.write({"step": step, **weights, **results})
        for key, values in results.items():
            metrics.announce(f"step {step} {label}{result_line(key, values)}")

    def evaluate(self) -> dict[str, dict]:
        """Metrics per configured set, by 'zeroshot/NAME' or 'retrieval/NAME' (all ranks take part)."""
        if self.sets is None:
            transform = image_transform(self.model, train=False)
            self.sets = [load_eval_set(spec, transform) for spec in self.spec.sets]
        return {f"{s.kind}/{s.name}": evaluate_set(self.model, self.tokenizer, s, self.device, self.spec.batch_per_gpu)
                for s in self.sets}
