"""The throughput benchmark: fsdpclip beside a plain OpenCLIP step, per model and GPU count.

    python benchmarks/throughput.py --gpus 1 2 --cases ViT-B-32:256 ViT-B-32:512 ViT-L-14:128 ViT-L-14:256 \\
        ViT-H-14:64 ViT-bigG-14:32 --reference eager,compile --startup ViT-bigG-14:32 --out results/

For every GPU count and model (per-GPU batch): one torchrun process runs the reference (benchmarks/reference_step.py:
autocast bf16, fused AdamW; eager and whole-model compiled; DDP only at > 1 GPU) and fsdpclip's trainer side by side on
device-resident synthetic data (benchmarks/sidebyside.py). --startup cases also go through
`fsdpclip launch` to time launch → first step (eager; the default spec with a cold, then a warm compile cache). MFU is against the bf16 matmul rate measured
here first. Writes throughput.jsonl, throughput.json, throughput.md, throughput.png (÷ reference bars)
and scaling.png (samples/s per GPU against GPUs) under --out; --plot-only redraws the plots
from a saved throughput.json without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).resolve().parent


def matmul_peak_tflops(n: int = 8192, repeats: int = 20) -> float:
    """bf16 dense matmul rate of this GPU on random data (TFLOP/s)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    rate = 2 * n ** 3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return rate


def run(command: list[str], log: Path, timeout: float) -> int:
    """Run `command` with its output in `log`; past `timeout` seconds it and every process under it
    (torchrun, the ranks, data workers) are killed and -1 is returned."""
    from fsdpclip.launch.local import kill_tree

    env = {**os.environ, "FSDPCLIP_LAUNCH_TIME": repr(time.time())}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            process.wait()
            return -1


def side_by_side(model: str, batch: int, gpus: int, peak: float, args, rows: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               str(HERE / "sidebyside.py"), "--model", model, "--batch", str(batch), "--variants", args.variants,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--peak-tflops", str(peak),
               "--reference", args.reference, "--out", str(rows)]
    code = run(command, args.out / f"sidebyside-{model}-{gpus}gpu.log", args.timeout)
    if code != 0:
        print(f"{model} on {gpus} GPUs failed ({code}); see the log", flush=True)


# Launch → first step, each through `fsdpclip launch`: eager (compile off), then the default spec (compile
# 'auto') with an empty inductor cache and again with the cache that launch left (a relaunch, a requeue).
STARTUP_SIDES = (("eager", {"compile": False}, "startup-cache-eager"), ("default, cold cache", {}, "startup-cache"),
                 ("default, warm cache", {}, "startup-cache"))


def startup(model: str, batch: int, gpus: int, args) -> list[dict]:
    """Launch → first step (validation, rendezvous, build, compile, first step) per STARTUP_SIDES."""
    results = []
    for _, _, cache in STARTUP_SIDES:  # the cold side starts cold, also when --out is used again
        shutil.rmtree(args.out / cache, ignore_errors=True)
    for index, (side, fsdp, cache) in enumerate(STARTUP_SIDES):
        name = f"startup-{model}-{gpus}-{index}"
        shutil.rmtree(args.out / "runs" / name, ignore_errors=True)  # its compile-cache.bin and metrics too
        job = {"run": {"name": name, "output_dir": str(args.out / "runs")}, "model": {"name": model}, "fsdp": fsdp,
               "schedule": {"kind": "constant", "steps": 3}, "data": {"source": "synthetic"},
               "batch": {"per_gpu": batch}, "checkpoint": {"at_end": False}, "logging": {"every_steps": 1},
               "launch": {"gpus_per_node": gpus, "env": {"TORCHINDUCTOR_CACHE_DIR": str(args.out / cache)}}}
        spec = args.out / f"{name}.json"
        spec.write_text(json.dumps(job))
        began = time.time()
        code = run([sys.executable, "-m", "fsdpclip", "launch", str(spec)], args.out / f"{name}.log", args.timeout)
        row = {"model": model, "gpus": gpus, "side": side}
        if code != 0:
            results.append({**row, "error": f"exit {code}"})
            continue
        first = json.loads((args.out / "runs" / name / "metrics.jsonl").read_text().splitlines()[0])
        results.append({**row, "time_to_first_step_s": first["time_to_first_step_s"], "wall_s": time.time() - began,
                        "startup_s": first.get("startup_s")})
    return results


def markdown(rows: list[dict], starts: list[dict], peak: float) -> str:
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 matmul peak {peak:.0f} TFLOP/s; "
             "samples/s per GPU, MFU, peak memory per GPU (`torch.cuda.max_memory_allocated`)", "",
             "| model | batch/GPU | GPUs | side | samples/s/GPU | MFU | peak GiB | ÷ reference eager | ÷ reference compile "
             "| memory ÷ reference eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['batch_per_gpu']} | {row['gpus']} | {row['variant']} | "
                         f"{row['error']} | | | | | |")
            continue
        eager, compiled = (_reference(rows, row, kind) for kind in ("eager", "compile"))
        lines.append(f"| {row['model']} | {row['batch_per_gpu']} | {row['gpus']} | {row['variant']} | "
                     f"{row['samples_per_s_per_gpu']:.1f} | {row['mfu']:.1%} | {row['peak_memory_gib']:.1f} | "
                     f"{_ratio(row, eager, 'samples_per_s_per_gpu')} | {_ratio(row, compiled, 'samples_per_s_per_gpu')} | "
                     f"{_ratio(row, eager, 'peak_memory_gib')} |")
    if starts:
        lines += ["", "| model | GPUs | launch | launch → first step (fsdpclip launch) |", "|---|---|---|---|"]
        lines += [f"| {s['model']} | {s['gpus']} | {s['side']} | "
                  + (f"{s['time_to_first_step_s']:.1f} s |" if "error" not in s else f"{s['error']} |") for s in starts]
    return "\n".join(lines) + "\n"


def _reference(rows: list[dict], row: dict, kind: str) -> Optional[dict]:
    """The reference row ('eager' or 'compile') of `row`'s model, batch and GPUs (rows saved before the
    rename call it 'DDP KIND')."""
    return next((r for r in rows if _case(r) == _case(row) and r["gpus"] == row["gpus"] and "error" not in r
                 and r["variant"] in (f"reference {kind}", f"DDP {kind}")), None)


def _ratio(row: dict, reference: Optional[dict], key: str) -> str:
    return f"{row[key] / reference[key]:.2f}" if reference else ""


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(_case(r) for r in rows))
    sides = list(dict.fromkeys(r["variant"] for r in rows))
    gpu_counts = sorted({r["gpus"] for r in rows})
    figure, axes = plt.subplots(2, len(gpu_counts), figsize=(max(6, 1.5 * len(cases)) * len(gpu_counts), 8),
                                squeeze=False)
    for column, gpus in enumerate(gpu_counts):
        for line, (key, label) in enumerate([("samples_per_s_per_gpu", "samples/s per GPU ÷ reference"),
                                             ("peak_memory_gib", "peak memory ÷ reference")]):
            axis = axes[line][column]
            width = 0.8 / len(sides)
            for i, side in enumerate(sides):
                values = []
                for case in cases:
                    mine = [r for r in rows if _case(r) == case and r["gpus"] == gpus and r["variant"] == side
                            and key in r]
                    reference = _reference(rows, mine[0], "compile") or _reference(rows, mine[0], "eager") \
                        if mine else None
                    values.append(mine[0][key] / reference[key] if mine and reference and key in reference else 0)
                axis.bar([m + i * width for m in range(len(cases))], values, width, label=side)
            axis.axhline(1.0, color="black", linewidth=0.8)
            axis.set_xticks([m + width * (len(sides) - 1) / 2 for m in range(len(cases))], cases, fontsize=8)
            axis.set_title(f"{label} (compile, else eager), {gpus} GPU{'s' * (gpus > 1)}")
            axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _case(row: dict) -> str:
    """A bar group's label: the model and its batch per GPU."""
    return f"{row['model']}\n{row['batch_per_gpu']}/GPU"


def scaling_plot(rows: list[dict], path: Path) -> None:
    """samples/s per GPU against the number of GPUs, per model, fsdpclip beside the compiled reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(_case(r) for r in rows))
    figure, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.6), squeeze=False)
    for axis, case in zip(axes[0], cases):
        for sides, style in ((("reference compile", "DDP compile"), "o--"), (("fsdpclip",), "s-")):
            points = sorted((r["gpus"], r["samples_per_s_per_gpu"]) for r in rows
                            if _case(r) == case and r["variant"] in sides and "samples_per_s_per_gpu" in r)
            side = sides[0]
            if points:
                axis.plot(*zip(*points), style, label=side)
        axis.set_title(case.replace("\n", ", "))
        axis.set_xlabel("GPUs (one host)")
        axis.set_ylabel("samples/s per GPU")
        axis.set_xticks(sorted({r["gpus"] for r in rows}))
        axis.set_ylim(bottom=0)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cases", nargs="+", default=["ViT-B-32:256", "ViT-B-32:512", "ViT-L-14:128", "ViT-L-14:256",
                                                       "ViT-H-14:64", "ViT-bigG-14:32"],
                        help="MODEL:BATCH_PER_GPU; rows append to --out's throughput.jsonl, so cases can be run "
                             "in several calls and tabled together")
    parser.add_argument("--variants", default='{"fsdpclip": {}}', help="JSON: name -> the spec's fsdp block")
    parser.add_argument("--reference", default="eager,compile",
                        help="plain OpenCLIP steps beside it: eager, compile (whole model; DDP only at > 1 GPU)")
    parser.add_argument("--startup", nargs="*", default=[], help="cases also timed launch → first step")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot-only", type=Path, default=None,
                        help="redraw the plots of a saved throughput.json into --out (no GPU needed)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot_only is not None:
        rows = json.loads(args.plot_only.read_text())["rows"]
        plot(rows, args.out / "throughput.png")
        scaling_plot(rows, args.out / "scaling.png")
        return
    peak = matmul_peak_tflops()
    rows_file = args.out / "throughput.jsonl"
    for gpus in args.gpus:
        for case in args.cases:
            model, batch = case.split(":")
            side_by_side(model, int(batch), gpus, peak, args, rows_file)
    starts = []
    for case in args.startup:
        model, batch = case.split(":")
        starts += startup(model, int(batch), max(args.gpus), args)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
    (args.out / "throughput.json").write_text(json.dumps({"matmul_peak_tflops": peak, "rows": rows,
                                                          "startup": starts}, indent=2))
    table = markdown(rows, starts, peak)
    (args.out / "throughput.md").write_text(table)
    plot(rows, args.out / "throughput.png")
    scaling_plot(rows, args.out / "scaling.png")
    print(table)


if __name__ == "__main__":
    main()
