"""The reference: a plain OpenCLIP training step under DDP (autocast bf16, fused AdamW).

Run by torchrun, one process per GPU, on a GPU-resident random batch; rank 0 writes JSON:

    torchrun --standalone --nproc-per-node=2 benchmarks/ddp_step.py --model ViT-B-32 --batch 256 --out ddp.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, required=True, help="per GPU")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--compile", action="store_true", help="torch.compile the whole model")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import open_clip
    from open_clip.loss import ClipLoss

    start = float(os.environ.get("FSDPCLIP_LAUNCH_TIME", time.time()))
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = open_clip.create_model(args.model, device=device)
    if args.compile:
        model = torch.compile(model)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loss_fn = ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True, rank=rank, world_size=world)
    size = model.module.visual.image_size if not args.compile else model.module._orig_mod.visual.image_size
    images = torch.randn(args.batch, 3, *size, device=device)
    texts = torch.randint(1, 49408, (args.batch, 77), device=device)

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(*model(images, texts))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    step().item()
    first_step = time.time() - start
    for _ in range(args.warmup - 1):
        step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"samples_per_s_per_gpu": args.batch * args.steps / elapsed, "peak_memory_gib": peak,
                       "time_to_first_step_s": first_step, "world_size": world}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
