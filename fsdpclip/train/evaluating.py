"""The trainer's evaluation hook: the spec's eval sets, run by every rank inside training."""

from __future__ import annotations


from fsdpclip.eval.task import evaluate_set, load_eval_set, result_line
from fsdpclip.model.build import image_transform
from fsdpclip.train.metrics import MetricsLog
from fsdpclip.train.state import TrainerState


class Evaluation(TrainerState):
    """The part of `Trainer` that evaluates during training."""

    def _evaluate_and_report(self, metrics: MetricsLog) -> None:
        results = self.evaluate()
        metrics.write({"step": self.step, **results})
        for key, values in results.items():
            metrics.announce(f"step {self.step} {result_line(key, values)}")

    def evaluate(self) -> dict[str, dict]:
        """Metrics per configured set, by 'zeroshot/NAME' or 'retrieval/NAME' (all ranks take part)."""
        if self.eval_sets is None:
            transform = image_transform(self.model, train=False)
            self.eval_sets = [load_eval_set(spec, transform) for spec in self.job.eval.sets]
        return {f"{s.kind}/{s.name}": evaluate_set(self.model, self.tokenizer, s, self.env.device,
                                                   self.job.eval.batch_per_gpu)
                for s in self.eval_sets}
