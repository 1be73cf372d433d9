"""Reading pickles without running code: checkpoints and weights are shared between people and copied
between clusters, so nothing fsdpclip reads may execute what a file asks for.

Torch files (our rank state, OpenCLIP weights) go through `torch.load(weights_only=True)`; DCP's
`.metadata` (a plain pickle) through an unpickler that admits only the classes DCP writes there;
the non-tensor values inside DCP's data files (the optimizer's hyperparameters), which DCP reads with
`weights_only=False`, through `torch.load(weights_only=True)` as well (`SafeLoadPlanner`). A refusal
is `PickleRefused`, naming the file and what its pickle names.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import pickletools
import re
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


# What to do with a weights file refused for what its pickle names.
NEEDS_CODE_HINT = "fsdpclip loads nothing that can run code: save the weights as a dict of tensors, or as safetensors"


class PickleRefused(pickle.UnpicklingError):
    """A pickle that names something it could run or build beyond plain data."""

    def __init__(self, where: str, name: str):
        super().__init__(f"{where} holds a pickle that names {name}: refusing to load it")


def _admitted(module: str, name: str) -> bool:
    """What DCP's metadata may name: its own metadata classes and enums, the filesystem's storage info,
    and the torch types they hold (sizes, dtypes, layouts by name, the checkpoint's path)."""
    if module == dcp_metadata.__name__:
        found = getattr(dcp_metadata, name, None)
        return isinstance(found, type) and found.__module__ == module
    if module == "torch.distributed.checkpoint.filesystem":
        return name == "_StorageInfo"
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    if module == "torch.serialization":
        return name == "_get_layout"  # a layout looked up by its name
    if module.split(".")[0] == "pathlib":  # pathlib._local on Python 3.13
        found = getattr(sys.modules.get(module), name, None)
        return isinstance(found, type) and issubclass(found, pathlib.PurePath)
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if not _admitted(module, name):
            raise PickleRefused(self.where, f"{module}.{name}")
        return super().find_class(module, name)


def read_dcp_metadata(path: Path, where: Optional[str] = None) -> dcp_metadata.Metadata:
    """A DCP `.metadata` file, admitting only DCP's metadata types; PickleRefused naming `where` (default:
    the path) otherwise."""
    where = where or str(path)
    with open(path, "rb") as file:
        found = _MetadataUnpickler(file, where).load()
    if not isinstance(found, dcp_metadata.Metadata):
        raise PickleRefused(where, type(found).__name__)
    return found


class SafeReader(FileSystemReader):
    """DCP's filesystem reader with its metadata read by `read_dcp_metadata`. Its `read_metadata` takes no
    rank: DCP then never falls back to a rank-local metadata file when the global one is refused."""

    def read_metadata(self) -> dcp_metadata.Metadata:
        metadata = read_dcp_metadata(Path(self.path) / ".metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading the non-tensor values of a checkpoint weights-only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = load_weights_only(value, f"the value of {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_weights_only(source, where: str, **kwargs: Any) -> Any:
    """`torch.load(source, weights_only=True)`; a refusal as PickleRefused naming `where` and the global."""
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        raise refusal(exc, where, source) or exc from None


def refusal(exc: BaseException, where: str, source=None) -> Optional[PickleRefused]:
    """A weights-only load's refusal of a global as PickleRefused, else None: the global torch names in its
    message, or, where it names none (a plain pickle of protocol 4 stops it at an opcode it lacks), the first
    global the pickle in `source` (a path or a binary file) names that torch would not admit."""
    if not isinstance(exc, pickle.UnpicklingError):
        return None
    named = re.search(r"GLOBAL ([\w.]+)", str(exc))
    name = named.group(1) if named else None if source is None else unadmitted_global(source)
    return PickleRefused(where, name) if name else None


def unadmitted_global(source) -> Optional[str]:
    """The first global a pickle names that torch's weights-only load does not admit, read from its opcodes
    (nothing is built or run); None where it names none or is no pickle."""
    from torch import _weights_only_unpickler

    admitted = set(_weights_only_unpickler._get_allowed_globals())  # torch's own list; it keeps no public one
    try:
        file = open(source, "rb") if isinstance(source, (str, Path)) else source
    except OSError:
        return None
    try:
        file.seek(0)
        pushed, memo = [], {}  # the values pushed (strings, else None), the memo's (STACK_GLOBAL takes two pushed)
        for opcode, argument, _ in pickletools.genops(file):
            if opcode.name == "GLOBAL":
                pushed.append(None)
                name = str(argument).replace(" ", ".", 1)
            elif opcode.name == "STACK_GLOBAL" and len(pushed) >= 2 and None not in pushed[-2:]:
                name = f"{pushed[-2]}.{pushed[-1]}"
            elif opcode.name == "MEMOIZE" and pushed:
                memo[len(memo)] = pushed[-1]
                continue
            elif opcode.name in ("PUT", "BINPUT", "LONG_BINPUT") and pushed:
                memo[argument] = pushed[-1]
                continue
            else:
                getting = opcode.name in ("GET", "BINGET", "LONG_BINGET")
                pushed.append(memo.get(argument) if getting else argument if isinstance(argument, str) else None)
                continue
            if name not in admitted:
                return name
    except (ValueError, EOFError, OSError):  # not a pickle, or one cut short
        return None
    finally:
        if file is not source:
            file.close()
    return None
