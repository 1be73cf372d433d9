"""The one way to extend fsdpclip: a registry of named implementations per concern, and the plugins that add to them.

Each pluggable concern has a protocol class and a `Registry` of its implementations beside it, in this package:
data sources (`jobspec.source`), tower families (`jobspec.family`), eval tasks (`jobspec.task`), launcher backends
(`jobspec.backend`) and losses (`jobspec.losses`). An implementation is one module that subclasses the protocol,
declares its spec block (a `jobspec.section.Section`) and registers itself (`REGISTRY.register(...)`) when it loads.

A registry loads its built-in modules by name the first time it is read, and with them the plugins: the entry
points of the group `fsdpclip.plugins` (each a module that registers what it holds when imported, or a function
called with no arguments). The job spec (`fsdpclip.jobspec.job`) reads every registry once, when it is imported,
to declare the registered blocks; the registries are closed then, and a later registration is refused.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Generic, Iterator, TypeVar

from fsdpclip.jobspec.problems import closest

if TYPE_CHECKING:
    from fsdpclip.jobspec.section import Section

PLUGINS = "fsdpclip.plugins"  # the entry point group of plugins

T = TypeVar("T")


class RegistryError(Exception):
    """A registration or a lookup a registry refuses (message meant for the author of a plugin)."""


class Registry(Generic[T]):
    """The implementations of one concern by name: `what` says what they are in messages, `built_in` names the
    modules that register the built-in ones, `key` the attribute that names an implementation."""

    def __init__(self, what: str, built_in: tuple[str, ...], key: str = "name"):
        self.what, self.built_in, self.key = what, built_in, key
        self._members: dict[str, T] = {}
        self._loaded = self._closed = False

    def register(self, entry: T) -> T:
        """Add `entry` under its name; refused for a name another entry has, and once the job spec is assembled."""
        name = getattr(entry, self.key)
        if self._closed:
            raise RegistryError(f"{self.what} {name!r} is registered after fsdpclip assembled its job spec: register "
                                f"it from a plugin (an entry point of the group '{PLUGINS}'), or before "
                                "fsdpclip.jobspec.job is imported")
        if self._members.get(name, entry) is not entry:
            raise RegistryError(f"a {self.what} named {name!r} is registered already")
        self._members[name] = entry
        return entry

    def close(self) -> None:
        """Refuse registrations from now on (the job spec declared what is registered)."""
        self.members()
        self._closed = True

    def members(self) -> dict[str, T]:
        """Every implementation by name: the built-in ones in the order `built_in` lists their modules, then the
        plugins' in the order they registered."""
        if not self._loaded:
            self._loaded = True
            for module in self.built_in:
                importlib.import_module(module)
            load_plugins()
        order = {module: index for index, module in enumerate(self.built_in)}
        return dict(sorted(self._members.items(), key=lambda item: order.get(item[1].__module__, len(order))))

    def __getitem__(self, name: str) -> T:
        members = self.members()
        if name not in members:
            near = closest(name, members)
            raise RegistryError(f"no {self.what} is named {name!r}: " +
                                (f"did you mean {near!r}?" if near else f"known: {', '.join(members)}"))
        return members[name]

    def __iter__(self) -> Iterator[T]:
        return iter(self.members().values())

    def specs(self) -> dict[str, type[Section]]:
        """The spec blocks of the implementations that have one, by name."""
        return {name: spec for name, entry in self.members().items()
                if (spec := getattr(entry, "spec", None)) is not None}


_plugins_loaded = False


def load_plugins() -> None:
    """Import every plugin of the group `fsdpclip.plugins` once (a function is called as well)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for point in entry_points(group=PLUGINS):
        try:
            loaded = point.load()
            if callable(loaded):
                loaded()
        except Exception as exc:
            raise RegistryError(f"the fsdpclip plugin {point.name!r} ({point.value}) failed to load: "
                                f"{type(exc).__name__}: {exc}") from exc
