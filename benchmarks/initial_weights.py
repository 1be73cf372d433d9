"""Rank 0's initial weights: OpenCLIP's serial init beside model.init 'parallel', in one process.

    python benchmarks/initial_weights.py --model ViT-bigG-14 [--spec examples/mt5-xxl-eva02-e-14.json]

Times `fsdpclip.model.weights.initial_model` for each init on this machine's cores (what rank 0 does
before the first step) and prints parameters, seconds and values drawn per second.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from fsdpclip.model.weights import initial_model
from fsdpclip.run.node import usable_cores
from fsdpclip.jobspec.job import ModelSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ViT-bigG-14")
    parser.add_argument("--spec", help="a job spec whose model block to use instead of --model")
    args = parser.parse_args()
    block = json.load(open(args.spec))["model"] if args.spec else {"name": args.model}
    for init in ("openclip", "parallel"):
        began = time.perf_counter()
        model = initial_model(ModelSpec(**block), seed=0, init=init)
        seconds = time.perf_counter() - began
        parameters = sum(p.numel() for p in model.parameters())
        print(json.dumps({"model": block.get("name", args.spec), "init": init, "cores": usable_cores(),
                          "parameters": parameters, "seconds": round(seconds, 1)}), flush=True)
        del model
        gc.collect()


if __name__ == "__main__":
    main()
