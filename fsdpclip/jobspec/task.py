"""The eval task protocol and its registry (`fsdpclip.jobspec.registry`): what `fsdpclip eval`, evaluation during
training, `validate` and the report need of a kind of evaluation (zero-shot classification, image-text retrieval,
...), what every task shares (`DatasetError`, `without_grad`), and a set loaded, measured and logged by its task.

A task is one module (`eval/KIND.py`, or a plugin's) that subclasses `EvalTask`, declares the spec of one set (a
`Section` with a `label`) and ends with `EVAL_TASKS.register(Task())`; the spec's `eval` section lists its sets
under `eval.KIND`. Task modules import no torch when they load (their measuring does), so that the command line
can offer each task's flag without it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

from fsdpclip.jobspec.registry import Registry

if TYPE_CHECKING:
    from fsdpclip.jobspec.problems import Report


class DatasetError(Exception):
    """An evaluation dataset that is missing or laid out wrongly (message meant for the user)."""


class EvalTask:
    """One kind of evaluation.

    `kind` prefixes its results in metrics.jsonl ('zeroshot/NAME') and names its list in the spec's eval section
    (`eval.KIND`, described by `description`) and its option of `fsdpclip eval` (`--KIND VALUE`, VALUE a `metavar`
    or one of `choices`; `flag_help` that option's help, `usage` how the command's errors name it); `task` is
    CLIP_benchmark's name for its results; `title` how logs and tables name it; `spec` its spec class (one set to
    evaluate, with a `label`); `panel` the title of its curves in the report."""

    kind: ClassVar[str]
    task: ClassVar[str]
    title: ClassVar[str]
    spec: ClassVar[type]
    description: ClassVar[str]
    flag_help: ClassVar[str]
    metavar: ClassVar[str] = "VALUE"
    choices: ClassVar[Optional[tuple[str, ...]]] = None
    usage: ClassVar[str]
    panel: ClassVar[str]

    def spec_from_flags(self, value: str, data: Optional[str], classnames: Optional[str], templates: Optional[str],
                        max_samples: Optional[int]) -> Any:
        """The spec `fsdpclip eval --KIND VALUE` asks for, with the command's dataset options (ValueError: a flag
        this task does not take, or one it misses; pydantic's ValidationError: a value the spec refuses)."""
        raise NotImplementedError

    def flags(self, spec) -> list[str]:
        """The options of `fsdpclip eval` that evaluate `spec` (what `spec_from_flags` reads)."""
        raise NotImplementedError

    def check(self, spec, where: str, report: Report) -> None:
        """`validate`'s checks of one set that need no file (`where`: its JSON location, `eval.KIND[i]`)."""

    def check_paths(self, spec, where: str, report: Report) -> None:
        """`validate`'s checks of one set's files."""

    def paths(self, spec) -> tuple[str, ...]:
        """The fields of one set that hold local paths (see `jobspec.source.DataSource.paths`)."""
        return ()

    def load(self, spec, transform: Optional[Callable]):
        """The set a spec describes (`transform` None: its layout only, as `validate` reads it). The set has
        `name`, `kind` and `size` (images, None where unknown before reading)."""
        raise NotImplementedError

    def measure(self, model, tokenizer: Callable, dataset, device, batch_size: int, workers: int = 2,
                progress: Optional[Callable[[int], None]] = None) -> dict:
        """The metrics of a set, identical on every rank (every rank calls it), with its counts (`samples`, and
        `texts` where it embeds captions)."""
        raise NotImplementedError

    def line(self, name: str, values: dict) -> str:
        """One result for the log and the report."""
        raise NotImplementedError

    def curves(self, name: str, values: dict) -> dict[str, float]:
        """The report's points of one result: {curve label: value}."""
        raise NotImplementedError

    def table(self, metrics: dict) -> tuple[list[str], list[list[str]]]:
        """A result's scores as `fsdpclip eval` shows them: (columns, rows). Default: one row of every score."""
        return list(metrics), [[f"{v:.4f}" for v in metrics.values()]]

    def notes(self, record: dict) -> list[str]:
        """What `fsdpclip eval` says beside a result (plain text)."""
        return []


def without_grad(measure: Callable) -> Callable:
    """`measure` run under torch.no_grad() (torch imported when it runs, not when its module loads)."""

    @functools.wraps(measure)
    def run(*args, **kwargs):
        import torch

        with torch.no_grad():
            return measure(*args, **kwargs)

    return run


EVAL_TASKS: Registry[EvalTask] = Registry("eval task", ("fsdpclip.eval.zeroshot", "fsdpclip.eval.retrieval",
                                                         "fsdpclip.eval.validation"), key="kind")


def task_of(spec) -> EvalTask:
    """The task whose spec class `spec` is."""
    return next(task for task in EVAL_TASKS if isinstance(spec, task.spec))


def load_eval_set(spec, transform: Optional[Callable]):
    """The set a spec describes, loaded by its task."""
    return task_of(spec).load(spec, transform)


def evaluate_set(model, tokenizer: Callable, dataset, device, batch_size: int, workers: int = 2,
                 progress: Optional[Callable[[int], None]] = None) -> dict:
    """The metrics of a set, measured by its task (every rank calls it; every rank gets them)."""
    return EVAL_TASKS[dataset.kind].measure(model, tokenizer, dataset, device, batch_size, workers, progress)


def result_line(key: str, values: dict) -> str:
    """One evaluation result for the log: 'zero-shot digits: acc1 ...' or 'retrieval digits: ...' (key: KIND/NAME)."""
    kind, name = key.split("/", 1)
    return EVAL_TASKS[kind].line(name, values)
