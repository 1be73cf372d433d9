"""Reading a job file: its JSON, `--set` overrides, and pydantic's errors turned into `Problem`s
that name their JSON location (with a did-you-mean hint for unknown keys)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Annotated, Any, Optional

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from fsdpclip.problems import Problem, SpecError, closest
from fsdpclip.run.files import read_text_file
from fsdpclip.spec.job import LOSS_KINDS, Job
from fsdpclip.spec.registry import DATA_SOURCES


def read_job_dict(path: Path) -> dict:
    """Read a job file as a dict; a missing file or bad JSON is a SpecError."""
    try:
        text = read_text_file(Path(path))
    except OSError as exc:
        raise SpecError([Problem("(file)", f"cannot read job file: {exc.strerror}", value=str(path))]) from None
    repeated: dict[int, list[str]] = {}  # id of a parsed object -> its keys given more than once

    def keep_repeats(pairs: list[tuple[str, Any]]) -> dict:
        obj: dict = {}
        for key, value in pairs:
            if key in obj:
                repeated.setdefault(id(obj), []).append(key)
            obj[key] = value
        return obj

    try:
        raw = json.loads(text, object_pairs_hook=keep_repeats)
    except json.JSONDecodeError as exc:
        raise SpecError([Problem("(file)", f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
                                 value=str(path))]) from None
    except RecursionError:
        raise SpecError([Problem("(file)", "nested too deeply to be a job spec (a spec is a few levels deep)",
                                 value=str(path))]) from None
    if not isinstance(raw, dict):
        raise SpecError([Problem("(file)", "a job spec must be a JSON object", value=type(raw).__name__)])
    if repeated:
        try:
            problems = _repeated_keys(raw, repeated, [])
        except RecursionError:
            problems = [Problem("(file)", "nested too deeply to be a job spec (a spec is a few levels deep)")]
        raise SpecError(problems)
    return raw


def _repeated_keys(node: Any, repeated: dict[int, list[str]], path: list) -> list[Problem]:
    """A Problem for every key given twice in one object (JSON keeps the last silently)."""
    problems = []
    if isinstance(node, dict):
        for key in dict.fromkeys(repeated.get(id(node), [])):
            problems.append(Problem(_format_path([*path, key]), "key given more than once in one object: only the "
                                    "last would count", hint="keep one of them"))
        for key, value in node.items():
            problems += _repeated_keys(value, repeated, [*path, key])
    elif isinstance(node, list):
        for index, value in enumerate(node):
            problems += _repeated_keys(value, repeated, [*path, index])
    return problems


def apply_overrides(raw: dict, assignments: list[str]) -> dict:
    """Apply `a.b=value` overrides (value parsed as JSON, else taken as a string)."""
    raw = copy.deepcopy(raw)
    problems = []
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        if not sep or not key.strip():
            problems.append(Problem("--set", "expected KEY=VALUE with a dotted key, e.g. batch.per_gpu=64",
                                    value=assignment))
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node = raw
        *parents, leaf = key.strip().split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(Problem(key, f"cannot set a key inside '{part}', which is not an object",
                                        value=child))
                break
            node = child
        else:
            node[leaf] = value
    if problems:
        raise SpecError(problems)
    return raw


def parse_job(raw: dict) -> Job:
    """Validate a raw dict into a Job; every structural problem at once as a SpecError, which carries
    the sections that did parse (`SpecError.salvaged`) for the checks that need only them."""
    try:
        return Job.model_validate(raw)
    except ValidationError as exc:
        raise SpecError([_problem(error) for error in exc.errors()], salvaged=salvaged_job(raw)) from None


def salvaged_job(raw: dict) -> Job:
    """A Job holding only the top-level sections of `raw` that validate on their own (or their defaults
    where `raw` leaves them out). A section that did not parse is absent: reading it raises AttributeError."""
    sections, unparsed = {}, []
    for name, field in Job.model_fields.items():
        key = field.alias or name
        if key not in raw:
            continue
        try:
            sections[name] = TypeAdapter(Annotated[field.annotation, field]).validate_python(raw[key])
        except ValidationError:
            unparsed.append(name)
    job = Job.model_construct(**sections)
    for name in unparsed:  # model_construct gave them their defaults
        job.__dict__.pop(name, None)
    return job


def load_job(path: Path, overrides: Optional[list[str]] = None) -> Job:
    """Read, override and validate a job file."""
    return parse_job(apply_overrides(read_job_dict(path), overrides or []))


def _problem(error: dict) -> Problem:
    """Turn one pydantic error into a Problem with a JSON location and a hint."""
    path, model = _json_path(error["loc"])
    kind, message, value = error["type"], error["msg"], error.get("input")
    hint = None
    if kind == "extra_forbidden":
        known = list(model.model_fields) if model is not None else []
        aliases = [f.alias for f in model.model_fields.values() if f.alias] if model is not None else []
        message = "unknown key"
        value = path[-1] if path else value
        match = closest(str(value), known + aliases)
        hint = f"did you mean '{match}'?" if match else (f"known keys: {', '.join(known)}" if known else None)
    elif kind == "missing":
        message, value = "required key is missing", None
    elif kind == "union_tag_invalid":
        message = f"unknown {'data source' if path == ['data'] else 'kind'} '{error['ctx']['tag']}'"
        hint = f"one of {error['ctx']['expected_tags']}"
    elif kind == "value_error":
        message = message.removeprefix("Value error, ")
        value = None if isinstance(value, dict) else value
    elif kind == "literal_error":
        hint = message.replace("Input should be", "expected")
        message = "value not allowed"
    return Problem(_format_path(path), message, value=value, hint=hint)


def union_members() -> dict[str, dict[str, type[BaseModel]]]:
    """The members of the spec's tagged unions by field of `Job`: the registered data sources, the losses."""
    return {"data": DATA_SOURCES.specs(), "loss": LOSS_KINDS}


def spec_fields(model: type[BaseModel] = Job, prefix: str = "") -> dict[str, FieldInfo]:
    """Every leaf field of the spec by its dotted path (`[]` marks the members of a list of blocks); a field that
    several members of a union have (`data.samples`) is its default member's (the first)."""
    fields: dict[str, FieldInfo] = {}
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name)
        inner = model_in(field.annotation)
        if model is Job and name in union_members():
            for member in union_members()[name].values():
                fields = spec_fields(member, path + ".") | fields
        elif inner is None:
            fields[path] = field
        else:
            fields |= spec_fields(inner, path + ("[]." if "list" in str(field.annotation) else "."))
    return fields


def spelled_default(field: FieldInfo) -> str:
    """A field's default as a spec would spell it (JSON), or 'required'."""
    if field.is_required():
        return "required"
    return json.dumps(to_jsonable_python(field.get_default(call_default_factory=True)))


def _json_path(loc: tuple) -> tuple[list, Optional[type[BaseModel]]]:
    """Drop union tags from a pydantic location; return it with the model owning its last key."""
    model: Optional[type[BaseModel]] = Job
    path: list = []
    members: Optional[dict] = None
    for part in loc:
        if members is not None:
            model, members = members.get(part), None
            if model is not None:
                continue
        path.append(part)
        if model is None or isinstance(part, int) or part not in model.model_fields:
            continue
        if model is Job and part in union_members():
            members, model = union_members()[part], None
        else:
            model = model_in(model.model_fields[part].annotation)
    return path, model


def model_in(annotation: Any) -> Optional[type[BaseModel]]:
    """The pydantic model class inside an annotation such as Optional[X] or list[X]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = model_in(arg)
        if found is not None:
            return found
    return None


def _format_path(path: list) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(root)"
