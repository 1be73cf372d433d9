"""What every command prints with: the consoles, problems as a table or JSON, one-line stops, and options read
from a registry (a launcher backend's flag, an eval task's) when the command line is built."""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fsdpclip.jobspec.problems import ModelError, Problem
from fsdpclip.run.files import special_file

# Logs and pipes get wide lines (rich would wrap them at 80 columns); terminals keep their width.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

USER_ERROR = 2


def fail(problems: list[Problem], as_json: bool = False) -> NoReturn:
    """Show problems (table or JSON) and exit with the user-error code."""
    if as_json:
        print(json.dumps({"ok": False, "errors": [p.as_dict() for p in problems if p.severity == "error"],
                          "warnings": [p.as_dict() for p in problems if p.severity == "warning"]}, indent=2))
    else:
        problem_table(problems, err_console)
    raise typer.Exit(USER_ERROR)


def stop(message: str) -> NoReturn:
    """A mistake outside any spec (a path, a checkpoint): one line, the user-error code."""
    err_console.print(f"[red]✗[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(USER_ERROR)


def check_destination(path: Path, overwrite: bool = True) -> None:
    """A file a command writes once its work is done, tried first: its folder made and the file opened for appending
    (a file this made is removed again); one line and the user-error code when it cannot be written, when it is no
    regular file (a FIFO would block the opening, a device take the result) or a dangling symlink (the write would
    make its target), or when it exists and `overwrite` is false."""
    if path.is_symlink() and not path.exists():
        stop(f"cannot write {path}: a symlink to {os.readlink(path)}, which does not exist")
    if kind := special_file(path):
        stop(f"cannot write {path}: not a regular file but {kind}")
    existed = path.exists()
    if existed and not overwrite:
        stop(f"{path} exists: give another path, or --force to overwrite it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        stop(f"cannot write {path}: {path.parent} is not a directory")
    except OSError as exc:
        stop(f"cannot write {path}: {exc.strerror or exc}")
    try:
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        stop(f"cannot write {path}: {exc.strerror or exc}")


def problem_table(problems: list[Problem], out: Console) -> None:
    errors = sum(p.severity == "error" for p in problems)
    title = f"{errors} error{'s' * (errors != 1)}" if errors else "warnings"
    table = Table(title=title, title_style="bold red" if errors else "bold yellow", show_lines=False)
    for column in ("", "location", "problem", "value", "hint"):
        table.add_column(column, overflow="fold")
    for p in problems:
        mark = "[red]✗[/red]" if p.severity == "error" else "[yellow]![/yellow]"
        value = "" if p.value is None else repr(p.value)
        table.add_row(mark, *(escape(text) for text in (p.location, p.message, value, p.hint or "")))
    out.print(table)


def model_error_line(exc: ModelError) -> str:
    """A ModelError as one line, its hint after it (plain text: `stop` escapes it)."""
    return exc.message + (f"; {exc.hint}" if exc.hint else "")


def option(name: str, annotation, default: typer.models.OptionInfo) -> inspect.Parameter:
    """One option of `WithRegisteredOptions`: its parameter name, type and typer.Option."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


class WithRegisteredOptions:
    """A command whose options include those a registry declares, read each time Typer builds the command line
    (whenever the app runs), so that a backend or task registered after this module loaded has its flag too.
    `options()` gives them (`option`), placed after the parameter named `after`; the command takes them as
    keyword arguments (`**registered`)."""

    def __init__(self, command: Callable, options: Callable[[], list[inspect.Parameter]], after: str):
        self.__wrapped__, self.options, self.after = command, options, after
        self.__name__, self.__module__, self.__doc__ = command.__name__, command.__module__, command.__doc__
        self.__annotations__ = command.__annotations__

    @property
    def __signature__(self) -> inspect.Signature:
        own = [p for p in inspect.signature(self.__wrapped__, eval_str=True).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]
        at = [p.name for p in own].index(self.after) + 1
        keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own[at:]]
        return inspect.Signature([*own[:at], *self.options(), *keyword])

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)
