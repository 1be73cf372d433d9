"""A plugin installed as a user installs one, and fsdpclip run where it is installed.

`install` writes a distribution whose only content is an entry point of the group `fsdpclip.plugins` (here a
function of a test module, which registers what that module holds). Processes started with its environment
load the plugin before they assemble the job spec; this process keeps the spec as shipped. `PluginProcess` is
one such process that runs fsdpclip's commands in-process, as conftest's `Cli` does, and the functions it is
asked to call:

    python tests/plugins.py FD     (what `PluginProcess` starts: requests on stdin, replies on the file FD)
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

TESTS = Path(__file__).resolve().parent


def install(directory: Path, entry_point: str) -> dict[str, str]:
    """A distribution in `directory` with the entry point `entry_point` ('module:function') of the group
    `fsdpclip.plugins`: the environment of a process that finds it (and the test modules)."""
    info = directory / "fsdpclip_test_plugin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fsdpclip-test-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[fsdpclip.plugins]\ntest = {entry_point}\n")
    path = [str(directory), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


class PluginProcess:
    """A Python process with the environment `env` (`install`): `plugged(*args)` runs `fsdpclip ARGS` there (its
    exit code, output and stdout, as CliRunner gives them), `plugged.call("module:function", *args)` a function
    (arguments and result as JSON)."""

    def __init__(self, env: dict[str, str]):
        read, write = os.pipe()
        self.process = subprocess.Popen([sys.executable, __file__, str(write)], stdin=subprocess.PIPE, env=env,
                                        pass_fds=(write,), text=True)
        os.close(write)
        self.replies = os.fdopen(read)

    def _ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.replies.readline() or '{"error": "the plugin process ended"}')
        if "error" in reply:
            raise AssertionError(f"in the plugin process: {reply['error']}")
        return reply

    def __call__(self, *args) -> SimpleNamespace:
        return SimpleNamespace(**self._ask({"command": [str(a) for a in args]}))

    def validate_json(self, path: Path, *extra: str) -> tuple[int, dict]:
        result = self("validate", path, "--json", *extra)
        return result.exit_code, json.loads(result.stdout)

    def call(self, function: str, *args) -> Any:
        return self._ask({"call": function, "args": args})["value"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.replies.close()


def serve(replies) -> None:
    """Answer `PluginProcess`'s requests, one JSON line each, until stdin closes."""
    from typer.testing import CliRunner

    from fsdpclip.cli.commands import app

    for line in sys.stdin:
        request = json.loads(line)
        try:
            if "command" in request:
                result = CliRunner().invoke(app, request["command"])
                crash = result.exception if not isinstance(result.exception, (SystemExit, type(None))) else None
                reply = {"exit_code": result.exit_code, "output": result.output, "stdout": result.stdout,
                         "exception": "".join(traceback.format_exception(crash)) if crash else None}
            else:
                module, _, name = request["call"].partition(":")
                reply = {"value": getattr(importlib.import_module(module), name)(*request["args"])}
        except Exception:  # noqa: BLE001  (told to the test, which fails with it)
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    with os.fdopen(int(sys.argv[1]), "w") as replies:
        serve(replies)
