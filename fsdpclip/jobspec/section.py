"""The base of every spec block, the tagged union of blocks and the values written into launches: what the spec's
declarations and the registered implementations (`fsdpclip.jobspec.registry`) declare their fields with. No torch."""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Discriminator, Tag, ValidatorFunctionWrapHandler, WrapValidator,
    field_validator,
)


def json_kind_problem(raw: Any, parsed: Any) -> Optional[str]:
    """What a value pydantic read in `parsed` should have been, where its lax mode read `raw` as another JSON kind:
    a number from a string or from true/false, true/false from a string or a number (also inside lists, tuples
    and objects); None where every value kept its kind."""
    if isinstance(parsed, bool):
        return None if isinstance(raw, bool) else \
            f"expected true/false, not {'a string' if isinstance(raw, str) else 'a number'}"
    if isinstance(parsed, (int, float)):
        return "expected a number, not true/false" if isinstance(raw, bool) else \
            "expected a number, not a string: write it without quotes" if isinstance(raw, str) else None
    if isinstance(parsed, (list, tuple)) and isinstance(raw, (list, tuple)):
        return next(filter(None, map(json_kind_problem, raw, parsed)), None)
    if isinstance(parsed, dict) and isinstance(raw, dict):
        return next(filter(None, (json_kind_problem(raw[key], value) for key, value in parsed.items() if key in raw)),
                    None)
    return None


class Section(BaseModel):
    """Base of every spec block: unknown keys are errors, never ignored; numbers are finite (JSON's 1e400
    and Python's Infinity would reach the ranks as inf, and job.json as null); every value is of the JSON kind
    its field takes (no number in a string, no true/false for a number: pydantic's lax mode would convert them)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    @field_validator("*", mode="wrap")
    @classmethod
    def _json_kinds(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        parsed = handler(value)
        if problem := json_kind_problem(value, parsed):
            raise ValueError(problem)
        return parsed


def tagged_union(key: str, default: str, members: dict[str, type[BaseModel]]) -> Any:
    """A block that is one of `members`, chosen by its `key` field (`default` when absent)."""

    def tag(value: Any) -> str:
        return value.get(key, default) if isinstance(value, dict) else getattr(value, key, default)

    return Annotated[Union[tuple(Annotated[m, Tag(t)] for t, m in members.items())], Discriminator(tag)]


def auto_or_block(block: type[BaseModel]) -> Any:
    """'auto' (the feature off) or `block` given as an object: its own mistakes located inside it (`ema.decay`), as a
    tagged union has them, and any other value one error."""

    def tag(value: Any) -> str:
        return "block" if isinstance(value, (dict, block)) else "auto"

    def either(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if value != "auto" and not isinstance(value, (dict, block)):
            raise ValueError("expected 'auto' (off) or an object (the block)")
        return handler(value)

    return Annotated[Union[Annotated[Literal["auto"], Tag("auto")], Annotated[block, Tag("block")]],
                     Discriminator(tag), WrapValidator(either)]


def one_line(value: str) -> str:
    """Text written into the batch script as one line: a newline would start a new line (Slurm stops reading
    #SBATCH options at the first command, and a shell runs what follows), and no other control character is
    meant in a name, a path or a Slurm option."""
    found = next((c for c in value if unicodedata.category(c) == "Cc"), None)
    if found is not None:
        raise ValueError(f"contains the control character {found!r}: a value written into the batch script must be "
                         "one line of printable text")
    return value


OneLine = Annotated[str, AfterValidator(one_line)]


ENVIRONMENT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
OWN_ENVIRONMENT = "FSDPCLIP_"  # the launcher's own variables to its ranks (the lock token, the launcher's pid)


def environment_names(value: dict[str, str]) -> dict[str, str]:
    """Environment variables with names a shell can export (letters, digits, '_'; not a digit first), none of
    fsdpclip's own (a spec's lock token would let two jobs share a run directory)."""
    for name in value:
        if not ENVIRONMENT_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name (letters, digits and '_', not a "
                             "digit first)")
        if name.startswith(OWN_ENVIRONMENT):
            raise ValueError(f"{name!r}: {OWN_ENVIRONMENT}* variables are set by fsdpclip's launcher for its ranks, "
                             "not by a spec")
    return value
