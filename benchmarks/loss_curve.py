"""fsdpclip's loss curve beside the DDP reference's, from the same initial weights on the same batches.

    torchrun --standalone --nproc-per-node=2 benchmarks/loss_curve.py --model ViT-B-32 --batch 128 --steps 200 \\
        --lr 1e-4 --warmup 50 --compile auto true --out curves.json
    python benchmarks/loss_curve.py --plot-only curves.json --png curves.png     # redraw, no GPU

In one process group, each run on K fixed batches per rank of scikit-learn's handwritten digits with
their captions (the demo's data at the model's resolution), cycled, so the loss falls: the DDP reference (OpenCLIP's model, autocast bf16, fused AdamW with
open_clip_train's weight-decay split and cosine schedule, ClipLoss with local loss and gathered
gradients) with seed A, again with seed A (the spread of one seed: nondeterministic kernels), and
with seed B (the spread between seeds); fsdpclip's trainer (bf16 parameters, fp32 reduction) with
seed A; with --compile also fsdpclip with each fsdp.compile given ('auto', the default: whole towers
compiled on CUDA where each tower holds ≤ 1B parameters; 'true': every block); with --float8 also fsdpclip with
fsdp.float8 in each recipe given (the spread its curve must stay within: DDP seed A against B). A seed fixes the
initial weights (OpenCLIP's CPU init) and the batches. Rank 0 writes every run's per-step losses and a summary of
the differences.
"""

from __future__ import annotations

import argparse
import gc
import io
import itertools
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fsdpclip.model.weights import initial_model  # noqa: E402
from fsdpclip.parallel.distributed import init_distributed  # noqa: E402
from fsdpclip.jobspec.job import ModelSpec  # noqa: E402
from fsdpclip.jobspec.jobfile import parse_job  # noqa: E402
from fsdpclip.train.metrics import Window  # noqa: E402
from fsdpclip.train.trainer import Trainer  # noqa: E402

WD, BETAS, EPS = 0.2, (0.9, 0.98), 1e-6


def fixed_batches(model, name: str, batch: int, seed: int, rank: int, count: int, device) -> list:
    """The K batches a rank cycles through: digits, captioned as the demo captions them."""
    import random

    from PIL import Image

    from fsdpclip.data.digits import CAPTIONS, CLASSNAMES, load_sklearn_digits, to_jpeg
    from fsdpclip.model.build import build_tokenizer, image_transform, model_config

    images, labels = load_sklearn_digits()
    pick = random.Random(f"{seed}/{rank}")
    order = pick.choices(range(len(labels)), k=batch * count)
    transform, tokenizer = image_transform(model, train=False), build_tokenizer(model_config(ModelSpec(name=name)))
    pixels = [transform(Image.open(io.BytesIO(to_jpeg(images[i]))).convert("RGB")) for i in order]
    texts = tokenizer([pick.choice(CAPTIONS).format(CLASSNAMES[labels[i]]) for i in order])
    return [(torch.stack(pixels[k * batch:(k + 1) * batch]).to(device), texts[k * batch:(k + 1) * batch].to(device))
            for k in range(count)]


def ddp_curve(name: str, batch: int, steps: int, seed: int, count: int, lr: float, warmup: int) -> list[float]:
    """The plain OpenCLIP + DDP loop, as open_clip_train runs it (bf16 autocast)."""
    from open_clip.loss import ClipLoss
    from open_clip_train.scheduler import cosine_lr

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = initial_model(ModelSpec(name=name), seed, init="openclip")  # the models it compares are < 1B: 'auto' is OpenCLIP's.to(device)
    batches = fixed_batches(model, name, batch, seed, rank, count, device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.index is not None
                                                     else None)
    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n  # noqa: E731
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
                                   {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": WD}],
                                  lr=lr, betas=BETAS, eps=EPS, fused=True)
    schedule = cosine_lr(optimizer, lr, warmup, steps)
    loss_fn = ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True, rank=rank, world_size=world)
    losses = []
    for step, (images, texts) in zip(range(steps), itertools.cycle(batches)):
        schedule(step)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(*ddp(images, texts))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(loss.detach())
    return _mean_over_ranks(losses)


def fsdpclip_curve(name: str, batch: int, steps: int, seed: int, count: int, lr: float, warmup: int, env,
                   run_root: str, run_name: str, fsdp: dict) -> list[float]:
    job = parse_job({"run": {"name": run_name, "output_dir": run_root, "seed": seed},
                     "model": {"name": name}, "fsdp": fsdp,
                     "optimizer": {"lr": lr, "weight_decay": WD, "betas": list(BETAS), "eps": EPS},
                     "schedule": {"kind": "cosine", "warmup_steps": warmup, "steps": steps},
                     "data": {"source": "synthetic"}, "batch": {"per_gpu": batch},
                     "checkpoint": {"resume": None, "at_end": False},
                     "launch": {"gpus_per_node": env.world_size, "device": env.device.type}})
    trainer = Trainer(job, env)
    trainer.feed.batch_iter = itertools.cycle(fixed_batches(trainer.model, name, batch, seed, env.rank, count,
                                                            env.device))
    window, losses = Window(), []
    for _ in range(steps):
        loss, _ = trainer.train_step(window)
        losses.append(loss)
    return _mean_over_ranks(losses)


def _mean_over_ranks(losses: list[torch.Tensor]) -> list[float]:
    stacked = torch.stack(losses).float()
    dist.all_reduce(stacked)
    return (stacked / dist.get_world_size()).tolist()


def difference(a: list[float], b: list[float], window: int = 10) -> dict:
    """Largest step difference, and the largest difference of the 10-step means."""
    steps = [abs(x - y) for x, y in zip(a, b)]
    means = [abs(sum(a[i:i + window]) - sum(b[i:i + window])) / window for i in range(0, len(a), window)]
    return {"max_step": max(steps), "max_10_step_mean": max(means), "final_10_step_mean": means[-1]}


def plot(result: dict, png: str) -> None:
    """The curves (10-step means) and each run's difference from DDP seed A."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["losses"]
    reference = runs["DDP seed A"]
    figure, (curves, gaps) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, losses in runs.items():
        means = [sum(losses[i:i + 10]) / len(losses[i:i + 10]) for i in range(0, len(losses), 10)]
        curves.plot(range(0, len(losses), 10), means, label=name, linestyle="--" if "DDP" in name else "-")
        if name != "DDP seed A":
            gaps.plot([abs(a - b) for a, b in zip(losses, reference)], label=name, linewidth=0.8)
    title = f"{result['model']}, {result['batch_per_gpu']}/GPU × {result['gpus']} GPUs, bf16, lr {result['lr']:g}"
    curves.set(title=f"loss (10-step means): {title}", xlabel="step", ylabel="loss")
    gaps.set(title="|loss − DDP seed A| per step", xlabel="step", yscale="log")
    curves.legend()
    gaps.legend()
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fixed-batches", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs=2, default=(0, 1))
    parser.add_argument("--repeat", action="store_true", help="also DDP with seed A a second time")
    parser.add_argument("--compile", nargs="+", default=[], choices=["auto", "true"],
                        help="also fsdpclip with these fsdp.compile settings (eager is always run)")
    parser.add_argument("--float8", nargs="+", default=[], choices=["tensorwise", "rowwise"],
                        help="also fsdpclip with fsdp.float8 true and these recipes (compile 'auto', the default)")
    parser.add_argument("--out", help="where to write the curves (JSON)")
    parser.add_argument("--plot-only", help="redraw the plot of a saved JSON (no GPU)")
    parser.add_argument("--png", help="with --plot-only: the picture to write")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), args.png)
        return
    env = init_distributed("cuda" if torch.cuda.is_available() else "cpu", timeout_s=600)
    seed_a, seed_b = args.seeds
    common = (args.model, args.batch, args.steps)
    shape = (args.fixed_batches, args.lr, args.warmup)
    runs, seconds = {}, {}
    plan = [("DDP seed A", lambda: ddp_curve(*common, seed_a, *shape))]
    if args.repeat:
        plan.append(("DDP seed A again", lambda: ddp_curve(*common, seed_a, *shape)))
    plan.append(("DDP seed B", lambda: ddp_curve(*common, seed_b, *shape)))
    with tempfile.TemporaryDirectory() as root:
        variants = {"fsdpclip seed A": {"compile": False}}
        variants.update((f"fsdpclip compile {setting} seed A", {"compile": True if setting == "true" else setting})
                        for setting in args.compile)
        variants.update((f"fsdpclip float8 {recipe} seed A", {"float8": True, "float8_recipe": recipe})
                        for recipe in args.float8)
        plan += [(label, lambda i=i, fsdp=fsdp: fsdpclip_curve(*common, seed_a, *shape, env, root, f"curve-{i}",
                                                               fsdp))
                 for i, (label, fsdp) in enumerate(variants.items())]
        for name, run in plan:
            began = time.perf_counter()
            runs[name] = run()
            seconds[name] = time.perf_counter() - began
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if env.is_main:
        reference = runs["DDP seed A"]
        summary = {name: difference(curve, reference) for name, curve in runs.items() if name != "DDP seed A"}
        result = {"model": args.model, "batch_per_gpu": args.batch, "gpus": env.world_size, "steps": args.steps,
                  "lr": args.lr, "warmup": args.warmup, "fixed_batches": args.fixed_batches, "seeds": [seed_a, seed_b], "torch": torch.__version__,
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "seconds": seconds, "against_ddp_seed_a": summary,
                  "losses": runs}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        for name, row in summary.items():
            print(f"{name:<26} vs DDP seed A: max step diff {row['max_step']:.4f}, max 10-step-mean diff "
                  f"{row['max_10_step_mean']:.4f}, last 10 steps {row['final_10_step_mean']:.4f} "
                  f"({seconds[name]:.0f} s)", flush=True)
        print("first/last losses:", {k: (round(v[0], 4), round(v[-1], 4)) for k, v in runs.items()}, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
