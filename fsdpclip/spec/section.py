"""The base of every spec block and the tagged union of blocks: what the spec's declarations and the
registered data sources and tower families (`fsdpclip.spec.registry`) declare their fields with. No torch."""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, ValidatorFunctionWrapHandler, field_validator


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
