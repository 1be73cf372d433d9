"""The host's share of a CPU offload step, part by part, over N fp32 parameters in tensors of a large model's
shard sizes: the fused AdamW at several thread counts, the gradient norm (torch's `get_total_norm` beside the
trainer's `squared_norm`), the clip's scaling, and (with a GPU) the copies to and from it, page-locked and
pageable.

    python benchmarks/host_step.py --parameters 2.54e9 --threads 1 4 8 16

Prints one JSON line per part and thread count: the best of three and the seconds per 10^9 parameters. AdamW
reads and writes each parameter, both moments and the gradient (28 bytes a parameter); the norm reads the
gradient (4 bytes): both memory-bound.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch.nn.utils import get_total_norm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fsdpclip.optim.adamw import squared_norm  # noqa: E402

TENSOR = 13_000_000  # elements per tensor, about a ViT-bigG-14 block's largest


def best_of_three(work: Callable[[], object], synchronize: bool = False) -> float:
    work()
    times = []
    for _ in range(3):
        began = time.perf_counter()
        work()
        if synchronize:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return min(times)


def host_parts(count: int, thread_counts: list[int]) -> list[tuple[int, dict[str, float]]]:
    """Seconds of each host part of the step over `count` tensors, on each of `thread_counts` threads."""
    params, moments, squares = ([torch.zeros(TENSOR) for _ in range(count)] for _ in range(3))
    grads = [torch.randn(TENSOR) for _ in range(count)]
    steps = [torch.zeros(()) for _ in range(count)]

    def adamw():
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(params, grads, moments, squares, [], steps, amsgrad=False, lr=1e-4, beta1=0.9,
                            beta2=0.98, weight_decay=0.2, eps=1e-6, maximize=False)

    cpu, rows = torch.device("cpu"), []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        rows.append((threads, {"adamw": best_of_three(adamw),
                               "norm get_total_norm": best_of_three(lambda: get_total_norm(grads)),
                               "norm squared_norm": best_of_three(lambda: squared_norm(grads, cpu)),
                               "clip scaling": best_of_three(lambda: torch._foreach_mul_(grads, torch.tensor(0.999)))}))
    return rows


def copy_parts(count: int) -> dict[str, float]:
    """Seconds to copy `count` tensors to the GPU and back, from page-locked and pageable host memory."""
    device = [torch.empty(TENSOR, device="cuda") for _ in range(count)]
    seconds = {}
    for pinned in (True, False):
        host = [torch.empty(TENSOR, pin_memory=pinned) for _ in range(count)]
        for direction, sources, targets in (("to GPU", host, device), ("to host", device, host)):
            def copy():
                for target, source in zip(targets, sources):
                    target.copy_(source, non_blocking=True)
            seconds[f"copy {direction}, {'page-locked' if pinned else 'pageable'}"] = best_of_three(copy, True)
        del host
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parameters", type=float, default=1e9)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    args = parser.parse_args()
    count = max(1, int(args.parameters) // TENSOR)
    rows = host_parts(count, args.threads)
    if torch.cuda.is_available():
        rows.append((None, copy_parts(count)))
    for threads, seconds in rows:
        for part, s in seconds.items():
            print(json.dumps({"part": part, "parameters": count * TENSOR, "threads": threads, "s": round(s, 3),
                              "s_per_1e9_parameters": round(s / (count * TENSOR) * 1e9, 3),
                              "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
