"""docs/architecture.md's layer table against the package: every module in one row, every import downwards."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from conftest import REPO

PACKAGE = REPO / "fsdpclip"
ARCHITECTURE = REPO / "docs" / "architecture.md"


def layer_table() -> list[tuple[str, list[str]]]:
    """(layer, module paths under fsdpclip/ such as 'train/trainer') per row of the table under '## The layers'."""
    section = ARCHITECTURE.read_text().split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("layer", "") or set(cells[0]) <= set("-: "):
            continue
        rows.append((cells[0], re.findall(r"`([\w/]+)\.py`", cells[1])))
    return rows


def package_modules() -> set[str]:
    """Every module of the package as its path under fsdpclip/ without '.py'; packages' __init__ files aside."""
    return {path.relative_to(PACKAGE).with_suffix("").as_posix() for path in PACKAGE.rglob("*.py")
            if path.name != "__init__.py"}


def package_imports(path) -> set[str]:
    """The package's modules (paths under fsdpclip/) that a module imports, at its top or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fsdpclip":
            inner = "/".join(node.module.split(".")[1:])
            if not inner or (PACKAGE / inner).is_dir():  # `from fsdpclip.train import trainer`: a module
                names |= {f"{inner}/{alias.name}".lstrip("/") for alias in node.names}
            else:
                names.add(inner)
        elif isinstance(node, ast.Import):
            names |= {"/".join(alias.name.split(".")[1:]) for alias in node.names
                      if alias.name.startswith("fsdpclip.")}
    return names


def test_every_module_is_in_one_row_and_imports_only_downwards():
    rows = layer_table()
    assert rows, "docs/architecture.md has no layer table under '## The layers'"
    modules = package_modules()
    layer_of: dict[str, int] = {}
    wrong = []
    for index, (layer, names) in enumerate(rows):
        for name in names:
            if name not in modules:
                wrong.append(f"row '{layer}' names {name}.py, which fsdpclip/ does not have")
            elif name in layer_of:
                wrong.append(f"{name}.py is in two rows: '{rows[layer_of[name]][0]}' and '{layer}'")
            else:
                layer_of[name] = index
    wrong += [f"fsdpclip/{name}.py is in no row of the layer table: add it to the row of its layer"
              for name in sorted(modules - set(layer_of))]
    for name in sorted(layer_of):
        for imported in sorted(package_imports(PACKAGE / f"{name}.py") & set(layer_of)):
            if layer_of[imported] < layer_of[name]:
                wrong.append(f"fsdpclip/{name}.py (row '{rows[layer_of[name]][0]}') imports {imported}.py of the "
                             f"higher row '{rows[layer_of[imported]][0]}'")
    assert not wrong, "docs/architecture.md's layer table is not the code's:\n" + "\n".join(wrong)


def test_subpackages_load_nothing_when_imported():
    """A subpackage's __init__.py holds its docstring only, so that importing one module loads no other."""
    heavy = [f"fsdpclip/{path.relative_to(PACKAGE).as_posix()}" for path in PACKAGE.rglob("__init__.py")
             if path.parent != PACKAGE and any(not isinstance(node, ast.Expr) for node in ast.parse(path.read_text()).body)]
    assert not heavy, f"these __init__.py files hold more than a docstring: {', '.join(heavy)}"


def test_the_launcher_and_the_spec_load_without_torch():
    """What the architecture page says: the spec, the run directory, the launcher backends, the URLs, the eval
    tasks' modules and every other module the registries load import no torch."""
    light = [name for layer, names in layer_table() if layer == "foundations" for name in names
             if name != "parallel/distributed"] + ["launch/launcher", "launch/local", "launch/slurm", "launch/hostfile",
                                                   "launch/torchrun", "eval/zeroshot", "eval/retrieval",
                                                   "eval/validation", "data/sources/webdataset", "data/sources/synthetic",
                                                   "model/families/timm", "model/families/hf", "train/contrastive"]
    code = "import sys; " + "; ".join(f"import fsdpclip.{name.replace('/', '.')}" for name in light) + \
        "; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"importing {', '.join(light)} loads torch: {loaded.strip()[:300]}"


def test_the_modules_the_registries_load_do_not_load_the_job_spec():
    """The job spec is declared from the registries when it loads, which loads their built-in modules: one of them
    (or a module it imports) that imported the job spec as it loads would meet it half declared."""
    registries = {"jobspec.source": "DATA_SOURCES", "jobspec.family": "TOWER_FAMILIES", "jobspec.task": "EVAL_TASKS",
                  "jobspec.backend": "LAUNCHER_BACKENDS", "jobspec.losses": "LOSSES"}
    code = "import importlib, sys; " + "; ".join(
        f"from fsdpclip.{module} import {name}; [importlib.import_module(m) for m in {name}.built_in]"
        for module, name in registries.items()) + "; print('fsdpclip.jobspec.job' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (result.returncode, result.stdout.strip()) == (0, "False"), \
        f"a built-in module of a registry imports fsdpclip.jobspec.job when it loads: {result.stderr[-2000:]}"
