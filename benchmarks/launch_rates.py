"""Training rates of jobs run through `fsdpclip launch` on one GPU: variants of a spec, or one spec from two trees.

    python benchmarks/launch_rates.py --out /tmp/rates --trees before=/tmp/old-tree after=. \\
        --case ViT-B-32:256:300 --case ViT-L-14:128:150
    python benchmarks/launch_rates.py --out /tmp/offload --log-every 2 --skip 4 \\
        --case 'offload=ViT-bigG-14:32:24:{"fsdp": {"cpu_offload": true}}' --case 'resident=ViT-bigG-14:32:30'

A case is [LABEL=]MODEL:BATCH_PER_GPU:STEPS[:JSON], the JSON merged into the job (synthetic data, constant
schedule, no checkpoint, one GPU). With several --trees, each case runs from every tree in the order given,
then in the reverse order (A B B A), so that a drift of the machine does not favour one tree; each tree is the
working directory and first on PYTHONPATH of its own launch. One JSON line per launch on stdout and in
OUT/launch_rates.jsonl: the median `samples_per_s_per_gpu` and `mfu` of the records after --skip steps
(compile and warm-up), peak GPU memory, the peak of the host memory in use while it ran (the whole machine's),
the first step's time, the exit code. The first launch fills the compile cache the others reuse, so compare
first-step times only between later launches. `--device cpu --case examples/models/tiny-clip.json:8:40`
checks the script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def merged(base: dict, extra: dict) -> dict:
    """`base` with `extra`'s fields set, section by section."""
    return {**base, **{key: merged(base.get(key, {}), value) if isinstance(value, dict) else value
                       for key, value in extra.items()}}


def job_spec(name: str, model: str, batch: int, steps: int, extra: dict, runs: Path, device: str,
             log_every: int) -> dict:
    model_spec = {"config": str(Path(model).resolve())} if model.endswith(".json") else {"name": model}
    return merged({"run": {"name": name, "output_dir": str(runs)}, "model": model_spec,
                   "schedule": {"kind": "constant", "steps": steps}, "data": {"source": "synthetic"},
                   "batch": {"per_gpu": batch}, "logging": {"every_steps": log_every},
                   "checkpoint": {"at_end": False, "resume": None},
                   "launch": {"gpus_per_node": 1, "device": device}}, extra)


class HostMemoryPeak:
    """The most memory in use on this machine (MemTotal − MemAvailable) while the block runs, in GiB."""

    def __enter__(self):
        self.peak, self._done = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.5):
            info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            used_kib = int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])
            self.peak = max(self.peak, used_kib / 2 ** 20)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


def launch(tree: Path, spec: Path, run_dir: Path, skip: int) -> dict:
    """One launch from `tree`: its exit code, median rate and MFU after `skip` steps, memory, first-step time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    began = time.monotonic()
    with HostMemoryPeak() as host:
        done = subprocess.run([sys.executable, "-m", "fsdpclip", "launch", str(spec.resolve())], cwd=tree, env=env,
                              capture_output=True, text=True)
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [r for r in records if "loss" in r and r["step"] > skip]
    mfus = [r["mfu"] for r in steps if r.get("mfu") is not None]  # none where the device's peak is unknown
    row = {"exit": done.returncode, "launch_s": round(time.monotonic() - began, 1),
           "samples_per_s_per_gpu": statistics.median(r["samples_per_s_per_gpu"] for r in steps) if steps else None,
           "mfu": statistics.median(mfus) if mfus else None,
           "peak_memory_gib": max((r["peak_memory_gib"] for r in steps if "peak_memory_gib" in r), default=None),
           "host_memory_peak_gib": round(host.peak, 1),
           "first_step_s": next((r["time_to_first_step_s"] for r in records if "time_to_first_step_s" in r), None)}
    if done.returncode:
        row["tail"] = (done.stdout + done.stderr)[-1500:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trees", nargs="+", default=["this=."], help="LABEL=DIR, in the order of the first round")
    parser.add_argument("--case", action="append", required=True, help="[LABEL=]MODEL:BATCH_PER_GPU:STEPS[:JSON]")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu with a model config file to check the script")
    parser.add_argument("--log-every", type=int, default=10, help="logging.every_steps")
    parser.add_argument("--skip", type=int, default=30, help="steps left out of the median (compile, warm-up)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trees = [(label, Path(tree).resolve()) for label, tree in (t.split("=", 1) for t in args.trees)]
    rounds = trees + trees[::-1] if len(trees) > 1 else trees
    for case in args.case:
        label, described = case.split("=", 1) if "=" in case.split(":", 1)[0] else ("", case)
        model, batch, steps, *extra = described.split(":", 3)
        for launch_index, (tree_label, tree) in enumerate(rounds):
            name = "-".join(filter(None, [label or Path(model).stem, tree_label, str(launch_index)]))
            spec = args.out / f"{name}.json"
            spec.write_text(json.dumps(job_spec(name, model, int(batch), int(steps), json.loads(extra[0]) if extra
                                                else {}, args.out / "runs", args.device, args.log_every)))
            row = {"model": model, "batch_per_gpu": int(batch), "gpus": 1, "variant": label or None,
                   "options": json.loads(extra[0]) if extra else {}, "tree": tree_label, "launch": launch_index,
                   **launch(tree, spec, args.out / "runs" / name, args.skip)}
            print(json.dumps(row), flush=True)
            with open(args.out / "launch_rates.jsonl", "a") as rows:
                rows.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
