"""Real JPEG shards: fsdpclip (synthetic data, the default spec, data.decode "cpu", "gpu", "mixed") beside
open_clip_train 3.3.0 and open_clip's main branch (`--torchcompile`, on the shards and on its synthetic data).

    python benchmarks/jpeg_data.py --out results/jpeg --shards 100 --per-shard 1000 --gpus 2 --model ViT-B-32 \\
        --batch 256 --workers 8 --steps 100 --openclip-site /opt/openclip-site --openclip-main-site /opt/main-site

Writes --shards webdataset shards of --per-shard JPEGs (256×256, quality 90, ~28 KB of 1/f colour noise,
which compresses like a photo) with captions into OUT/shards (kept for the next run; written in parallel),
then runs each side in turn on --gpus GPUs: fsdpclip through `fsdpclip launch` of a generated spec (samples/s
per GPU, data_wait_fraction and launch → first step from its metrics.jsonl), and, with --openclip-site (a
directory holding the webdataset<=0.2.86 that open_clip_train pins, put first on its PYTHONPATH only),
`python -m open_clip_train.main` on the same shards, read from its log; likewise with --openclip-main-site (open_clip
main built from its source, with that webdataset) under `--torchcompile`, as its own compiled trainer runs. Rates are the mean of the second
half of the steps; fsdpclip's sides also give the step's own rate: the mean of the logged windows (the first
left out) whose data wait is at most 2%, where the step and not the supply set the rate. Prints a table and
writes OUT/jpeg_data.json. --device cpu with tiny sizes (a model config file for --model) checks that it
runs. The open_clip_train site: `pip install --no-deps --target DIR 'webdataset<=0.2.86'` (it also imports pandas).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import sys
import time
from datetime import datetime
from multiprocessing import Pool
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from throughput import run  # noqa: E402

from fsdpclip.cli.report import read_run  # noqa: E402

WORDS = ("red", "small", "old", "bright", "dog", "house", "river", "car", "tree", "city", "beach", "bird", "street",
         "mountain", "cat", "boat", "at night", "in the snow", "on a table", "near the sea")


def natural_image(rng, size: int):
    """size × size colour noise with a 1/f-like spectrum: octaves of smooth random fields, coarse ones strongest."""
    import numpy as np
    from PIL import Image

    field = np.zeros((size, size, 3), np.float32)
    for octave in range(1, 9):
        cells = min(2 ** octave, size)
        coarse = rng.standard_normal((cells, cells, 3)).astype(np.float32)
        field += np.stack([np.asarray(Image.fromarray(coarse[..., c]).resize((size, size), Image.BICUBIC))
                           for c in range(3)], -1) * 2.0 ** (-0.35 * octave)
    low, high = np.percentile(field, (1, 99))
    return Image.fromarray((np.clip((field - low) / (high - low), 0, 1) * 255).astype(np.uint8))


def write_shard(task: tuple[Path, int, int, int]) -> None:
    path, index, samples, size = task
    import numpy as np
    import webdataset as wds

    rng = np.random.default_rng(index)
    partial = path.with_suffix(".partial")
    with wds.TarWriter(str(partial)) as sink:
        for sample in range(samples):
            jpeg = io.BytesIO()
            natural_image(rng, size).save(jpeg, "JPEG", quality=90)
            caption = "a photo of a " + " ".join(rng.choice(WORDS, 3, replace=False))
            sink.write({"__key__": f"{index:06d}{sample:06d}", "jpg": jpeg.getvalue(), "txt": caption})
    partial.rename(path)


def write_shards(directory: Path, shards: int, per_shard: int, size: int) -> str:
    """The shards' brace pattern; shards already there are kept."""
    directory.mkdir(parents=True, exist_ok=True)
    tasks = [(directory / f"{i:06d}.tar", i, per_shard, size) for i in range(shards)
             if not (directory / f"{i:06d}.tar").exists()]
    with Pool(min(len(tasks), os.cpu_count() or 1) or 1) as pool:
        pool.map(write_shard, tasks)
    return str(directory / f"{{000000..{shards - 1:06d}}}.tar")


def second_half(values: list[float]) -> float:
    half = values[len(values) // 2:]
    return sum(half) / len(half)


STEP_LIMITED_WAIT = 0.02


def step_rate(records: list[dict]) -> float | None:
    """The mean rate of the logged windows after the first in which the step waited for data ≤ 2% of the time."""
    rates = [r["samples_per_s_per_gpu"] for r in records[1:] if r["data_wait_fraction"] <= STEP_LIMITED_WAIT]
    return sum(rates) / len(rates) if rates else None


def fsdpclip_side(name: str, data: dict, args) -> dict:
    """One `fsdpclip launch` of the benchmark's job with this data block."""
    model = {"config": str(Path(args.model).resolve())} if args.model.endswith(".json") else {"name": args.model}
    job = {"run": {"name": name, "output_dir": str(args.out / "runs")}, "model": model,
           "schedule": {"kind": "constant", "steps": args.steps}, "data": data, "batch": {"per_gpu": args.batch},
           "checkpoint": {"at_end": False, "resume": None}, "logging": {"every_steps": max(1, args.steps // 10)},
           "launch": {"gpus_per_node": args.gpus, "device": args.device}}
    spec = args.out / f"{name}.json"
    spec.write_text(json.dumps(job))
    shutil.rmtree(args.out / "runs" / name, ignore_errors=True)
    launched = time.time()
    code = run([sys.executable, "-m", "fsdpclip", "launch", str(spec)], args.out / f"{name}.log", args.timeout)
    ended = time.time()
    records = read_run(args.out / "runs" / name).records if (args.out / "runs" / name / "metrics.jsonl").is_file() \
        else []
    if len(records) < 2:
        return {"error": f"exit {code}; see {name}.log"}
    return {"samples_per_s_per_gpu": second_half([r["samples_per_s_per_gpu"] for r in records]),
            "data_wait_fraction": second_half([r["data_wait_fraction"] for r in records]),
            "step_limited_samples_per_s_per_gpu": step_rate(records),
            "time_to_first_step_s": records[0]["time_to_first_step_s"], "exit": code,
            "last_step_to_exit_s": round(ended - records[-1]["time"], 1), "steps": records[-1]["step"],
            "launch_s": round(ended - launched, 1)}


TRAIN_LINE = re.compile(r"^(\S+) \|.*Train Epoch: .*Data \(t\): ([\d.]+) Batch \(t\): ([\d.]+), .*?([\d.]+)/s/gpu")


def openclip_side(name: str, site: Optional[Path], data: list[str], args, *extra: str) -> dict:
    """open_clip_train (DDP at more than one GPU) from `site` on `data` (its arguments) with the same workers
    and batch; its log, NAME.log, gives the rates."""
    if site is None:
        return {"error": "no site for it given"}
    shutil.rmtree(args.out / "logs", ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
               "-m", "open_clip_train.main", *data, *extra, "--train-num-samples",
               str(args.steps * args.batch * args.gpus), "--batch-size", str(args.batch),
               "--workers", str(args.workers), "--precision", "amp_bf16", "--model", args.model, "--epochs", "1",
               "--warmup", "0", "--lr", "5e-4", "--local-loss", "--gather-with-grad", "--log-every-n-steps", "1",
               "--save-frequency", "0", "--name", "run", "--report-to", ""]
    kept, directory = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site.resolve()), kept]))  # this run's
    os.chdir(args.out)  # its logs go to ./logs: torchrun takes a --logs argument for its own --logs-specs
    launched = time.time()
    try:
        code = run(command, args.out / f"{name}.log", args.timeout)
    finally:
        os.chdir(directory)
        os.environ.pop("PYTHONPATH")
        if kept is not None:
            os.environ["PYTHONPATH"] = kept
    steps = [m.groups() for m in map(TRAIN_LINE.match, (args.out / f"{name}.log").read_text().splitlines()) if m]
    if code != 0 or not steps:
        return {"error": f"exit {code}; see {name}.log"}
    first = datetime.strptime(steps[0][0], "%Y-%m-%d,%H:%M:%S").timestamp()
    return {"samples_per_s_per_gpu": second_half([float(s[3]) for s in steps]),
            "data_wait_fraction": second_half([float(s[1]) for s in steps]) / second_half([float(s[2]) for s in steps]),
            "time_to_first_step_s": round(first - launched)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--model", default="ViT-B-32", help="an OpenCLIP name (or, for fsdpclip only, a config file)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=8, help="data workers per GPU")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--sides", default="synthetic,default,cpu,gpu,mixed,open_clip_train,open_clip_main,"
                                           "open_clip_main_synthetic")
    parser.add_argument("--openclip-site", type=Path, default=None,
                        help="where webdataset<=0.2.86 is installed for open_clip_train (without: no such side)")
    parser.add_argument("--openclip-main-site", type=Path, default=None,
                        help="where open_clip's main branch (built from its source) and webdataset<=0.2.86 are "
                             "installed (without: no such sides)")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    args.out = args.out.resolve()
    began = time.time()
    urls = write_shards(args.out / "shards", args.shards, args.per_shard, args.image_size)
    print(f"{args.shards} shards of {args.per_shard} in {args.out / 'shards'}: {time.time() - began:.0f} s", flush=True)
    shards = {"urls": urls, "samples": args.shards * args.per_shard, "workers": args.workers}
    shard_data = ["--train-data", urls, "--dataset-type", "webdataset"]
    sides = {"synthetic": lambda: fsdpclip_side("synthetic", {"source": "synthetic"}, args),
             "default": lambda: fsdpclip_side("default", shards, args),
             "cpu": lambda: fsdpclip_side("decode-cpu", {**shards, "decode": "cpu"}, args),
             "gpu": lambda: fsdpclip_side("decode-gpu", {**shards, "decode": "gpu"}, args),
             "mixed": lambda: fsdpclip_side("decode-mixed", {**shards, "decode": "mixed"}, args),
             "open_clip_train": lambda: openclip_side("open_clip_train", args.openclip_site, shard_data, args),
             "open_clip_main": lambda: openclip_side("open_clip_main", args.openclip_main_site, shard_data, args,
                                                     "--torchcompile"),
             "open_clip_main_synthetic": lambda: openclip_side("open_clip_main_synthetic", args.openclip_main_site,
                                                               ["--dataset-type", "synthetic"], args, "--torchcompile")}
    rows = []
    for side in args.sides.split(","):
        rows.append({"side": side, "model": args.model, "batch_per_gpu": args.batch, "gpus": args.gpus,
                     "workers": args.workers if side != "synthetic" else None, **sides[side]()})
        print(json.dumps(rows[-1]), flush=True)
        (args.out / "jpeg_data.json").write_text(json.dumps(rows, indent=2))  # each side kept as it ends
    print("\n| side | samples/s/GPU | data wait | where the step decides | launch → first step | exit |\n"
          "|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['side']} | {row['error']} | | | | |")
        else:
            step = row.get("step_limited_samples_per_s_per_gpu")
            print(f"| {row['side']} | {row['samples_per_s_per_gpu']:.0f} | {row['data_wait_fraction']:.1%} | "
                  f"{'' if step is None else f'{step:.0f}'} | {row['time_to_first_step_s']:.1f} s | "
                  f"{row.get('exit', '')} |")


if __name__ == "__main__":
    main()
