"""Launch → first step by phase: one job launched from several source trees in turn, on one machine.

    python benchmarks/startup.py --out /tmp/startup --trees before=/tmp/old-tree after=. --rounds 3 \\
        --gpus 2 --model ViT-B-32 --batch 256 --shards 16 --workers 8

Writes --shards webdataset shards of JPEGs into OUT/shards (`jpeg_data.write_shards`, kept for the next run;
--shards 0: synthetic data), then runs `fsdpclip launch` of the same job (3 steps, compile 'auto', one
inductor cache in OUT/inductor) from each tree (its own directory as working directory and first on
PYTHONPATH): one warm-up launch of the last tree, which fills the compile cache, then --rounds rounds of
every tree in the order given. From each run's first metrics record: `startup_s` (seconds since the launch
time, set after validation, at the end of each phase), launch → first step, and "command": from the launch
command's start, validation included, to that record. Prints a table and writes OUT/startup.json. With
--device cpu and a model config file (examples/models/tiny-clip.json) it checks that it runs.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from jpeg_data import write_shards  # noqa: E402

PHASES = ("process", "distributed", "meta_model", "initial_weights", "parallelized", "first_step")


def job_spec(args, data: dict) -> dict:
    model = {"config": str(Path(args.model).resolve())} if args.model.endswith(".json") else {"name": args.model}
    return {"run": {"name": "startup", "output_dir": str(args.out / "runs")}, "model": model,
            "schedule": {"kind": "constant", "steps": 3}, "batch": {"per_gpu": args.batch}, "data": data,
            "checkpoint": {"at_end": False, "resume": None}, "logging": {"every_steps": 1},
            "launch": {"gpus_per_node": args.gpus, "device": args.device,
                       "env": {"TORCHINDUCTOR_CACHE_DIR": str(args.out / "inductor")}}}


def launch(tree: Path, spec: Path, log: Path, timeout: float) -> dict:
    """`fsdpclip launch` of `spec` from `tree`; its first metrics record's start-up figures."""
    from fsdpclip.launch.local import kill_tree

    run_dir = Path(json.loads(spec.read_text())["run"]["output_dir"]) / "startup"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    started = time.time()
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "fsdpclip", "launch", str(spec)], cwd=tree, env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            code = process.wait()
    try:
        first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    except (OSError, IndexError, ValueError):
        return {"exit": code, "error": f"no metrics; see {log}"}
    return {"exit": code, "first_step_s": first["time_to_first_step_s"],
            "command_s": round(first["time"] - started, 2), "startup_s": first["startup_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trees", nargs="+", required=True, help="NAME=DIR: source trees to launch from")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="ViT-B-32", help="an OpenCLIP name or a config file")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--shards", type=int, default=16, help="JPEG shards of 1000 samples; 0: synthetic data")
    parser.add_argument("--workers", type=int, default=8, help="data workers per GPU")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {name: Path(path).resolve() for name, path in (item.split("=", 1) for item in args.trees)}
    if args.shards:
        urls = write_shards(args.out / "shards", args.shards, 1000, 256)
        data = {"urls": urls, "samples": args.shards * 1000, "workers": args.workers}
    else:
        data = {"source": "synthetic"}
    spec = args.out / "job.json"
    spec.write_text(json.dumps(job_spec(args, data)))
    last = list(trees)[-1]
    launches = [(f"{last} (warm-up)", trees[last])] + [
        (f"{name} #{round_ + 1}", tree) for round_ in range(args.rounds) for name, tree in trees.items()]
    rows = []
    print(f"| launch | {' | '.join(PHASES)} | command |\n|---|{'---|' * len(PHASES)}---|", flush=True)
    for label, tree in launches:
        row = {"launch": label, **launch(tree, spec, args.out / f"{label.split()[0]}-{len(rows)}.log", args.timeout)}
        rows.append(row)
        phases = row.get("startup_s", {})
        cells = [f"{phases[p]:.2f}" if p in phases else "–" for p in PHASES]
        print(f"| {label} | {' | '.join(cells)} | {row.get('command_s', row.get('error'))} |", flush=True)
        (args.out / "startup.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
