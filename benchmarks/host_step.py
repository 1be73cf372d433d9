"""The optimizer step CPU offload runs on the host: torch's fused AdamW over N fp32 parameters, in tensors
of a large model's shard sizes, at several thread counts.

    python benchmarks/host_adamw.py --parameters 1e9 --threads 1 4 8 16

Prints one JSON line per thread count: the best of three steps and the seconds per 10^9 parameters. The step
reads and writes each parameter, both moments and the gradient (28 bytes a parameter): memory-bound.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

TENSOR = 13_000_000  # elements per tensor, about a ViT-bigG-14 block's largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parameters", type=float, default=1e9)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    args = parser.parse_args()
    count = max(1, int(args.parameters) // TENSOR)
    params, moments, squares = ([torch.zeros(TENSOR) for _ in range(count)] for _ in range(3))
    grads = [torch.randn(TENSOR) for _ in range(count)]
    steps = [torch.zeros(()) for _ in range(count)]
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = []
        for _ in range(3):
            began = time.perf_counter()
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(params, grads, moments, squares, [], steps, amsgrad=False, lr=1e-4, beta1=0.9,
                                beta2=0.98, weight_decay=0.2, eps=1e-6, maximize=False)
            times.append(time.perf_counter() - began)
        print(json.dumps({"parameters": count * TENSOR, "threads": threads, "step_s": round(min(times), 3),
                          "s_per_1e9_parameters": round(min(times) / (count * TENSOR) * 1e9, 3),
                          "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
