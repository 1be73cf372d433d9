"""The declared lower bounds of fsdpclip's pure-Python dependencies, one `name==version` a line, read from
pyproject.toml (so that `make test-floor` installs what the project declares; torch and torchvision are left to
the main environment, which builds them for its machine)."""

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

NOT_PURE_PYTHON = {"torch", "torchvision"}
overrides = dict(arg.split("==", 1) for arg in sys.argv[1:])  # name==version: try another floor than the declared

dependencies = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["dependencies"]
for requirement in dependencies:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][A-Za-z0-9.]*)", requirement)
    if match is None:
        if re.fullmatch(r"[A-Za-z0-9_.-]+", requirement) and requirement not in NOT_PURE_PYTHON:
            sys.exit(f"{requirement}: no lower bound to test (declare one with >=)")
        continue
    name, version = match.groups()
    if name not in NOT_PURE_PYTHON:
        print(f"{name}=={overrides.get(name, version)}")
