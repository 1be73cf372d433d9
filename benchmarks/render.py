"""docs/benchmarks.md and README.md's performance table, rendered from the result rows.

    python benchmarks/render.py            # rewrite both, and draw docs/benchmarks.png (matplotlib)
    python benchmarks/render.py --check    # exit 1 where either is not what the rows give

index.json names each table: its title, what it shows, the row files, the command that writes them, the
machine, the torch version and the date; and which rows README.md's table takes. The page and the README
table are only ever written from here, so a number changes in one place: its row file.

Row kinds: "sidebyside" (benchmarks/sidebyside.py's and throughput.py's JSON lines: one per side, the
ratio taken against the table's `reference` side of the same model and batch; `labels` shortens a
row's `variant` on the page), "run" (a run's metrics.jsonl: rates averaged over the log steps after the
first), "columns" (the fields `columns` names, one line per row) and "loss_curves"
(benchmarks/loss_curve.py's JSON). A "sidebyside" or "columns" table's `omit` leaves the rows of those variants
off the page (superseded designs; the row files keep them).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
README_BEGIN = "<!-- performance table: written by benchmarks/render.py from benchmarks/results -->"
README_END = "<!-- end of the performance table -->"
PLOT = ROOT / "docs" / "benchmarks.png"


def read_rows(name: str) -> list[dict]:
    """The JSON lines of one row file."""
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]


def number(value, digits: int = 1) -> str:
    """A rate or size: whole numbers from 1,000 on."""
    return "—" if value is None else f"{value:,.{0 if abs(value) >= 1000 else digits}f}"


def share(value) -> str:
    return "—" if value is None else f"{value:.1%}"


def label(table: dict, variant: str) -> str:
    """A row's side as the page names it (the table's `labels`, else the row's own `variant`)."""
    return table.get("labels", {}).get(variant, variant)


def table_rows(table: dict) -> list[dict]:
    """The rows of the table's files, but for the sides its `omit` leaves off the page (superseded designs)."""
    return [row for name in table["rows"] for row in read_rows(name) if row.get("variant") not in table.get("omit", ())]


def sidebyside(table: dict) -> tuple[list[str], list[list[str]]]:
    """One line per side, with its rate over the reference side's for the same model and batch."""
    rows = table_rows(table)
    reference = {(r["model"], r["batch_per_gpu"]): r["samples_per_s_per_gpu"]
                 for r in rows if r["variant"] == table["reference"]}
    lines = []
    for r in rows:
        base = reference.get((r["model"], r["batch_per_gpu"]))
        ratio = f"{r['samples_per_s_per_gpu'] / base:.2f}×" if base else "—"
        lines.append([r["model"], str(r["batch_per_gpu"]), label(table, r["variant"]),
                      number(r["samples_per_s_per_gpu"]), share(r.get("mfu")), number(r.get("peak_memory_gib")),
                      ratio])
    return ["model", "batch/GPU", "side", "samples/s/GPU", "MFU", "peak GiB",
            f"÷ {label(table, table['reference'])}"], lines


def columns(table: dict) -> tuple[list[str], list[list[str]]]:
    """The fields the table's `columns` names (field: heading), one line per row."""
    def cell(value) -> str:
        if isinstance(value, str):
            return label(table, value)
        if isinstance(value, int):
            return str(value)
        return number(value, 2) if isinstance(value, float) else "—"

    return list(table["columns"].values()), [[cell(row.get(field)) for field in table["columns"]]
                                             for row in table_rows(table)]


def run_summary(name: str) -> dict:
    """A run's rate, MFU, peak memory and launch → first step from its metrics.jsonl."""
    records = [r for r in read_rows(name) if "loss" in r]
    steady = records[1:] or records
    return {"samples_per_s_per_gpu": sum(r["samples_per_s_per_gpu"] for r in steady) / len(steady),
            "mfu": sum(r["mfu"] for r in steady) / len(steady),
            "peak_memory_gib": max(r["peak_memory_gib"] for r in records),
            "first_step_s": records[0].get("time_to_first_step_s"),
            "loss": (records[0]["loss"], records[-1]["loss"]), "steps": records[-1]["step"]}


def run(table: dict) -> tuple[list[str], list[list[str]]]:
    lines = []
    for name in table["rows"]:
        s = run_summary(name)
        lines.append([table["model"], str(table["gpus"]), number(s["samples_per_s_per_gpu"]), share(s["mfu"]),
                      number(s["peak_memory_gib"]), number(s["first_step_s"], 0),
                      f"{s['loss'][0]:.2f} → {s['loss'][1]:.2f} ({s['steps']} steps)"])
    return ["model", "GPUs", "samples/s/GPU (after the first log step)", "MFU", "peak GiB", "launch → first step, s",
            "loss"], lines


def loss_curves(table: dict) -> tuple[list[str], list[list[str]]]:
    """Per run: its first losses and how far it strays from the first run's in the first dozen steps."""
    curves = json.loads((RESULTS / table["rows"][0]).read_text())["losses"]
    first = next(iter(curves.values()))
    lines = []
    for name, losses in curves.items():
        gap = max(abs(a - b) for a, b in zip(losses[:12], first[:12]))
        lines.append([name, f"{losses[0]:.4f}", f"{sum(losses[:10]) / 10:.3f}", f"{losses[-1]:.3f}",
                      "—" if losses is first else f"{gap:.4f}"])
    return ["run", "loss at step 1", "mean of steps 1–10", f"step {len(first)}",
            f"largest |Δ| to {next(iter(curves))}, steps 1–12"], lines


KINDS = {"sidebyside": sidebyside, "run": run, "columns": columns, "loss_curves": loss_curves}


def markdown_table(header: list[str], lines: list[list[str]]) -> str:
    rows = [header, ["---"] * len(header), *lines]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in rows)


def render_page(index: dict) -> str:
    parts = [f"# Benchmarks\n\n{index['about']}\n\n![each side's rate over its table's reference]({PLOT.name})\n"]
    for table in index["tables"]:
        header, lines = KINDS[table["kind"]](table)
        rows = ", ".join(f"`benchmarks/results/{name}`" for name in table["rows"])
        parts.append(f"## {table['title']}\n\n{table['about']} Machine: {table['machine']}; torch {table['torch']}; "
                     f"rows of {table['date']}: {rows}.\n\n```sh\n{table['command']}\n```\n\n"
                     f"{markdown_table(header, lines)}\n")
        if table.get("notes"):
            parts.append(table["notes"] + "\n")
        if table.get("image"):
            parts.append(f"![{table['title']}]({table['image']})\n")
    return "\n".join(parts)


def readme_table(index: dict) -> str:
    """README.md's rows: fsdpclip's side of the chosen tables, each beside its reference."""
    tables = {table["id"]: table for table in index["tables"]}
    lines = []
    for pick in index["readme"]:
        table = tables[pick["table"]]
        if table["kind"] == "run":
            s = run_summary(table["rows"][0])
            lines.append([table["model"], f"{table['gpus']}×H200", number(s["samples_per_s_per_gpu"]), share(s["mfu"]),
                          number(s["peak_memory_gib"]), pick["versus"]])
            continue
        rows = [row for row in table_rows(table) if row["model"] == pick["model"]]
        ours = next(r for r in rows if r["variant"] == pick["side"])
        base = next(r for r in rows if r["variant"] == table["reference"])
        ratio = ours["samples_per_s_per_gpu"] / base["samples_per_s_per_gpu"]
        lines.append([f"{pick['model']}{pick.get('label', '')}, {ours['batch_per_gpu']}/GPU", f"{ours['gpus']}×H200",
                      number(ours["samples_per_s_per_gpu"]), share(ours.get("mfu")),
                      number(ours.get("peak_memory_gib")), f"{ratio:.2f}× {label(table, table['reference'])}"])
    header = ["model", "GPUs", "samples/s/GPU", "MFU", "peak GiB", "× reference (same machine)"]
    return f"{README_BEGIN}\n{markdown_table(header, lines)}\n{README_END}"


def render_readme(index: dict, readme: str) -> str:
    """README.md with its performance table replaced by the rows' one."""
    head, rest = readme.split(README_BEGIN, 1)
    return head + readme_table(index) + rest.split(README_END, 1)[1]


def draw(index: dict, out: Path) -> None:
    """One panel per side-by-side table: each side's samples/s/GPU over the reference's, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [t for t in index["tables"] if t["kind"] == "sidebyside"]
    fig, axes = plt.subplots(1, len(tables), figsize=(4.5 * len(tables), 3.6), squeeze=False)
    for ax, table in zip(axes[0], tables):
        _, lines = sidebyside(table)
        models = list(dict.fromkeys(line[0] for line in lines))
        sides = list(dict.fromkeys(line[2] for line in lines))
        width = 0.8 / len(sides)
        for i, side in enumerate(sides):
            ratios = {line[0]: float(line[6].rstrip("×")) for line in lines if line[2] == side and line[6] != "—"}
            ax.bar([m + i * width for m in range(len(models))], [ratios.get(model, 0) for model in models], width,
                   label=side)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks([m + width * (len(sides) - 1) / 2 for m in range(len(models))], models, fontsize=8)
        ax.set_title(f"{textwrap.fill(table['title'], 44)}, {table['date']}", fontsize=8)
        ax.set_ylabel(f"samples/s/GPU ÷ {table['reference']}", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def load_index() -> dict:
    return json.loads((RESULTS / "index.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 where out of date")
    args = parser.parse_args(argv)
    index = load_index()
    wanted = {PAGE: render_page(index), README: render_readme(index, README.read_text())}
    stale = [path for path, text in wanted.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is not what benchmarks/results gives: run python benchmarks/render.py")
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}")
    try:
        draw(index, PLOT)
        print(f"drew {PLOT.relative_to(ROOT)}")
    except ImportError:
        print("matplotlib is not installed: docs/benchmarks.png left as it is (pip install 'fsdpclip[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
