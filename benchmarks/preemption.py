"""On GPUs, through `fsdpclip launch`: launch → first step of a large model (its initial weights built
on the CPU, the same for a seed on any machine), and a preemption on NCCL: SIGTERM to the launch's
whole process group mid-run → checkpoint and exit 75 → the same launch again resumes and finishes; on
synthetic data, or with --urls on webdataset shards through the default spec's data path (its data workers
and decode).

    python benchmarks/preemption.py --gpus 2 --out /tmp/preempt
    python benchmarks/preemption.py --gpus 1 --startup "" --urls '/data/{000000..000063}.tar' --samples 64000 \
        --workers 8 --out /tmp/preempt

Writes preemption.json under --out and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import startup  # noqa: E402


def preempt(model: str, batch: int, gpus: int, steps: int, out: Path, data: dict) -> dict:
    """Start a run on `data` (the spec's data block), SIGTERM its launch's process group after step 5,
    relaunch it; what each did."""
    name = f"preempt-{model}"
    job = {"run": {"name": name, "output_dir": str(out / "runs")}, "model": {"name": model},
           "schedule": {"kind": "constant", "steps": steps}, "data": data,
           "batch": {"per_gpu": batch}, "logging": {"every_steps": 1}, "launch": {"gpus_per_node": gpus}}
    spec = out / f"{name}.json"
    spec.write_text(json.dumps(job))
    run_dir, result = out / "runs" / name, {"model": model, "gpus": gpus, "steps": steps}
    with open(out / f"{name}-1.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "fsdpclip", "launch", str(spec)], stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 5):
        if process.poll() is not None:
            return {**result, "error": f"ended early ({process.returncode})"}
        time.sleep(0.2)
    signalled = time.time()
    os.killpg(process.pid, signal.SIGTERM)
    result["first_code"] = process.wait(timeout=600)
    result["signal_to_exit_s"] = time.time() - signalled
    result["first_report"] = json.loads((run_dir / "exit.json").read_text())
    began = time.time()
    with open(out / f"{name}-2.log", "w") as log:
        result["second_code"] = subprocess.run([sys.executable, "-m", "fsdpclip", "launch", str(spec)], stdout=log,
                                               stderr=subprocess.STDOUT, timeout=900).returncode
    result["second_s"] = time.time() - began
    second = (out / f"{name}-2.log").read_text()
    result["resumed"] = next((line.strip() for line in second.splitlines() if "resumed from" in line), None)
    result["last_step"] = json.loads(metrics.read_text().splitlines()[-1])["step"]
    result["decode"] = next((line.strip() for line in second.splitlines() if "decoded" in line), None)
    result["tracebacks"] = sum(("Traceback" in (out / f"{name}-{i}.log").read_text()) for i in (1, 2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--startup", default="ViT-bigG-14:32", help="MODEL:BATCH timed launch → first step")
    parser.add_argument("--preempt", default="ViT-B-32:256", help="MODEL:BATCH stopped and resumed")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--urls", default=None, help="webdataset shards to train on (default: synthetic data)")
    parser.add_argument("--samples", type=int, default=None, help="samples in the shards (with --urls)")
    parser.add_argument("--workers", type=int, default=8, help="data workers per GPU (with --urls)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    first = None
    if args.startup:
        model, batch = args.startup.split(":")
        first = startup(model, int(batch), args.gpus, args)
        print("startup:", json.dumps(first), flush=True)
    model, batch = args.preempt.split(":")
    data = {"urls": args.urls, "samples": args.samples, "workers": args.workers} if args.urls \
        else {"source": "synthetic"}
    stopped = preempt(model, int(batch), args.gpus, args.steps, args.out, data)
    print("preemption:", json.dumps({k: v for k, v in stopped.items() if k != "first_report"}), flush=True)
    print("first report:", stopped.get("first_report", {}).get("message"), flush=True)
    (args.out / "preemption.json").write_text(json.dumps({"startup": first, "preemption": stopped}, indent=2) + "\n")


if __name__ == "__main__":
    main()
