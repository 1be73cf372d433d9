"""The reference: a plain OpenCLIP training step as a user would run it (autocast bf16, fused AdamW),
eager or with `torch.compile(model)`; wrapped in DDP (around the compiled model) only at more than one
GPU, as open_clip_train does.

Run by torchrun, one process per GPU, on a GPU-resident random batch; rank 0 writes JSON:

    torchrun --standalone --nproc-per-node=2 benchmarks/reference_step.py --model ViT-B-32 --batch 256 \
        --compile --out reference.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def reference_rate(model_name: str, batch: int, warmup: int, steps: int, compile_model: bool = False) -> dict:
    """samples/s/GPU and peak memory of the plain step (the process group is already up)."""
    import open_clip
    from open_clip.loss import ClipLoss

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats(device)
    model = open_clip.create_model(model_name, device=device)
    size = model.visual.image_size
    if compile_model:
        model = torch.compile(model)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loss_fn = ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True, rank=rank, world_size=world)
    images = torch.randn(batch, 3, *size, device=device)
    texts = torch.randint(1, 49408, (batch, 77), device=device)

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(*model(images, texts))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    step().item()
    first = time.time() - float(os.environ.get("FSDPCLIP_LAUNCH_TIME", "nan"))
    for _ in range(warmup - 1):
        step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    return {"samples_per_s_per_gpu": batch * steps / elapsed,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30, "time_to_first_step_s": first}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, required=True, help="per GPU")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--compile", action="store_true", help="torch.compile the whole model")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    result = reference_rate(args.model, args.batch, args.warmup, args.steps, args.compile)
    result["world_size"] = dist.get_world_size()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
