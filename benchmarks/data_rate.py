"""One rank's data pipeline alone, without a model: how many samples per second it delivers, and which
stage limits it.

    python benchmarks/data_rate.py --urls '/tmp/jpeg/shards/{000000..000031}.tar' --samples 32000 \\
        --model ViT-B-32 --batch 256 --workers 4 8 12 --decode gpu cpu --batches 80 --skip 40 --out rates.jsonl

For each data.decode and worker count, the webdataset batches are built as the trainer builds them
(fsdpclip.data.batches.webdataset_batches) and measured twice: "workers" takes the batches as the workers hand
them over (no pinning thread, nothing sent to the device: for decode 'gpu' they are still JPEGs), "device"
also turns each into the model's input on the device, as a training step's data does (on CUDA with the
pinning thread's decode for 'gpu'), synchronised at the end. Rates count the batches after the first
--skip: the workers' start-up queues (prefetch 4 batches per worker) are not the steady supply. Where
"device" is well below "workers", the rank's side limits (for 'gpu': the pinning thread's decode); where
both are equal and grow with the workers, the workers do. One JSON line per measurement on stdout and in
--out. --batches must stay within one epoch (samples ÷ batch), before its last workers × 4 batches, where
the next epoch's workers start. Runs on CPU too (decode 'cpu', device cpu).

--step-ms MS (CUDA) adds a "device+step" measurement: after each batch is made the model's input, an
emulated training step of MS milliseconds of GPU work (bf16 matmuls replayed as one CUDA graph, so no host
work, like fsdpclip's graphed step) runs on the current stream, which is then synchronised, as a step
reading its loss is. Where "device+step" delivers less than both "device" and the step alone
(`step_alone_samples_per_s`), the training step's use of the GPU slows the rank's side of the pipeline.

--parts (CUDA) also times, for decode 'gpu' and 'mixed', the device's parts (with --parts-busy-ms, while
another thread keeps the GPU busy with an emulated step in a loop) on --part-batches batches taken from the
workers, one at a time and synchronised, on the calling thread. 'gpu': nvJPEG's decode of the batch's
JPEGs, the crops' resize, the whole `decoded_pixels`, and the pinning thread's call
(`EncodedBatch.pin_memory`, waited for); 'mixed': the pinned crops' copy to the device, their resize, and
the pinning thread's call (`CroppedBatch.pin_memory`: pinning, copy and resize, waited for). Each part
reports wall and this thread's CPU milliseconds per batch: CPU near wall means the host side (for 'gpu'
header parsing, Huffman decoding where the hardware decoder does not take the JPEG; launching kernels)
limits it, not the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import threading
import time
from typing import Callable, Iterator, Optional

import torch

from fsdpclip.data.batches import PREFETCH, webdataset_batches
from fsdpclip.jobspec.source import DATA_SOURCES
from fsdpclip.data.resize import resized_crops
from fsdpclip.data.transform import CroppedBatch, EncodedBatch, _decode_jpegs, decoded_pixels, padded, unpacked
from fsdpclip.model.build import build_tokenizer, image_transform, model_config, model_from_config
from fsdpclip.jobspec.webdataset_spec import WebDatasetSpec
from fsdpclip.run.node import usable_cores
from fsdpclip.jobspec.job import ModelSpec


class EmulatedStep:
    """About `ms` milliseconds of GPU work per call on the current stream, without host work: 8192² bf16
    matmuls captured as one CUDA graph; each call replays it and waits for it."""

    def __init__(self, ms: float, device: torch.device):
        self.matrix = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.matrix)
        torch.matmul(self.matrix, self.matrix, out=self.out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            torch.matmul(self.matrix, self.matrix, out=self.out)
        end.record()
        end.synchronize()
        count = max(1, round(ms / (start.elapsed_time(end) / 20)))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(count):
                torch.matmul(self.matrix, self.matrix, out=self.out)
        start.record()
        self()
        end.record()
        end.synchronize()
        self.ms = start.elapsed_time(end)

    def __call__(self) -> None:
        self.graph.replay()
        torch.cuda.current_stream().synchronize()


@contextlib.contextmanager
def kept_busy(step: EmulatedStep, device: torch.device) -> Iterator[None]:
    """The GPU kept busy, while inside, by another thread replaying `step` in a loop on its own stream."""
    done = threading.Event()

    def loop() -> None:
        with torch.cuda.stream(torch.cuda.Stream(device)):
            while not done.is_set():
                step()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    time.sleep(0.5)
    try:
        yield
    finally:
        done.set()
        thread.join()


def settled(spec: WebDatasetSpec, device: torch.device) -> dict:
    """The block's 'auto' as one rank of one on this machine settles it (the run plan's data fields)."""
    return DATA_SOURCES["webdataset"].plan(spec, device.type, 1, 1, usable_cores())


def rate(args, model, tokenizer, decode: str, workers: int, stage: str, device: torch.device,
         step: Optional[EmulatedStep] = None) -> dict:
    spec = WebDatasetSpec(urls=args.urls, samples=args.samples, workers=workers, decode=decode)
    batches, images = webdataset_batches(spec, settled(spec, device), image_transform(model, train=True), tokenizer,
                                         args.batch, 0, 1, 0, device,
                                         pin_memory=device.type == "cuda" and stage != "workers")
    stream = iter(batches)
    began = time.perf_counter()
    started = None
    try:
        for index, (pixels, texts) in enumerate(itertools.islice(stream, args.batches)):
            if stage != "workers":
                pixels, texts = images(pixels), texts.to(device, non_blocking=True)
            elif isinstance(pixels, CroppedBatch):
                pixels.release()  # taken: the worker may write its buffer again
            if step is not None:
                step()
            if index + 1 == args.skip:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ended = time.perf_counter()
    finally:
        stream.close()
        batches.close()
    measured = args.batches - args.skip
    row = {"decode": images.decode, "workers": workers, "stage": stage, "batch": args.batch,
           "first_batches_s": round(started - began, 2),
           "samples_per_s": round(measured * args.batch / (ended - started), 1)}
    if step is not None:
        row.update(step_ms=round(step.ms, 2), step_alone_samples_per_s=round(args.batch / step.ms * 1e3, 1))
    return row


def decode_parts(args, model, tokenizer, decode: str, device: torch.device,
                 busy: Optional[EmulatedStep] = None) -> list[dict]:
    """Wall and CPU milliseconds per batch of each part of the device's share of `decode` (see --parts),
    on a GPU kept busy by another thread replaying `busy` in a loop, if given."""
    spec = WebDatasetSpec(urls=args.urls, samples=args.samples, workers=max(args.workers), decode=decode)
    batches, _ = webdataset_batches(spec, settled(spec, device), image_transform(model, train=True), tokenizer,
                                    args.batch, 0, 1, 0, device, pin_memory=False)
    stream = iter(batches)
    try:
        taken = [pixels for pixels, _ in itertools.islice(stream, args.part_batches)]
    finally:
        stream.close()
        batches.close()
    parts = gpu_decode_parts(taken, device) if decode == "gpu" else mixed_decode_parts(taken, device)
    rows = []
    with kept_busy(busy, device) if busy is not None else contextlib.nullcontext():
        for name, (part, count) in parts.items():
            rows.append(dict(decode=decode, **timed_part(name, part, count, args.batch, busy)))
    return rows


def gpu_decode_parts(taken: list, device: torch.device) -> dict:
    """'gpu': nvJPEG's decode, the crops' resize, the whole decode, the pinning thread's call."""
    encoded = [batch for batch in taken if isinstance(batch, EncodedBatch)]
    decoded = [padded(_decode_jpegs(list(b.data.split(b.lengths)), b.boxes, device)) for b in encoded]
    return {"decode_jpeg": (lambda i: _decode_jpegs(list(encoded[i].data.split(encoded[i].lengths)),
                                                    encoded[i].boxes, device), len(encoded)),
            "resized_crops": (lambda i: resized_crops(decoded[i], encoded[i].boxes, encoded[i].size),
                              len(encoded)),
            "decoded_pixels": (lambda i: decoded_pixels(encoded[i], device), len(encoded)),
            "pin_memory": (lambda i: encoded[i].pin_memory().ready.synchronize(), len(encoded))}


def mixed_decode_parts(taken: list, device: torch.device) -> dict:
    """'mixed': the pinned crops' copy to the device, their resize (unpacked, from channels last), the pinning
    thread's call (pinning, copy and resize)."""
    pinned = [CroppedBatch(batch.pixels.pin_memory(), batch.boxes, batch.size) for batch in taken]
    copied = [unpacked(batch.pixels.to(device), batch.boxes).permute(0, 3, 1, 2) for batch in pinned]
    return {"copy": (lambda i: pinned[i].pixels.to(device, non_blocking=True), len(taken)),
            "resized_crops": (lambda i: resized_crops(copied[i], pinned[i].boxes, pinned[i].size),
                              len(taken)),
            "pin_memory": (lambda i: taken[i].pin_memory().ready.synchronize(), len(taken))}


def timed_part(name: str, part: Callable[[int], object], batches: int, batch: int,
               busy: Optional[EmulatedStep]) -> dict:
    """One part of the decode timed over the batches, each synchronised."""
    part(0)
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.thread_time()
    for index in range(batches):
        part(index)
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return {"part": name, "batches": batches, "batch": batch, "busy_step_ms": None if busy is None else round(busy.ms, 2),
            "wall_ms_per_batch": round(wall / batches * 1e3, 2), "cpu_ms_per_batch": round(cpu / batches * 1e3, 2),
            "samples_per_s": round(batches * batch / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--urls", required=True, help="webdataset shards (brace notation)")
    parser.add_argument("--samples", type=int, required=True, help="samples in those shards")
    parser.add_argument("--model", default="ViT-B-32", help="an OpenCLIP name or a model config file")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[8])
    parser.add_argument("--decode", nargs="+", default=["gpu", "cpu"], choices=("gpu", "mixed", "cpu", "auto"))
    parser.add_argument("--batches", type=int, default=80)
    parser.add_argument("--skip", type=int, default=40, help="batches before the timing starts")
    parser.add_argument("--step-ms", type=float, nargs="*", default=[], help="emulated steps (see above)")
    parser.add_argument("--parts", action="store_true", help="also time the device decode's parts (see above)")
    parser.add_argument("--part-batches", type=int, default=20)
    parser.add_argument("--parts-busy-ms", type=float, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not 0 < args.skip < args.batches:
        parser.error("--skip must be between 0 and --batches")
    ahead = max(args.workers) * PREFETCH  # with this many batches left, the next epoch's workers start
    if args.batches + ahead > args.samples // args.batch:
        parser.error(f"--batches {args.batches} and the next epoch's workers, started {ahead} batches before its "
                     f"end, need more than the {args.samples // args.batch} batches of one epoch: more --samples")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda" and ("gpu" in args.decode or args.parts or args.step_ms):
        parser.error("--decode gpu, --parts and --step-ms need a CUDA --device")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the pinning thread decodes on the current device
    spec = ModelSpec(**({"config": args.model} if args.model.endswith(".json") else {"name": args.model}))
    config = model_config(spec)
    model, tokenizer = model_from_config(config, device="meta"), build_tokenizer(config)
    steps = [EmulatedStep(ms, device) for ms in args.step_ms]
    parted = [decode for decode in args.decode if decode in ("gpu", "mixed")] if args.parts else []
    busy = EmulatedStep(args.parts_busy_ms, device) if parted and args.parts_busy_ms else None
    measurements = itertools.chain(
        (row for decode in parted for row in decode_parts(args, model, tokenizer, decode, device)),
        (row for decode in parted if busy for row in decode_parts(args, model, tokenizer, decode, device, busy)),
        (rate(args, model, tokenizer, decode, workers, stage, device)
         for decode, workers, stage in itertools.product(args.decode, args.workers, ("workers", "device"))),
        (rate(args, model, tokenizer, decode, workers, "device+step", device, step)
         for decode, workers, step in itertools.product(args.decode, args.workers, steps)))
    for row in measurements:  # each printed as soon as it is measured
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
