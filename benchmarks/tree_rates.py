"""Training rate of one job launched from two source trees, alternating: does a change of the tree cost speed?

    python benchmarks/tree_rates.py --out /tmp/rates --trees before=/tmp/old-tree after=. \\
        --case ViT-B-32:256:300 --case ViT-L-14:128:150

For each case (model:batch per GPU:steps) runs `fsdpclip launch` of the same job (synthetic data, constant
schedule, no checkpoint, metrics every 10 steps, one GPU) from each tree in the order given, then in the
reverse order (A B B A), so that a drift of the machine does not favour one tree. Each tree is the working
directory and first on PYTHONPATH of its own launch. One JSON line per launch on stdout and in
OUT/tree_rates.jsonl: the median `samples_per_s_per_gpu` and `mfu` of the records after --skip steps
(compile and warm-up), the first step's time, the exit code. The first launch also fills the compile cache
the others reuse, so compare first-step times only between the later launches. `--device cpu --case
examples/models/tiny-clip.json:8:40` checks the script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def job_spec(name: str, model: str, batch: int, steps: int, runs: Path, device: str) -> dict:
    model_spec = {"config": str(Path(model).resolve())} if model.endswith(".json") else {"name": model}
    return {"run": {"name": name, "output_dir": str(runs)}, "model": model_spec,
            "schedule": {"kind": "constant", "steps": steps}, "data": {"source": "synthetic"},
            "batch": {"per_gpu": batch}, "logging": {"every_steps": 10},
            "checkpoint": {"at_end": False, "resume": None}, "launch": {"gpus_per_node": 1, "device": device}}


def launch(tree: Path, spec: Path, run_dir: Path, skip: int) -> dict:
    """One launch from `tree`: its exit code, median rate and MFU after `skip` steps, first-step time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fsdpclip", "launch", str(spec.resolve())], cwd=tree, env=env,
                          capture_output=True, text=True)
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [r for r in records if "loss" in r and r["step"] > skip]
    mfus = [r["mfu"] for r in steps if r.get("mfu") is not None]  # none where the device's peak is unknown
    row = {"exit": done.returncode, "launch_s": round(time.monotonic() - began, 1),
           "samples_per_s_per_gpu": statistics.median(r["samples_per_s_per_gpu"] for r in steps) if steps else None,
           "mfu": statistics.median(mfus) if mfus else None,
           "first_step_s": next((r["time_to_first_step_s"] for r in records if "time_to_first_step_s" in r), None)}
    if done.returncode:
        row["tail"] = (done.stdout + done.stderr)[-1500:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trees", nargs="+", required=True, help="LABEL=DIR, in the order of the first round")
    parser.add_argument("--case", action="append", required=True, help="MODEL:BATCH_PER_GPU:STEPS")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu with a model config file to check the script")
    parser.add_argument("--skip", type=int, default=30, help="steps left out of the median (compile, warm-up)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trees = [(label, Path(tree).resolve()) for label, tree in (t.split("=", 1) for t in args.trees)]
    for case in args.case:
        model, batch, steps = case.split(":")
        for launch_index, (label, tree) in enumerate(trees + trees[::-1]):
            name = f"{Path(model).stem}-{label}-{launch_index}"
            spec = args.out / f"{name}.json"
            spec.write_text(json.dumps(job_spec(name, model, int(batch), int(steps), args.out / "runs", args.device)))
            row = {"model": model, "batch_per_gpu": int(batch), "gpus": 1, "tree": label, "launch": launch_index,
                   **launch(tree, spec, args.out / "runs" / name, args.skip)}
            print(json.dumps(row), flush=True)
            with open(args.out / "tree_rates.jsonl", "a") as rows:
                rows.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
