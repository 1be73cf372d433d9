"""Does a JPEG batch decode on the GPU overlap a training step that keeps the GPU busy? torchvision's
`decode_jpeg(list, device="cuda")` beside nvJPEG's batched decode called directly (ctypes), initialised
once, on a high-priority stream, with no host synchronisation in the call.

    python benchmarks/nvjpeg_overlap.py --urls '/tmp/jpeg/shards/{000000..000015}.tar' --batches 20 --busy-ms 42

Takes --batches batches of --batch JPEGs from the shards, then times each decoder per batch (wall, call
until the pixels are on the device) on an idle GPU and on one kept busy by another thread replaying an
emulated step of --busy-ms ms (benchmarks/data_rate.py's EmulatedStep) in a loop; checks that both give the
same pixels. With --threads, also the idle decode split among K decoders (each its own nvJPEG handle,
state and stream) in K threads, a batch's JPEGs dealt out among them. One JSON line per measurement. An experiment for issue #15, not part of fsdpclip.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_rate import EmulatedStep, kept_busy  # noqa: E402

from fsdpclip.data.tarshards import shard_samples  # noqa: E402
from fsdpclip.jobspec.urls import shard_urls  # noqa: E402

HARDWARE, DEFAULT, OUTPUT_RGB, MAX_COMPONENT = 3, 0, 3, 4


class Image(ctypes.Structure):
    _fields_ = [("channel", ctypes.c_void_p * MAX_COMPONENT), ("pitch", ctypes.c_size_t * MAX_COMPONENT)]


def load_nvjpeg() -> ctypes.CDLL:
    import torchvision

    roots = [os.path.dirname(torchvision.__file__), os.path.dirname(torch.__file__)]
    candidates = [p for root in roots for p in glob.glob(os.path.join(root, "..", "**", "libnvjpeg*.so*"), recursive=True)]
    for name in candidates + ["libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so"]:
        try:
            library = ctypes.CDLL(name)
            print(json.dumps({"nvjpeg": name}), flush=True)
            return library
        except OSError:
            continue
    raise OSError(f"no libnvjpeg found (looked at {candidates})")


class BatchedDecoder:
    """nvJPEG's batched decode of `batch` JPEGs to planar RGB on `device`, on a stream of the highest
    priority; the call returns once the work is queued (outputs come with an event)."""

    def __init__(self, batch: int, device: torch.device):
        self.lib, self.batch, self.device = load_nvjpeg(), batch, device
        self.handle, self.state = ctypes.c_void_p(), ctypes.c_void_p()
        status = self.lib.nvjpegCreateEx(HARDWARE, None, None, 0, ctypes.byref(self.handle))
        self.backend = "hardware"
        if status != 0:
            self.backend = f"default (hardware: status {status})"
            self.check(self.lib.nvjpegCreateEx(DEFAULT, None, None, 0, ctypes.byref(self.handle)), "create")
        self.check(self.lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)), "state")
        self.check(self.lib.nvjpegDecodeBatchedInitialize(self.handle, self.state, batch, 1, OUTPUT_RGB), "init")
        self.stream = torch.cuda.Stream(device, priority=-100)

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"nvjpeg {what}: status {status}")

    def __call__(self, jpegs: list[bytes]) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        assert len(jpegs) == self.batch
        components, subsampling = ctypes.c_int(), ctypes.c_int()
        widths, heights = (ctypes.c_int * MAX_COMPONENT)(), (ctypes.c_int * MAX_COMPONENT)()
        images, outputs = (Image * self.batch)(), []
        with torch.cuda.stream(self.stream):
            for index, jpeg in enumerate(jpegs):
                self.check(self.lib.nvjpegGetImageInfo(self.handle, jpeg, ctypes.c_size_t(len(jpeg)),
                                                       ctypes.byref(components), ctypes.byref(subsampling),
                                                       widths, heights), "info")
                out = torch.empty(3, heights[0], widths[0], dtype=torch.uint8, device=self.device)
                outputs.append(out)
                for c in range(3):
                    images[index].channel[c] = out[c].data_ptr()
                    images[index].pitch[c] = widths[0]
            data = (ctypes.c_char_p * self.batch)(*jpegs)
            lengths = (ctypes.c_size_t * self.batch)(*[len(j) for j in jpegs])
            self.check(self.lib.nvjpegDecodeBatched(self.handle, self.state, data, lengths, images,
                                                    ctypes.c_void_p(self.stream.cuda_stream)), "decode")
            done = torch.cuda.Event()
            done.record(self.stream)
        return outputs, done


def jpeg_batches(urls: str, batch: int, count: int) -> list[list[bytes]]:
    samples = (s["jpg"] for url in shard_urls(urls) for s in shard_samples(url, lambda exc: False))
    batches = [list(itertools.islice(samples, batch)) for _ in range(count)]
    if len(batches[-1]) < batch:
        raise SystemExit(f"the shards hold fewer than {count} batches of {batch} JPEGs")
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--urls", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--busy-ms", type=float, default=42)
    parser.add_argument("--threads", type=int, nargs="*", default=[])
    args = parser.parse_args()
    from torchvision.io import ImageReadMode, decode_jpeg

    device = torch.device("cuda", torch.cuda.current_device())
    batches = jpeg_batches(args.urls, args.batch, args.batches)
    ours = BatchedDecoder(args.batch, device)
    print(json.dumps({"backend": ours.backend}), flush=True)

    def torchvision_decode(jpegs):
        tensors = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
        out = decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device)
        torch.cuda.current_stream(device).synchronize()
        return out

    def our_decode(jpegs):
        out, done = ours(jpegs)
        done.synchronize()
        return out

    a, b = torchvision_decode(batches[0]), our_decode(batches[0])
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    worst = max((x.int() - y.int()).abs().max().item() for x, y in zip(a, b))
    print(json.dumps({"same_pixels": same, "largest_difference": worst}), flush=True)
    for count in args.threads:
        if args.batch % count:
            raise SystemExit(f"--batch {args.batch} does not split among {count} threads")
        decoders = [BatchedDecoder(args.batch // count, device) for _ in range(count)]
        share = args.batch // count

        def part(decoder, jpegs):
            out, done = decoder(jpegs)
            done.synchronize()

        def split_decode(jpegs):
            threads = [threading.Thread(target=part, args=(d, jpegs[i * share:(i + 1) * share]))
                       for i, d in enumerate(decoders)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        split_decode(batches[0])
        began = time.perf_counter()
        for jpegs in batches:
            split_decode(jpegs)
        wall = (time.perf_counter() - began) / len(batches)
        print(json.dumps({"decoder": f"nvjpeg direct, {count} threads", "busy_step_ms": None,
                          "ms_per_batch": round(wall * 1e3, 2), "samples_per_s": round(args.batch / wall, 1)}),
              flush=True)
    for step in (None, EmulatedStep(args.busy_ms, device)):
        with kept_busy(step, device) if step is not None else contextlib.nullcontext():
            for name, decode in (("torchvision", torchvision_decode), ("nvjpeg direct", our_decode)):
                decode(batches[0])
                began = time.perf_counter()
                for jpegs in batches:
                    decode(jpegs)
                wall = (time.perf_counter() - began) / len(batches)
                print(json.dumps({"decoder": name, "busy_step_ms": step and round(step.ms, 2),
                                  "ms_per_batch": round(wall * 1e3, 2),
                                  "samples_per_s": round(args.batch / wall, 1)}), flush=True)


if __name__ == "__main__":
    main()
