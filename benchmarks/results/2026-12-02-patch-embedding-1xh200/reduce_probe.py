"""Which eager ops of ViT-B-32's default step (not graphed, so the profiler ties kernels to ops) take device
time: aten ops by input shape, self CUDA time per step; run under torchrun with one process.

    torchrun --standalone --nproc-per-node=1 reduce_probe.py
"""
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from fsdpclip.distributed import init_distributed
from fsdpclip.jobfile import parse_job
from fsdpclip.metrics import Window
from fsdpclip.trainer import Trainer

STEPS = 2
env = init_distributed("cuda", timeout_s=180)
with tempfile.TemporaryDirectory() as root:
    job = parse_job({"run": {"name": "probe", "output_dir": root}, "model": {"name": "ViT-B-32"},
                     "fsdp": {"cuda_graph": False}, "schedule": {"kind": "constant", "steps": 10 ** 6},
                     "data": {"source": "synthetic"}, "batch": {"per_gpu": 256},
                     "checkpoint": {"resume": None, "at_end": False}, "launch": {"gpus_per_node": 1}})
    trainer = Trainer(job, env)
    window = Window()
    for _ in range(4):
        trainer.train_step(window)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(STEPS):
            trainer.train_step(window)
        torch.cuda.synchronize()
    rows = [(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0), e)
            for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
    for time_us, e in sorted(rows, key=lambda r: -r[0])[:25]:
        print(f"{time_us / STEPS / 1e3:7.3f} ms  {e.count // STEPS:4d}x  {e.key:34s} {str(e.input_shapes)[:120]}")
dist.destroy_process_group()
