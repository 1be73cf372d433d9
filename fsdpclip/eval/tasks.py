"""Every eval task: the built-in ones (zero-shot classification, retrieval) and any registered since, and a set
loaded, measured and logged by its task. `fsdpclip eval`, evaluation during training, `validate` and the report
look tasks up here; a task itself imports only `eval.registry`. No torch when it loads.
"""

from __future__ import annotations

from typing import Callable, Optional

from fsdpclip.eval import registry
from fsdpclip.eval.registry import EvalTask
from fsdpclip.eval.retrieval import RetrievalTask
from fsdpclip.eval.zeroshot import ZeroShotTask

BUILT_IN = (ZeroShotTask, RetrievalTask)  # registered as their modules load


def eval_tasks() -> dict[str, EvalTask]:
    """Every eval task by kind: the built-in ones (zero-shot first) and any registered since."""
    return {task.kind: registry.TASKS[task.kind] for task in BUILT_IN} | registry.TASKS


def task_of(spec) -> EvalTask:
    """The task whose spec class `spec` is."""
    return next(task for task in eval_tasks().values() if isinstance(spec, task.spec))


def load_eval_set(spec, transform: Optional[Callable]):
    """The set a spec describes, loaded by its task."""
    return task_of(spec).load(spec, transform)


def evaluate_set(model, tokenizer: Callable, dataset, device, batch_size: int, workers: int = 2,
                 progress: Optional[Callable[[int], None]] = None) -> dict:
    """The metrics of a set, measured by its task (every rank calls it; every rank gets them)."""
    return eval_tasks()[dataset.kind].measure(model, tokenizer, dataset, device, batch_size, workers, progress)


def result_line(key: str, values: dict) -> str:
    """One evaluation result for the log: 'zero-shot digits: acc1 ...' or 'retrieval digits: ...' (key: KIND/NAME)."""
    kind, name = key.split("/", 1)
    return eval_tasks()[kind].line(name, values)
