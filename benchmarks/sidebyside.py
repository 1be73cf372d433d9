"""Side by side in one torchrun process: the plain OpenCLIP reference (benchmarks/reference_step.py) and fsdpclip's trainer (under variants
of its fsdp block) on device-resident synthetic data.

    torchrun --standalone --nproc-per-node=2 benchmarks/sidebyside.py --model ViT-B-32 --batch 256 \\
        --variants '{"default": {}, "per-block": {"unit_size": 1}, "ema": {"ema.decay": 0.9999}}' \\
        --out rows.jsonl [--profile per-block]

A variant is the spec's fsdp block, but for its dotted keys, which set other fields as `fsdpclip launch --set` does.

Each side: build, warm-up steps, N timed steps (device synchronised), samples/s/GPU, MFU
(FLOPs per sample counted on the meta device, against --peak-tflops, a bf16 rate: for variants with
fsdp.float8 it is bf16-equivalent, and labelled so) and peak memory; rank 0 appends one JSON line per side.
Variants named in --float8-any-shape run every MLP layer of OpenCLIP's blocks whose dims are multiples of 16 in
float8, not only those of the sizes torchao measured faster (model.float8.gains_from_float8): what measures
that rule.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_step import reference_rate  # noqa: E402
from throughput import matmul_peak_tflops  # noqa: E402

from fsdpclip.model.build import build_model, training_flops_per_sample  # noqa: E402
from fsdpclip.model import float8  # noqa: E402
from fsdpclip.parallel.distributed import init_distributed  # noqa: E402
from fsdpclip.jobspec.job import Job, ModelSpec  # noqa: E402
from fsdpclip.jobspec.jobfile import apply_overrides, parse_job  # noqa: E402
from fsdpclip.train import trainer as trainer_module  # noqa: E402
from fsdpclip.train.metrics import Window  # noqa: E402
from fsdpclip.train.trainer import Trainer  # noqa: E402


def variant_job(model: str, batch: int, variant: dict, world_size: int, run_root: str) -> Job:
    """The trainer's job of a variant: its keys are the fsdp block's, but dotted ones, which set other fields as
    `fsdpclip launch --set` does (e.g. "ema.decay": 0.9999)."""
    raw, refused = apply_overrides(
        {"run": {"name": "variant", "output_dir": run_root}, "model": {"name": model},
         "fsdp": {key: value for key, value in variant.items() if "." not in key},
         "schedule": {"kind": "constant", "steps": 10 ** 6}, "data": {"source": "synthetic"},
         "batch": {"per_gpu": batch}, "checkpoint": {"resume": None, "at_end": False},
         "launch": {"gpus_per_node": world_size}},
        [f"{key}={json.dumps(value)}" for key, value in variant.items() if "." in key])
    if refused:
        raise ValueError("; ".join(map(str, refused)))
    return parse_job(raw)


def trainer_rate(model: str, batch: int, variant: dict, warmup: int, steps: int, env, run_root: str,
                 profile: bool, parts: bool) -> dict:
    job = variant_job(model, batch, variant, env.world_size, run_root)
    # Variants with different inductor options (fsdp.compile_options) compile the same forwards (a tower's
    # `Transformer.forward`, two shapes) into new cache entries: without a reset the fifth such variant meets
    # dynamo's recompile limit (8 per code object) and runs those modules eager.
    torch._dynamo.reset()
    torch.cuda.reset_peak_memory_stats(env.device)
    built = time.perf_counter()
    trainer = Trainer(job, env)
    build_s = time.perf_counter() - built
    window = Window()
    for _ in range(warmup):
        trainer.train_step(window)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(window)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    result = {"samples_per_s_per_gpu": batch * steps / elapsed, "build_s": build_s,
              "peak_memory_gib": torch.cuda.max_memory_allocated(env.device) / 2 ** 30,
              "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in trainer.model.modules())}
    if parts:
        result["parts_s"] = step_parts(trainer, window, steps)
    if profile:
        from torch.profiler import ProfilerActivity
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_STEPS):
                trainer.train_step(window)
            torch.cuda.synchronize()
        if env.is_main:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
            print(device_time_by_kind(prof, steps=PROFILED_STEPS))
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return result


@contextlib.contextmanager
def float8_any_shape(chosen: bool):
    """Inside: float8 takes every MLP layer whose dims are multiples of 16, whatever its size (where `chosen`)."""
    rule = float8.gains_from_float8
    if chosen:
        float8.gains_from_float8 = lambda out_features, in_features, recipe: not (out_features % 16 or in_features % 16)
    try:
        yield
    finally:
        float8.gains_from_float8 = rule


def step_parts(trainer: Trainer, window: Window, steps: int) -> dict[str, float]:
    """The median seconds of a step's parts over `steps` more steps, each part synchronised with the device:
    forward and backward (with CPU offload, also the parameters' copies to the GPU and the gradients' back),
    the gradient norm and clip, the optimizer step, and the whole step."""
    seen: dict[str, list[float]] = {}

    def timed(part: str, work):
        def run(*args, **kwargs):
            torch.cuda.synchronize()
            began = time.perf_counter()
            result = work(*args, **kwargs)
            torch.cuda.synchronize()
            seen.setdefault(part, []).append(time.perf_counter() - began)
            return result
        return run

    forward_backward, optimizer_step = trainer.forward_backward, trainer.optimizer.step
    clip = trainer_module.clip_gradients
    trainer.forward_backward = timed("forward_backward", forward_backward)
    trainer.optimizer.step = timed("optimizer", optimizer_step)
    trainer_module.clip_gradients = timed("norm_and_clip", clip)
    step = timed("step", trainer.train_step)
    try:
        for _ in range(steps):
            step(window)
    finally:
        trainer.forward_backward, trainer_module.clip_gradients = forward_backward, clip
        del trainer.optimizer.step
    return {part: round(statistics.median(times), 4) for part, times in seen.items()}


PROFILED_STEPS = 3
# Kernel names -> kind, first match wins (attention before matmul: efficient attention's kernels are CUTLASS's).
KERNEL_KINDS = (("attention", ("flash", "fmha", "sdpa", "attention")), ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas")),
                ("collectives", ("nccl",)), ("compiled (triton)", ("triton_",)),
                ("optimizer", ("multi_tensor", "adam", "foreach")), ("copies to the GPU", ("memcpy htod",)),
                ("copies to the host", ("memcpy dtoh",)), ("copies", ("memcpy", "memset", "copy")))


def device_time_by_kind(prof, steps: int, top: int = 30) -> str:
    """Where the device's time goes per step: kernels grouped by KERNEL_KINDS (the rest: 'other'), ms and %,
    then the `top` kernels."""
    kernels = sorted(((getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0), e.key)
                      for e in prof.key_averages() if str(getattr(e, "device_type", "CPU")).endswith("CUDA")
                      and not getattr(e, "is_user_annotation", False)),  # FSDP's ranges: spans, not kernels
                     reverse=True)
    totals: dict[str, float] = {}
    for time_us, name in kernels:
        kind = next((k for k, words in KERNEL_KINDS if any(w in name.lower() for w in words)), "other")
        totals[kind] = totals.get(kind, 0.0) + time_us
    whole = sum(totals.values()) or 1.0
    return "device time per step: " + ", ".join(f"{k} {v / steps / 1e3:.1f} ms ({v / whole:.0%})"
                                                for k, v in sorted(totals.items(), key=lambda kv: -kv[1])) + \
        "".join(f"\n  {t / steps / 1e3:7.2f} ms  {name[:110]}" for t, name in kernels[:top] if t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--variants", required=True, help="JSON: name -> fsdp block (dotted keys: other fields)")
    parser.add_argument("--reference", default="compile",
                        help="comma list of plain OpenCLIP steps beside it: eager, compile (DDP-wrapped only at "
                             "more than one GPU), none")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", default="", help="variant name to profile")
    parser.add_argument("--parts", action="store_true",
                        help="after the timed steps, time each step's parts over as many steps (parts_s)")
    parser.add_argument("--float8-any-shape", nargs="*", default=[],
                        help="variant names whose float8 takes every MLP layer of dims multiple of 16")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="bf16 peak of one GPU, for MFU (default: the bf16 matmul rate measured here)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    env = init_distributed("cuda", timeout_s=180)
    peak = args.peak_tflops or matmul_peak_tflops()
    flops = training_flops_per_sample(build_model(ModelSpec(name=args.model)))
    rows = []

    def report(row: dict) -> None:
        """Keep one side's row (written at once: a run stopped at its time limit keeps the sides it finished)."""
        rows.append(row)
        if not env.is_main:
            return
        rate = row.get("samples_per_s_per_gpu")
        mfu = rate * flops / (peak * 1e12) if rate else None
        with open(args.out, "a") as f:
            f.write(json.dumps({"model": args.model, "batch_per_gpu": args.batch, "gpus": env.world_size,
                                "flops_per_sample": flops, "peak_tflops": peak, "mfu": mfu, **row}) + "\n")
        base = rows[0]
        ratio = f"{rate / base['samples_per_s_per_gpu']:.2f}× {base['variant']}" \
            if rate and base.get("samples_per_s_per_gpu") else ""
        share = f"{mfu:.1%} MFU{' (bf16-eq.)' if row.get('mfu_bf16_equivalent') else ''}" if mfu else ""
        print(f"{args.model} bs{args.batch} {row['variant']:<28} {rate or 0:8.1f} /s/GPU {share:>10} "
              f"{row.get('peak_memory_gib', 0):6.1f} GiB build {row.get('build_s', 0):5.1f} s {ratio} "
              f"{row.get('error', '')}{row.get('parts_s', '')}", flush=True)

    for kind in [k for k in args.reference.split(",") if k != "none"]:
        report({"variant": f"reference {kind}", **reference_rate(args.model, args.batch, args.warmup, args.steps,
                                                                 compile_model=kind == "compile")})
        gc.collect()
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as run_root:
        for name, variant in json.loads(args.variants).items():
            try:
                with float8_any_shape(name in args.float8_any_shape):
                    result = trainer_rate(args.model, args.batch, variant, args.warmup, args.steps, env, run_root,
                                          profile=name == args.profile, parts=args.parts)
            except Exception as exc:  # one broken variant must not hide the others
                result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            report({"variant": name, "fsdp": variant, **result, "mfu_bf16_equivalent": variant.get("float8") is True,
                    "float8_any_shape": name in args.float8_any_shape})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
