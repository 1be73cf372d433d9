"""`batch.per_gpu: "auto"` on one model: the batch the start-up search keeps, its rate and the search's time.

    python benchmarks/auto_batch.py --out /tmp/auto-batch --model ViT-L-14 --gpus 1 --steps 30

Runs `fsdpclip launch` of a job on synthetic data with per_gpu 'auto' (--global-batch: held by accumulation)
for --steps steps, logging every step, and prints one JSON row: the per-GPU batch and accumulation chosen,
the search's seconds and probes (RUN_DIR/auto_batch.json), the median samples/s per GPU of the steps after
the first, the launch → first step time and the peak memory. Exits with the launch's code where it fails,
the row holding the end of its output (all of it in OUT/launch.log). With --device cpu the launch is refused by validate, which the
tests check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional


from fsdpclip.launch.local import kill_tree


def job_spec(args) -> dict:
    model = {"config": str(Path(args.model).resolve())} if args.model.endswith(".json") else {"name": args.model}
    batch = {"per_gpu": "auto"} | ({"global_batch": args.global_batch} if args.global_batch else {})
    return {"run": {"name": "auto-batch", "output_dir": str(args.out / "runs")}, "model": model,
            "schedule": {"kind": "constant", "steps": args.steps}, "batch": batch,
            "data": {"source": "synthetic", "samples": args.samples},
            "fsdp": {"compile": args.compile,
                     "activation_checkpointing": {"image": args.checkpointing, "text": args.checkpointing}},
            "checkpoint": {"at_end": False, "resume": None}, "logging": {"every_steps": 1},
            "launch": {"gpus_per_node": args.gpus, "device": args.device}}


def measured(run_dir: Path, code: int, output: str) -> dict:
    """The row of a launch that ended with `code`."""
    row: dict = {"exit": code}
    try:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        search = json.loads((run_dir / "auto_batch.json").read_text())
    except (OSError, ValueError):
        return row | {"output_tail": output[-2000:]}
    steps = [r for r in records if "samples_per_s_per_gpu" in r]
    later: list[Optional[float]] = [r["samples_per_s_per_gpu"] for r in steps[1:]]
    return row | {"per_gpu": search["per_gpu"], "grad_accum": search["grad_accum"],
                  "searched_s": search["searched_s"], "start": search["start"],
                  "probes": [(p["per_gpu"], p["fits"], p["peak_gib"]) for p in search["probes"]],
                  "samples_per_s_per_gpu": round(statistics.median(later), 1) if later else None,
                  "first_step_s": steps[0].get("time_to_first_step_s") if steps else None,
                  "peak_memory_gib": max((r.get("peak_memory_gib") or 0 for r in steps), default=None)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="ViT-B-32", help="an OpenCLIP name or a config file")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--samples", type=int, default=10_000_000, help="the synthetic data's samples")
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--compile", default="auto", choices=("auto", "true", "false"))
    parser.add_argument("--checkpointing", action="store_true", help="fsdp.activation_checkpointing")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.compile = {"true": True, "false": False}.get(args.compile, args.compile)
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = args.out / "runs" / "auto-batch"
    shutil.rmtree(run_dir, ignore_errors=True)
    spec = args.out / "auto-batch.json"
    spec.write_text(json.dumps(job_spec(args), indent=2))
    log = args.out / "launch.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "fsdpclip", "launch", str(spec)], stdout=out,
                                   stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
        try:
            code = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            code = process.wait()
    output = log.read_text(errors="replace")
    row = {"model": args.model, "gpus": args.gpus, "global_batch": args.global_batch, "compile": args.compile,
           "activation_checkpointing": args.checkpointing} | measured(run_dir, code, output)
    print(json.dumps(row))
    return code


if __name__ == "__main__":
    sys.exit(main())
