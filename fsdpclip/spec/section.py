"""The base of every spec block and the tagged union of blocks: what the spec's declarations and the
registered data sources and tower families (`fsdpclip.spec.registry`) declare their fields with. No torch."""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, ValidationInfo, field_validator


def _boolean_for_number(value: Any, annotation: Any) -> bool:
    """Whether `value` puts true/false where `annotation` takes a number and no boolean (pydantic would read
    true as 1), also inside lists, tuples and objects."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _boolean_for_number(value, args[0])
    if origin in (Union, types.UnionType):
        members = [get_args(a)[0] if get_origin(a) is Annotated else a for a in args]
        if isinstance(value, bool):
            return bool not in members and any(m in (int, float) for m in members)
        return any(_boolean_for_number(value, m) for m in members if get_origin(m) in (list, tuple, dict))
    if isinstance(value, bool):
        return annotation in (int, float)
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        items = args[:1] * len(value) if origin is list or args[-1:] == (Ellipsis,) else args
        return any(_boolean_for_number(item, kind) for item, kind in zip(value, items))
    if origin is dict and isinstance(value, dict):
        return any(_boolean_for_number(item, args[1]) for item in value.values())
    return False


class Section(BaseModel):
    """Base of every spec block: unknown keys are errors, never ignored; numbers are finite (JSON's 1e400
    and Python's Infinity would reach the ranks as inf, and job.json as null) and never true/false."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if _boolean_for_number(value, cls.model_fields[info.field_name].annotation):
            raise ValueError("expected a number, not true/false")
        return value



def tagged_union(key: str, default: str, members: dict[str, type[BaseModel]]) -> Any:
    """A block that is one of `members`, chosen by its `key` field (`default` when absent)."""

    def tag(value: Any) -> str:
        return value.get(key, default) if isinstance(value, dict) else getattr(value, key, default)

    return Annotated[Union[tuple(Annotated[m, Tag(t)] for t, m in members.items())], Discriminator(tag)]
