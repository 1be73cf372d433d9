"""The package's layers, as pyproject.toml's import-linter contract states them: the contract holds and breaks on an
upward import, the modules the registries import by name lie as low as what looks them up, docs/architecture.md
pictures the contract, and what loads with the job spec and the launcher stays light."""

from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import subprocess
import sys

import grimp
import pytest

from conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PACKAGE = REPO / "fsdpclip"
ARCHITECTURE = REPO / "docs" / "architecture.md"
# The registry of each pluggable concern, in its protocol's module: their built-in modules are imported by name.
REGISTRIES = {"fsdpclip.jobspec.source": "DATA_SOURCES", "fsdpclip.jobspec.family": "TOWER_FAMILIES",
              "fsdpclip.jobspec.task": "EVAL_TASKS", "fsdpclip.jobspec.backend": "LAUNCHER_BACKENDS",
              "fsdpclip.jobspec.losses": "LOSSES"}


def contract() -> dict:
    """pyproject.toml's layers contract."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [entry for entry in config["contracts"] if entry["type"] == "layers"]
    return layers


def layer_packages() -> list[list[str]]:
    """The contract's layers, top to bottom, each as the names of its packages (or modules) in fsdpclip/."""
    return [[name.strip() for name in re.split(r"[|:]", layer)] for layer in contract()["layers"]]


def layer_of(module: str) -> int:
    """The index of the layer that holds `module` (a dotted name under fsdpclip), 0 the top."""
    top = module.split(".")[1]
    (index,) = [index for index, names in enumerate(layer_packages()) if top in names]
    return index


def lint_imports(root, config) -> subprocess.CompletedProcess:
    """`lint-imports` over the fsdpclip package found in `root`, with `config` (a pyproject.toml)."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", code, "--config", str(config), "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True)


def test_the_contract_covers_the_package_and_holds():
    layers = contract()
    assert layers["containers"] == ["fsdpclip"] and layers["exhaustive"] is True  # every subpackage in a layer
    result = lint_imports(REPO, REPO / "pyproject.toml")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("change", ["upward", "undeclared"])
def test_the_contract_breaks(tmp_path, change):
    """On a copy of the package: an import of a higher layer (inside a function: it counts too), and a subpackage
    in no layer."""
    shutil.copytree(PACKAGE, tmp_path / "fsdpclip", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    if change == "upward":
        with open(tmp_path / "fsdpclip" / "jobspec" / "problems.py", "a") as file:
            file.write("\n\ndef upward():\n    from fsdpclip.train.trainer import Trainer\n    return Trainer\n")
        expected = "fsdpclip.jobspec.problems -> fsdpclip.train.trainer"
    else:
        (tmp_path / "fsdpclip" / "extra").mkdir()
        (tmp_path / "fsdpclip" / "extra" / "__init__.py").write_text('"""In no layer."""\n')
        expected = "- fsdpclip.extra"
    result = lint_imports(tmp_path, tmp_path / "pyproject.toml")
    assert result.returncode != 0 and "0 kept, 1 broken" in result.stdout, result.stdout[-3000:] + result.stderr
    assert expected in result.stdout, result.stdout[-3000:]


def test_the_registries_built_in_modules_lie_at_or_below_what_looks_them_up():
    """import-linter sees the imports written out; a registry imports its built-in modules by name (the module
    names in its `built_in`). Those modules are the registry's users' code (a data source's `batches` runs in
    the trainer), so each lies in a layer at or below every module that looks the registry up, the foundations
    aside: they read the registries to declare and check the spec, and load the built-in modules as plugins (what
    those import when they load: the next tests)."""
    graph = grimp.build_graph("fsdpclip")
    bottom = len(layer_packages()) - 1
    wrong = []
    for registry_module, name in REGISTRIES.items():
        built_in = getattr(importlib.import_module(registry_module), name).built_in
        assert built_in, f"{registry_module}.{name} lists no built-in modules"
        users = graph.find_modules_that_directly_import(registry_module) - set(built_in)
        for module in built_in:
            if module not in graph.modules:
                wrong.append(f"{registry_module}.{name} names {module}, which fsdpclip does not have")
                continue
            wrong += [f"{user} (layer {layer_of(user)}) looks up {name}, whose built-in {module} is in the higher "
                      f"layer {layer_of(module)}" for user in sorted(users)
                      if layer_of(user) != bottom and layer_of(user) > layer_of(module)]
    assert not wrong, "\n".join(wrong)


def test_the_layer_table_pictures_the_contract():
    """docs/architecture.md's table under '## The layers' has one row per layer of the contract, in its order,
    naming the same packages."""
    section = ARCHITECTURE.read_text().split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|")]
    pictured = [re.findall(r"`(\w+)(?:/|\.py)`", row[1]) for row in rows[2:]]
    assert pictured == layer_packages(), f"the table's packages {pictured} are not the contract's {layer_packages()}"


def test_subpackages_load_nothing_when_imported():
    """A subpackage's __init__.py holds its docstring only, so that importing one module loads no other."""
    heavy = [f"fsdpclip/{path.relative_to(PACKAGE).as_posix()}" for path in PACKAGE.rglob("__init__.py")
             if path.parent != PACKAGE and any(not isinstance(node, ast.Expr) for node in ast.parse(path.read_text()).body)]
    assert not heavy, f"these __init__.py files hold more than a docstring: {', '.join(heavy)}"


def test_the_launcher_and_the_spec_load_without_torch():
    """What the architecture page says: the foundations (the spec, the registries, the run directory, the URLs), the
    launcher backends, the eval tasks' modules and every other module the registries load import no torch."""
    foundations = [path.relative_to(PACKAGE).with_suffix("").as_posix() for package in layer_packages()[-1]
                   for path in (PACKAGE / package).rglob("*.py") if path.name != "__init__.py"]
    assert "jobspec/job" in foundations and "run/directory" in foundations
    light = foundations + ["launch/launcher", "launch/local", "launch/slurm", "launch/hostfile", "launch/torchrun",
                           "eval/zeroshot", "eval/retrieval", "eval/validation", "data/sources/webdataset",
                           "data/sources/synthetic", "model/families/timm", "model/families/hf", "train/contrastive"]
    code = "import sys; " + "; ".join(f"import fsdpclip.{name.replace('/', '.')}" for name in light) + \
        "; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"importing {', '.join(light)} loads torch: {loaded.strip()[:300]}"


def test_the_modules_the_registries_load_do_not_load_the_job_spec():
    """The job spec is declared from the registries when it loads, which loads their built-in modules: one of them
    (or a module it imports) that imported the job spec as it loads would meet it half declared."""
    code = "import importlib, sys; " + "; ".join(
        f"from {module} import {name}; [importlib.import_module(m) for m in {name}.built_in]"
        for module, name in REGISTRIES.items()) + "; print('fsdpclip.jobspec.job' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (result.returncode, result.stdout.strip()) == (0, "False"), \
        f"a built-in module of a registry imports fsdpclip.jobspec.job when it loads: {result.stderr[-2000:]}"
