"""How long training waits for an asynchronous checkpoint, through `fsdpclip launch` on synthetic data.

    python benchmarks/async_checkpoint.py --model ViT-L-14 --batch 128 --every 40 --steps 130 \\
        --label after --out /tmp/ckpt

One run that logs every step and saves every --every steps in the background (checkpoint.async_save), and
ends with a synchronous save (checkpoint.at_end), the reference beside them. Per save: the step it was due at
and the step it was made at (a save waits while the write before it goes on), `checkpoint_blocked_s`, its parts
and `checkpoint_staging` where the trainer writes them, and for any version of the trainer how much longer than
the median step the step after the save took (the save's time falls into that step's log window) and the 20
steps after it together (up to the next save), so a trainer before `checkpoint_blocked_s` existed is measured the
same way (its saves taken at the multiples of --every). Appends one JSON row per save to
OUT/async_checkpoint.jsonl and prints them; the fsdpclip that runs is the one on PYTHONPATH (--label names it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an OpenCLIP name or a model config file")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--every", type=int, required=True, help="steps between saves")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--keep", type=int, default=1)
    parser.add_argument("--label", required=True, help="which trainer this is (a row's 'variant')")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: to check that it runs")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{Path(args.model).stem}-{args.label}"
    model = {"config": str(Path(args.model).resolve())} if args.model.endswith(".json") else {"name": args.model}
    job = {"run": {"name": name, "output_dir": str(args.out / "runs")}, "model": model,
           "schedule": {"kind": "constant", "steps": args.steps}, "data": {"source": "synthetic"},
           "batch": {"per_gpu": args.batch}, "logging": {"every_steps": 1},
           "checkpoint": {"every_steps": args.every, "async_save": True, "at_end": True, "keep": args.keep,
                          "resume": None}, "launch": {"gpus_per_node": 1, "device": args.device}}
    spec = args.out / f"{name}.json"
    spec.write_text(json.dumps(job))
    began = time.time()
    with open(args.out / f"{name}.log", "w") as log:
        code = subprocess.run([sys.executable, "-m", "fsdpclip", "launch", str(spec)], stdout=log,
                              stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    records = [json.loads(line) for line in (args.out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    rows = [{"model": args.model, "batch_per_gpu": args.batch, "gpus": 1, "variant": args.label, **row, "exit": code,
             "run_s": round(time.time() - began, 1), "torch": torch_version()} for row in save_rows(records, args.batch,
                                                                                                    args.every, args.steps)]
    with open(args.out / "async_checkpoint.jsonl", "a") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


def save_rows(records: list[dict], batch: int, every: int, steps: int, after: int = 20) -> list[dict]:
    """One row per save out of a run's metrics.jsonl records (see the module's docstring)."""
    times = {r["step"]: r["step_time_s"] for r in records if "step_time_s" in r}
    saves = {r["step"]: r for r in records if "checkpoint_blocked_s" in r}
    if not saves:  # a trainer before checkpoint_blocked_s: the saves are at the multiples of --every
        saves = {step: {} for step in range(every, steps, every)}
    usual = statistics.median(t for s, t in times.items() if s > 2 and s - 1 not in saves)
    rows = []
    for step, save in sorted(saves.items()):
        upto = min([later for later in saves if later > step] + [step + after])
        following = [s for s in range(step + 1, upto + 1) if s in times]
        rows.append({"save_step": step, "due_step": save.get("checkpoint_due_step", step),
                     "checkpoint_blocked_s": save.get("checkpoint_blocked_s"),
                     "checkpoint_phases_s": save.get("checkpoint_phases_s"),
                     "checkpoint_staging": save.get("checkpoint_staging"),
                     "step_after_save_excess_s": round(times[step + 1] - usual, 3) if step + 1 in times else None,
                     f"next_{after}_steps_excess_s": round(sum(times[s] - usual for s in following), 3),
                     "median_step_s": round(usual, 4), "samples_per_s_per_gpu": round(batch / usual, 1),
                     "peak_memory_gib": max(r.get("peak_memory_gib", 0) for r in records)})
    return rows


def torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
