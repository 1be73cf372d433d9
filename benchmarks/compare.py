"""fsdpclip's trainer beside a plain DDP step, measured in the same run on this GPU machine.

    python benchmarks/compare.py --gpus 2 --cases ViT-B-32:256 ViT-L-14:128 --out results/

For each model and per-GPU batch: the DDP reference (benchmarks/ddp_step.py) and
`fsdpclip launch` on synthetic device-resident data, both through torchrun on the same
GPUs. Writes compare.json and compare.md (samples/s/GPU, MFU against the bf16 matmul peak
measured here, peak memory, launch to first step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

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
    return 2 * n ** 3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12


def flops_per_sample(model_name: str) -> float:
    from fsdpclip.metrics import training_flops_per_sample
    from fsdpclip.model import build_model
    from fsdpclip.spec import ModelSpec

    return training_flops_per_sample(build_model(ModelSpec(name=model_name)))


def run(command: list[str], log: Path, timeout: float) -> int:
    env = {**os.environ, "FSDPCLIP_LAUNCH_TIME": repr(time.time())}
    with open(log, "w") as out:
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode


def ddp(model: str, batch: int, gpus: int, args, out: Path) -> dict:
    result = out / f"ddp-{model}-{batch}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               str(HERE / "ddp_step.py"), "--model", model, "--batch", str(batch), "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--out", str(result)]
    code = run(command, out / f"ddp-{model}-{batch}.log", args.timeout)
    return json.loads(result.read_text()) if code == 0 else {"error": f"exit {code}"}


def fsdpclip(model: str, batch: int, gpus: int, peak: float, args, out: Path, fsdp: dict) -> dict:
    name = f"fsdpclip-{model}-{batch}"
    job = {"run": {"name": name, "output_dir": str(out / "runs")}, "model": {"name": model}, "fsdp": fsdp,
           "schedule": {"kind": "constant", "steps": args.warmup + args.steps}, "data": {"source": "synthetic"},
           "batch": {"per_gpu": batch}, "checkpoint": {"at_end": False},
           "logging": {"every_steps": args.warmup, "peak_tflops": peak},
           "launch": {"gpus_per_node": gpus, "device": "cuda"}}
    if (args.warmup + args.steps) % args.warmup:
        raise SystemExit("--steps must be a multiple of --warmup")
    spec = out / f"{name}.json"
    spec.write_text(json.dumps(job))
    code = run([sys.executable, "-m", "fsdpclip", "launch", str(spec)], out / f"{name}.log", args.timeout)
    if code != 0:
        return {"error": f"exit {code}"}
    records = [json.loads(line) for line in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "loss" in r and r["step"] > args.warmup]
    return {"samples_per_s_per_gpu": sum(r["samples_per_s_per_gpu"] for r in timed) / len(timed),
            "peak_memory_gib": records[-1]["peak_memory_gib"], "time_to_first_step_s": records[0]["time_to_first_step_s"],
            "world_size": gpus}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--cases", nargs="+", default=["ViT-B-32:256", "ViT-L-14:128"])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--fsdp", default="{}", help="JSON for the spec's fsdp block")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    peak = matmul_peak_tflops()
    torch.cuda.empty_cache()
    rows = []
    for case in args.cases:
        model, batch = case.split(":")
        flops = flops_per_sample(model)
        row = {"model": model, "batch_per_gpu": int(batch), "gpus": args.gpus, "flops_per_sample": flops,
               "ddp": ddp(model, int(batch), args.gpus, args, args.out),
               "fsdpclip": fsdpclip(model, int(batch), args.gpus, peak, args, args.out, json.loads(args.fsdp))}
        for side in ("ddp", "fsdpclip"):
            if "samples_per_s_per_gpu" in row[side]:
                row[side]["mfu"] = row[side]["samples_per_s_per_gpu"] * flops / (peak * 1e12)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"matmul_peak_tflops": peak, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "rows": rows}
    (args.out / "compare.json").write_text(json.dumps(result, indent=2))
    (args.out / "compare.md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, bf16 matmul peak {result['matmul_peak_tflops']:.0f} TFLOP/s",
             "", "| model | batch/GPU | GPUs | DDP samples/s/GPU | DDP MFU | DDP peak GiB | fsdpclip samples/s/GPU | "
             "fsdpclip MFU | fsdpclip peak GiB | fsdpclip ÷ DDP | launch→first step (DDP / fsdpclip) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        d, f = row["ddp"], row["fsdpclip"]
        if "error" in d or "error" in f:
            lines.append(f"| {row['model']} | {row['batch_per_gpu']} | {row['gpus']} | {d} | | | {f} | | | | |")
            continue
        lines.append(
            f"| {row['model']} | {row['batch_per_gpu']} | {row['gpus']} | {d['samples_per_s_per_gpu']:.0f} | "
            f"{d['mfu']:.1%} | {d['peak_memory_gib']:.1f} | {f['samples_per_s_per_gpu']:.0f} | {f['mfu']:.1%} | "
            f"{f['peak_memory_gib']:.1f} | {f['samples_per_s_per_gpu'] / d['samples_per_s_per_gpu']:.2f} | "
            f"{d['time_to_first_step_s']:.0f} s / {f['time_to_first_step_s']:.0f} s |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
