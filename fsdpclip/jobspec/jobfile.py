"""Reading a job file: its JSON, `--set` overrides, and pydantic's errors turned into `Problem`s
that name their JSON location (with a did-you-mean hint for unknown keys)."""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, Discriminator, Tag, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from fsdpclip.jobspec.problems import Problem, SpecError, closest
from fsdpclip.run.files import read_text_file
from fsdpclip.jobspec.source import DATA_SOURCES
from fsdpclip.jobspec.job import Job
from fsdpclip.jobspec.section import Section
from fsdpclip.jobspec.losses import LOSSES


def read_job_dict(path: Path) -> tuple[dict, list[Problem]]:
    """Read a job file as a dict, with a Problem for each key given twice in one object (the dict keeps the
    last, as JSON does); a missing file or bad JSON is a SpecError."""
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
    if not repeated:
        return raw, []
    try:
        return raw, _repeated_keys(raw, repeated, [])
    except RecursionError:
        raise SpecError([Problem("(file)", "nested too deeply to be a job spec (a spec is a few levels deep)")]) \
            from None


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


def apply_overrides(raw: dict, assignments: list[str]) -> tuple[dict, list[Problem]]:
    """Apply `a.b=value` overrides (value parsed as JSON, else taken as a string): the dict with those that
    apply, and a Problem for each that does not."""
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
    return raw, problems


def parse_job(raw: dict) -> Job:
    """Validate a raw dict into a Job; every structural problem at once as a SpecError, which carries
    what did parse (`SpecError.salvaged`, `salvaged_job`) for the checks that need only that."""
    try:
        return Job.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(_problems(exc.errors(), raw), salvaged=salvaged_job(raw)) from None


def load_job(path: Path, overrides: Optional[list[str]] = None) -> Job:
    """Read, override and validate a job file: the problems of all three at once as one SpecError, with what
    parsed (keys given twice keep their last value, overrides that apply are applied)."""
    raw, problems = read_job_dict(path)
    raw, refused = apply_overrides(raw, overrides or [])
    problems += refused
    try:
        job = parse_job(raw)
    except SpecError as exc:
        raise SpecError(problems + exc.problems, salvaged=exc.salvaged) from None
    if problems:
        raise SpecError(problems, salvaged=job)
    return job


def salvaged_job(raw: dict) -> Optional[Job]:
    """The Job of what parses in `raw` (`_salvaged`): a section or field that did not parse raises AttributeError
    when read, so that a check reading it is skipped rather than run on a default."""
    holes: list[tuple[BaseModel, str]] = []
    job = _salvaged(Job, raw, holes)
    for section, name in holes:  # only now: the validators of the blocks around a section read it whole
        vars(section).pop(name, None)
    return job if isinstance(job, Job) else None


def _salvaged(model: type[BaseModel], raw: dict, holes: list[tuple[BaseModel, str]]) -> Optional[BaseModel]:
    """`model` validated from `raw` without the keys that fail (a block among them salvaged in turn, as far as
    its own fields parse), or None where the rest does not validate either (a rule over several fields). Each
    field left out is added to `holes`, (section, name), to be taken out of the section: its default stands in
    for it meanwhile. A block that only lacks required fields left out, and has no rule over several fields, is
    kept without them."""
    values, left_out = dict(raw), set()
    while True:
        try:
            section = model.model_validate(values)
            break
        except ValidationError as exc:
            failed = {str(error["loc"][0]) for error in exc.errors() if error["loc"]} - left_out  # field names
            if not failed:
                if not all(error["type"] == "missing" for error in exc.errors()) or \
                        model.__pydantic_decorators__.model_validators:
                    return None
                section = model.model_construct()
                for key, value in values.items():  # each validated as the model validates it
                    model.__pydantic_validator__.validate_assignment(section, _field_name(model, key) or key, value)
                break
        for key in failed:
            block = block_of(model, key, values.get(key))
            kept = _salvaged(block, values[key], holes) if block is not None else None
            if kept is None:
                values.pop(key, None)
                left_out.add(key)
            else:
                values[key] = kept
    holes += [(section, name) for key in left_out if (name := _field_name(model, key))]
    return section


def _field_name(model: type[BaseModel], key: str) -> Optional[str]:
    """The field of `model` a JSON key names (its alias or its name), None for an unknown key."""
    return next((name for name, field in model.model_fields.items() if key in (field.alias, name)), None)


def block_of(model: type[BaseModel], key: str, value: Any) -> Optional[type[BaseModel]]:
    """The spec block (a model) `value` is given as under `key` of `model`: a tagged union's member by the
    value's tag; None where it is no block."""
    name = _field_name(model, key)
    if name is None or not isinstance(value, dict):
        return None
    field = model.model_fields[name]
    found = _inner(field.annotation)
    if _is_union(found):
        tag = next((meta.discriminator(value) for meta in field.metadata
                    if isinstance(meta, Discriminator) and callable(meta.discriminator)), None)
        found = _member(found, tag)
    return found if isinstance(found, type) and issubclass(found, BaseModel) else None


def union_members() -> dict[str, dict[str, type[Section]]]:
    """The members of the spec's tagged unions by field of `Job`: the registered data sources and losses."""
    return {"data": DATA_SOURCES.specs(), "loss": LOSSES.specs()}


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


def model_in(annotation: Any) -> Optional[type[BaseModel]]:
    """The pydantic model class inside an annotation such as Optional[X] or list[X]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = model_in(arg)
        if found is not None:
            return found
    return None


def _inner(annotation: Any) -> Any:
    """The type inside Annotated[X, ...] and Optional[X]."""
    while True:
        if get_origin(annotation) is Annotated:
            annotation = get_args(annotation)[0]
        elif _is_union(annotation) and len(members := _members(annotation)) == 1:
            annotation = members[0]
        else:
            return annotation


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _members(union: Any) -> list:
    return [member for member in get_args(union) if member is not type(None)]


def _member(union: Any, tag: Any) -> Optional[type[BaseModel]]:
    """The member of a tagged union (`section.tagged_union`) with this tag; None for another tag or a plain union."""
    for member in _members(union):
        if get_origin(member) is Annotated and any(isinstance(meta, Tag) and meta.tag == tag
                                                   for meta in get_args(member)[1:]):
            return get_args(member)[0]
    return None


def _problems(errors: list, raw: dict) -> list[Problem]:
    """A Problem per pydantic error, but one per field where a value takes none of a plain union's forms (pydantic
    reports each form's error)."""
    problems, unions = [], set()
    for error in errors:
        path, model, union = _json_path(error["loc"])
        if union is None:
            problems.append(_problem(error, path, model))
        elif tuple(path) not in unions:
            unions.add(tuple(path))
            problems.append(Problem(_format_path(path), f"expected {' or '.join(map(_form, _members(union)))}",
                                    value=_value_at(raw, path)))
    return problems


def _problem(error: dict, path: list, model: Optional[type[BaseModel]]) -> Problem:
    """Turn one pydantic error at `path` (in `model`) into a Problem with a hint."""
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


def _json_path(loc: tuple) -> tuple[list, Optional[type[BaseModel]], Any]:
    """A pydantic location as a JSON path (without a tagged union's tag), the model owning its last key, and the
    plain union whose forms' errors it is (cut at the union's field), None where it is none."""
    path: list = []
    annotation: Any = Job
    model: Optional[type[BaseModel]] = Job
    for part in loc:
        kind = _inner(annotation)
        if _is_union(kind):
            annotation = _member(kind, part)
            if annotation is None:
                return path, model, kind
            continue
        path.append(part)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            name = _field_name(kind, part) if isinstance(part, str) else None
            model, annotation = kind, kind.model_fields[name].annotation if name else None
        else:
            annotation = _item(kind, part)
    return path, model, None


def _item(container: Any, part: Any) -> Any:
    """The annotation of the item `part` of a list, tuple or dict annotation; None for anything else."""
    origin, args = get_origin(container), get_args(container)
    if origin is dict:
        return args[1]
    if origin is list or (origin is tuple and args[-1:] == (Ellipsis,)):
        return args[0]
    if origin is tuple and isinstance(part, int) and part < len(args):
        return args[part]
    return None


def _form(member: Any) -> str:
    """A form of a plain union as a message names it."""
    member = _inner(member)
    if get_origin(member) is Literal:
        return " or ".join(map(repr, get_args(member)))
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}
    return names.get(member) or ("a list" if get_origin(member) in (list, tuple) else "an object")


def _value_at(raw: Any, path: list) -> Any:
    """The value at a JSON path of `raw`, None where it has none."""
    for part in path:
        try:
            raw = raw[part]
        except (KeyError, IndexError, TypeError):
            return None
    return raw


def _format_path(path: list) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(root)"
