"""Problems found in a job: where (JSON location), what, the bad value and a hint."""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Optional

from fsdpclip.jobspec.urls import is_local, local_path

# Ranks (GPUs) of one job, in a spec or a command-line flag: far beyond any cluster, few enough to count through.
MAX_WORLD_SIZE = 2 ** 20


@dataclass(frozen=True)
class Problem:
    """One mistake in a job spec, located by its JSON path (e.g. `fsdp.wrap.image[1]`). A long value is
    kept shortened: a message quotes what it needs, never megabytes of the user's input."""

    location: str
    message: str
    value: Any = None
    hint: Optional[str] = None
    severity: Literal["error", "warning"] = "error"

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", shorten(self.value))

    def as_dict(self) -> dict:
        out = asdict(self)
        out["value"] = _jsonable(self.value)
        return out

    def __str__(self) -> str:
        text = f"{self.location}: {self.message}"
        if self.value is not None:
            text += f" (got {self.value!r})"
        if self.hint:
            text += f"; {self.hint}"
        return text


@dataclass
class Report:
    """Problems found, and what was learned about the job on the way."""

    world_size: int
    gpus_per_node: int
    problems: list[Problem] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    def error(self, location: str, message: str, value=None, hint: Optional[str] = None) -> None:
        self.problems.append(Problem(location, message, value, hint))

    def warn(self, location: str, message: str, value=None, hint: Optional[str] = None) -> None:
        self.problems.append(Problem(location, message, value, hint, severity="warning"))

    def missing(self, location: str, message: str, path: str, hint: Optional[str] = None) -> None:
        """An error for a path that is not there; a relative one also says where it was looked for."""
        self.error(location, message, path, joined(hint, relative_path_hint(path)))


def relative_path_hint(path: Any) -> Optional[str]:
    """Where a relative local path that is not there was looked for: every command reads a spec's relative paths
    from the directory it runs in (`launch` writes them absolute into the run's job.json). None for anything else
    (an absolute path, a URL, a path that is there)."""
    if not isinstance(path, str) or not path or not is_local(path):
        return None
    local = Path(local_path(path))
    if local.is_absolute() or local.exists():
        return None
    return f"a relative path starts at the directory fsdpclip runs in ({Path.cwd()}), not at the spec's"


def joined(*hints: Optional[str]) -> Optional[str]:
    """Hints given, as one."""
    return "; ".join(hint for hint in hints if hint) or None


class SpecError(Exception):
    """A job spec that cannot be used; carries every problem found and, where the spec parsed in part, a
    Job of the sections that did (`jobfile.salvaged_job`)."""

    def __init__(self, problems: list[Problem], salvaged: Any = None):
        self.problems, self.salvaged = problems, salvaged
        super().__init__("\n".join(str(p) for p in problems))


class ModelError(Exception):
    """A model that cannot be built from the spec (message meant for the user), with the JSON
    location to blame where one is known."""

    def __init__(self, message: str, location: Optional[str] = None, value: Any = None, hint: Optional[str] = None):
        super().__init__(message)
        self.message, self.location, self.value, self.hint = message, location, value, hint


SHORT = 200  # characters of a value shown in a message


def shorten(value: Any) -> Any:
    """A value as a message may show it: long strings and large containers cut, with their size."""
    if isinstance(value, str) and len(value) > SHORT:
        return f"{value[:SHORT // 2]}… ({len(value):,} characters)"
    if isinstance(value, (list, tuple, dict)):
        text = repr(value) if len(value) <= 1000 else ""
        if not text or len(text) > SHORT:
            return f"{type(value).__name__} of {len(value):,} items"
    return value


def closest(word: str, candidates: Iterable[str], n: int = 1, cutoff: float = 0.6) -> Optional[str]:
    """The closest candidate to `word`, or None; several with n > 1, joined by ', '. Words much longer
    than any name are nobody's typo (and would make the comparison slow)."""
    if len(word) > SHORT:
        return None
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    matches = difflib.get_close_matches(word.lower(), list(lowered), n=n, cutoff=cutoff)
    if not matches:
        return None
    return ", ".join(lowered[m] for m in matches)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)
