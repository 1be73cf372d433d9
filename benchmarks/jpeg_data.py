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
runs. `--images datacomp` writes JPEGs the size DataComp keeps them (short side 200-512, aspect 0.5-2, q90,
with a camera's grain: ~80 KB); the `ceiling` side measures what the node can decode of them at most (every
core as the data workers decode, plus the GPU's hardware JPEG engines through nvImageCodec, where installed,
on an idle GPU). The open_clip_train site: `pip install --no-deps --target DIR 'webdataset<=0.2.86'` (it also imports pandas).
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
import multiprocessing
from multiprocessing import Pool
from pathlib import Path
from typing import Optional

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from throughput import run  # noqa: E402

from fsdpclip.cli.report import read_run  # noqa: E402

WORDS = ("red", "small", "old", "bright", "dog", "house", "river", "car", "tree", "city", "beach", "bird", "street",
         "mountain", "cat", "boat", "at night", "in the snow", "on a table", "near the sea")


def natural_image(rng, width: int, height: int, grain: float = 0.0, field_side: Optional[int] = None):
    """width × height colour noise with a 1/f-like spectrum (octaves of smooth random fields, coarse ones
    strongest; drawn at `field_side` on the longer side and enlarged, if given), plus Gaussian grain of that
    standard deviation in levels (a camera's, which JPEG keeps)."""
    from PIL import Image

    scale = 1.0 if field_side is None else field_side / max(width, height)
    field_w, field_h = max(2, round(width * scale)), max(2, round(height * scale))
    field = np.zeros((field_h, field_w, 3), np.float32)
    for octave in range(1, 9):
        cells_h, cells_w = min(2 ** octave, field_h), min(2 ** octave, field_w)
        coarse = rng.standard_normal((cells_h, cells_w, 3)).astype(np.float32)
        field += np.stack([np.asarray(Image.fromarray(coarse[..., c]).resize((field_w, field_h), Image.BICUBIC))
                           for c in range(3)], -1) * 2.0 ** (-0.35 * octave)
    low, high = np.percentile(field, (1, 99))
    image = Image.fromarray((np.clip((field - low) / (high - low), 0, 1) * 255).astype(np.uint8))
    if (field_w, field_h) != (width, height):
        image = image.resize((width, height), Image.BICUBIC)
    if not grain:
        return image
    tile = _grain_tile(grain)
    top, left = int(rng.integers(0, tile.shape[0] - height + 1)), int(rng.integers(0, tile.shape[1] - width + 1))
    noisy = np.asarray(image, np.int16) + tile[top:top + height, left:left + width]
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


_GRAIN: dict[float, np.ndarray] = {}


def _grain_tile(grain: float) -> np.ndarray:
    """A 1024² tile of Gaussian grain (int16 levels), drawn once per process: images take windows of it."""
    if grain not in _GRAIN:
        _GRAIN[grain] = np.random.default_rng(0).normal(0, grain, (1024, 1024, 3)).round().astype(np.int16)
    return _GRAIN[grain]


def image_shape(rng, images: str, size: int) -> tuple[int, int]:
    """(width, height) of one image: `size` square, or as DataComp keeps them ('datacomp': short side
    200-512, aspect ratio 0.5-2, log-uniform)."""
    if images == "square":
        return size, size
    short, aspect = int(rng.integers(200, 513)), float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))
    return (int(short * aspect), short) if aspect >= 1 else (short, int(short / aspect))


def write_shard(task: tuple[Path, int, int, int, str]) -> None:
    path, index, samples, size, images = task
    import webdataset as wds

    rng = np.random.default_rng(index)
    partial = path.with_suffix(".partial")
    with wds.TarWriter(str(partial)) as sink:
        for sample in range(samples):
            jpeg = io.BytesIO()
            if images == "datacomp":
                image = natural_image(rng, *image_shape(rng, images, size), grain=10.0, field_side=128)
            else:
                image = natural_image(rng, size, size)
            image.save(jpeg, "JPEG", quality=90)
            caption = "a photo of a " + " ".join(rng.choice(WORDS, 3, replace=False))
            sink.write({"__key__": f"{index:06d}{sample:06d}", "jpg": jpeg.getvalue(), "txt": caption})
    partial.rename(path)


def write_shards(directory: Path, shards: int, per_shard: int, size: int, images: str) -> str:
    """The shards' brace pattern; shards already there are kept."""
    directory.mkdir(parents=True, exist_ok=True)
    tasks = [(directory / f"{i:06d}.tar", i, per_shard, size, images) for i in range(shards)
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
    settings = [item for value in args.set for item in ("--set", value)]
    code = run([sys.executable, "-m", "fsdpclip", "launch", str(spec), *settings], args.out / f"{name}.log",
               args.timeout)
    ended = time.time()
    records = read_run(args.out / "runs" / name).records if (args.out / "runs" / name / "metrics.jsonl").is_file() \
        else []
    if len(records) < 2:
        return {"error": f"exit {code}; see {name}.log"}
    shares = [r["jpeg_engine_share"] for r in records if "jpeg_engine_share" in r]
    new_interpreters = re.search(r"the ranks start as new interpreters: (.*)", (args.out / f"{name}.log").read_text())
    return {"launch": f"new interpreters: {new_interpreters[1]}" if new_interpreters else "ranks forked from the launcher",
            "jpeg_engine_shares": shares or None, "samples_per_s_per_gpu": second_half([r["samples_per_s_per_gpu"] for r in records]),
            "data_wait_fraction": second_half([r["data_wait_fraction"] for r in records]),
            "step_limited_samples_per_s_per_gpu": step_rate(records),
            "time_to_first_step_s": records[0]["time_to_first_step_s"], "exit": code,
            "last_step_to_exit_s": round(ended - records[-1]["time"], 1), "steps": records[-1]["step"],
            "launch_s": round(ended - launched, 1)}


_BLOBS: list[bytes] = []  # the ceiling's JPEGs, set before its processes fork (they read them, none is sent)


def _decode_on_a_core(part: tuple[int, int]) -> int:
    """Decodes every `part[1]`-th of the ceiling's JPEGs from `part[0]` as a 'mixed' data worker does (header,
    libjpeg-turbo's pixels); returns how many."""
    import torch

    from fsdpclip.data.jpeg import read_header, rgb_pixels

    torch.set_num_threads(1)
    return sum(rgb_pixels(data, read_header(data)).shape[0] > 0 for data in _BLOBS[part[0]::part[1]])


def _ready_to_decode(ready) -> None:
    """A ceiling process's start: its decoder imported (one JPEG decoded), then wait for the others."""
    _decode_on_a_core((0, len(_BLOBS)))
    ready.wait()


def _hardware_engines(device):
    """A batch of JPEGs (uint8 tensors) to RGB (3, h, w) on the GPU's hardware JPEG engines (nvImageCodec)."""
    import torch
    from nvidia import nvimgcodec

    decoder = nvimgcodec.Decoder(device_id=device.index,
                                 backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)])
    params = nvimgcodec.DecodeParams(apply_exif_orientation=False, sample_format=nvimgcodec.SampleFormat.I_RGB)

    def decode(jpegs):
        images = decoder.decode([nvimgcodec.CodeStream(jpeg.numpy()) for jpeg in jpegs], params=params,
                                cuda_stream=torch.cuda.current_stream(device).cuda_stream)
        return [torch.as_tensor(image, device=device).permute(2, 0, 1) for image in images]
    return decode


def _nvjpeg(device):
    """A batch of JPEGs to RGB on the GPU's multiprocessors (torchvision's nvJPEG)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    return lambda jpegs: decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device)


def ceiling_side(urls: str, args) -> dict:
    """The node's JPEG supply ceiling on these shards, images/s: every core decoding as the data workers do
    (one process each), plus the GPU's hardware JPEG engines (and, beside them, nvJPEG) decoding, cropping
    and resizing batches of 256 to 224 px on an otherwise idle GPU; their sum is what the node could feed
    a step at most."""
    import torch

    from fsdpclip.data.resize import resized_crops
    from fsdpclip.data.tarshards import shard_samples
    from fsdpclip.data.transform import padded
    from fsdpclip.jobspec.urls import shard_urls

    blobs = []
    for url in shard_urls(urls):
        blobs += [sample["jpg"] for sample in shard_samples(url, lambda exc: True)]
        if len(blobs) >= args.ceiling_images:
            break
    blobs = _BLOBS[:] = blobs[:args.ceiling_images]
    cores = os.cpu_count() or 1
    ready = multiprocessing.Barrier(cores + 1)
    with Pool(cores, initializer=_ready_to_decode, initargs=(ready,)) as pool:
        ready.wait()  # every process has imported its decoder
        began = time.perf_counter()
        decoded = sum(pool.map(_decode_on_a_core, [(i, cores) for i in range(cores)], chunksize=1))
        row = {"cpu_images_per_s": decoded / (time.perf_counter() - began), "cores": cores,
               "mean_kb": sum(map(len, blobs)) / len(blobs) / 1024, "images": len(blobs)}
    if args.device == "cuda":
        device, batch = torch.device("cuda", torch.cuda.current_device()), 256
        jpegs = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
        for name, decoder in (("hardware", _hardware_engines), ("nvjpeg", _nvjpeg)):
            try:
                decode = decoder(device)

                def one(i):
                    images = decode(jpegs[i:i + batch])
                    boxes = torch.tensor([[0, 0, image.shape[1], image.shape[2]] for image in images])
                    return resized_crops(padded(images), boxes, (224, 224))
                one(0)
                torch.cuda.synchronize()
                began, done = time.perf_counter(), 0
                for i in range(0, len(jpegs) - batch + 1, batch):
                    done += one(i).shape[0]
                torch.cuda.synchronize()
                row[f"{name}_images_per_s"] = done / (time.perf_counter() - began)
            except Exception as exc:
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    row["ceiling_images_per_s"] = row["cpu_images_per_s"] + row.get("hardware_images_per_s", 0)
    return row


def resized_side(shards: dict, args) -> dict:
    """The default spec on the shards shrunk to the model's size (`fsdpclip data resize --model`, in parallel over
    the node's cores; its time in the row), kept for the next run in OUT/resized."""
    resized = args.out / "resized"
    began = time.time()
    code = run([sys.executable, "-m", "fsdpclip", "data", "resize", str(args.out / "shards"), str(resized),
                "--model", args.model], args.out / "resize.log", args.timeout)
    seconds = time.time() - began
    if code != 0:
        return {"error": f"data resize exit {code}; see resize.log"}
    row = fsdpclip_side("resized", {**shards, "urls": shards["urls"].replace(str(args.out / "shards"), str(resized))},
                        args)
    return {**row, "resize_s": round(seconds, 1),
            "resized_mean_kb": sum(f.stat().st_size for f in resized.glob("*.tar")) / args.shards / args.per_shard / 1024}


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
               "--workers", str(openclip_workers(args)), "--precision", "amp_bf16", "--model", args.model,
               "--epochs", "1",
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


def openclip_workers(args) -> int:
    """The data workers open_clip_train gets: fsdpclip's per GPU, 'auto' settled as data.workers settles it."""
    if args.workers != "auto":
        return args.workers
    return min(max(1, (os.cpu_count() or 1) // args.gpus - 1), max(1, args.shards // args.gpus))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--image-size", type=int, default=256, help="the side of --images square")
    parser.add_argument("--images", default="square", choices=("square", "datacomp"),
                        help="square: --image-size JPEGs; datacomp: short side 200-512, aspect 0.5-2, with grain")
    parser.add_argument("--ceiling-images", type=int, default=16384, help="JPEGs the ceiling side decodes")
    parser.add_argument("--model", default="ViT-B-32", help="an OpenCLIP name (or, for fsdpclip only, a config file)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", default="auto", help="data workers per GPU (data.workers; open_clip_train gets "
                                                          "'auto' settled: the cores per GPU less one)")
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
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a spec setting for every fsdpclip side (`fsdpclip launch --set`), e.g. launch.fork_ranks=false")
    args = parser.parse_args()
    args.out = args.out.resolve()
    began = time.time()
    urls = write_shards(args.out / "shards", args.shards, args.per_shard, args.image_size, args.images)
    args.workers = args.workers if args.workers == "auto" else int(args.workers)
    print(f"{args.shards} shards of {args.per_shard} in {args.out / 'shards'}: {time.time() - began:.0f} s", flush=True)
    shards = {"urls": urls, "samples": args.shards * args.per_shard}  # the default side: the minimal spec
    if args.workers != "auto":
        shards["workers"] = args.workers
    shard_data = ["--train-data", urls, "--dataset-type", "webdataset"]
    sides = {"synthetic": lambda: fsdpclip_side("synthetic", {"source": "synthetic"}, args),
             "default": lambda: fsdpclip_side("default", shards, args),
             "cpu": lambda: fsdpclip_side("decode-cpu", {**shards, "decode": "cpu"}, args),
             "gpu": lambda: fsdpclip_side("decode-gpu", {**shards, "decode": "gpu"}, args),
             "mixed": lambda: fsdpclip_side("decode-mixed", {**shards, "decode": "mixed"}, args),
             "mixed-4-workers": lambda: fsdpclip_side("mixed-4-workers", {**shards, "workers": 4}, args),
             "workers-only": lambda: fsdpclip_side("workers-only", {**shards, "jpeg_engines": False}, args),
             "resized": lambda: resized_side(shards, args),
             "ceiling": lambda: ceiling_side(urls, args),
             "open_clip_train": lambda: openclip_side("open_clip_train", args.openclip_site, shard_data, args),
             "open_clip_main": lambda: openclip_side("open_clip_main", args.openclip_main_site, shard_data, args,
                                                     "--torchcompile"),
             "open_clip_main_synthetic": lambda: openclip_side("open_clip_main_synthetic", args.openclip_main_site,
                                                               ["--dataset-type", "synthetic"], args, "--torchcompile")}
    rows = []
    for side in args.sides.split(","):
        rows.append({"side": side, "model": args.model, "batch_per_gpu": args.batch, "gpus": args.gpus,
                     "workers": args.workers if side != "synthetic" else None,
                     "workers_settled": openclip_workers(args) if side != "synthetic" else None, **sides[side]()})
        print(json.dumps(rows[-1]), flush=True)
        (args.out / "jpeg_data.json").write_text(json.dumps(rows, indent=2))  # each side kept as it ends
    print("\n| side | samples/s/GPU | data wait | where the step decides | launch → first step | exit |\n"
          "|---|---|---|---|---|---|")
    for row in rows:
        if "ceiling_images_per_s" in row:
            print(f"| ceiling (images/s: {row['cores']} cores {row['cpu_images_per_s']:.0f} + hardware engines "
                  f"{row.get('hardware_images_per_s', 0):.0f}; nvJPEG {row.get('nvjpeg_images_per_s', 0):.0f}) | "
                  f"{row['ceiling_images_per_s']:.0f} | | | | |")
        elif "error" in row:
            print(f"| {row['side']} | {row['error']} | | | | |")
        else:
            step = row.get("step_limited_samples_per_s_per_gpu")
            print(f"| {row['side']} | {row['samples_per_s_per_gpu']:.0f} | {row['data_wait_fraction']:.1%} | "
                  f"{'' if step is None else f'{step:.0f}'} | {row['time_to_first_step_s']:.1f} s | "
                  f"{row.get('exit', '')} |")


if __name__ == "__main__":
    main()
