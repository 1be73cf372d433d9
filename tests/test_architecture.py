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
    """(layer, module names) per row of the table under '## The layers', top row first."""
    section = ARCHITECTURE.read_text().split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("layer", "") or set(cells[0]) <= set("-: "):
            continue
        rows.append((cells[0], re.findall(r"`([\w]+)\.py`", cells[1])))
    return rows


def package_imports(path) -> set[str]:
    """The package's modules that a module imports, at its top or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fsdpclip")):
            parts = (node.module or "").split(".")
            inner = parts[0] if node.level else (parts[1] if len(parts) > 1 else "")
            names |= {inner} if inner else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("fsdpclip.")}
    return names


def test_every_module_is_in_one_row_and_imports_only_downwards():
    rows = layer_table()
    assert rows, "docs/architecture.md has no layer table under '## The layers'"
    modules = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
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


def test_the_launcher_and_the_spec_load_without_torch():
    """What the architecture page says: the spec, the run directory, the launcher and the URLs import no torch."""
    light = [name for layer, names in layer_table() if layer == "foundations" for name in names
             if name != "distributed"] + ["launch", "torchrun"]
    code = "import sys; " + "; ".join(f"import fsdpclip.{name}" for name in light) + \
        "; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"importing {', '.join(light)} loads torch: {loaded.strip()[:300]}"
