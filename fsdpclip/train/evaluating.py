"""The trainer's evaluation hook: the spec's eval sets, run by every rank inside training (of the moving average's
weights with `eval.ema`)."""

from __future__ import annotations

from fsdpclip.eval.task import evaluate_set, load_eval_set, result_line
from fsdpclip.model.build import image_transform
from fsdpclip.train.metrics import MetricsLog
from fsdpclip.train.state import TrainerState


class Evaluation(TrainerState):
    """The part of `Trainer` that evaluates during training."""

    def _evaluate_and_report(self, metrics: MetricsLog) -> None:
        """The eval sets measured and logged: of the moving average's weights with `eval.ema` (so labelled, the
        training weights put back after), else of the weights trained."""
        if self.job.eval.ema:
            assert self.ema is not None  # validate refuses eval.ema without an `ema` block
            with self.ema.swapped_in():
                results = self.evaluate()
            label, weights = "EMA ", {"weights": "ema"}
        else:
            results, label, weights = self.evaluate(), "", {}
        metrics.write({"step": self.step, **weights, **results})
        for key, values in results.items():
            metrics.announce(f"step {self.step} {label}{result_line(key, values)}")

    def evaluate(self) -> dict[str, dict]:
        """Metrics per configured set, by 'zeroshot/NAME' or 'retrieval/NAME' (all ranks take part)."""
        if self.eval_sets is None:
            transform = image_transform(self.model, train=False)
            self.eval_sets = [load_eval_set(spec, transform) for spec in self.job.eval.sets]
        return {f"{s.kind}/{s.name}": evaluate_set(self.model, self.tokenizer, s, self.env.device,
                                                   self.job.eval.batch_per_gpu)
                for s in self.eval_sets}
