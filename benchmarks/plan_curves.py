"""What `fsdpclip plan` predicts from 1 to 128 nodes: samples/s per GPU for each strategy (replicate,
HSDP with one node per shard group, full FSDP), for ViT-B-32 and ViT-bigG-14 at their examples'
per-GPU batch and at a small one (32), where communication starts to show. No GPU: the plan model
only (docs/architecture.md, 'The plan model').

    python benchmarks/plan_curves.py --png docs/plan-curves.png --out benchmarks/results/plan_curves.json
    python benchmarks/plan_curves.py --plot-only benchmarks/results/plan_curves.json --png docs/plan-curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fsdpclip.plan.resolved import plan_job
from fsdpclip.jobspec.jobfile import load_job

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = {"ViT-B-32": REPO / "examples" / "vit-b-32-laion400m.json", "ViT-bigG-14": REPO / "examples" / "vit-bigg-14.json"}
NODES = (1, 2, 4, 8, 16, 32, 64, 128)


def curves(job_file: Path, per_gpu: int | None, gpus_per_node: int, memory_gib: float) -> dict:
    """{strategy: [(nodes, samples/s/GPU, memory GiB, fits)]} for one job and batch."""
    overrides = ["batch.global_batch=null"] + ([f"batch.per_gpu={per_gpu}"] if per_gpu else [])
    job = load_job(job_file, overrides)
    out: dict[str, list] = {}
    for nodes in NODES:
        plan = plan_job(job, nodes, gpus_per_node, memory_gib)
        world = nodes * gpus_per_node
        picks = {"replicate": 1, f"HSDP {gpus_per_node} (a node)": gpus_per_node, "full FSDP": world}
        for label, degree in picks.items():
            row = next(r for r in plan.rows if r.degree == degree)
            out.setdefault(label, []).append((nodes, row.samples_per_s_per_gpu, row.memory_gib,
                                              row.memory_gib <= memory_gib))
        out.setdefault("auto", []).append((nodes, plan.auto_degree))
    return {"per_gpu": job.batch.per_gpu, "curves": out}


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(model, batch) for model, batches in result["models"].items() for batch in batches]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for axis, (model, batch) in zip(axes, panels):
        data = result["models"][model][batch]
        for label, points in data["curves"].items():
            if label == "auto":
                continue
            nodes = [p[0] for p in points]
            axis.plot(nodes, [p[1] for p in points], marker="o", markersize=3, label=label)
            unfit = [p for p in points if not p[3]]
            if unfit:
                axis.scatter([p[0] for p in unfit], [p[1] for p in unfit], marker="x", color="red", zorder=3,
                             label=f"{label}: over {result['gpu_memory_gib']:g} GiB")
        axis.set(title=f"{model}, {data['per_gpu']}/GPU", xscale="log", xlabel="nodes (× 8 GPUs)",
                 ylabel="estimated samples/s/GPU")
        axis.set_xticks(NODES, [str(n) for n in NODES])
        axis.set_ylim(bottom=0)
        axis.legend(fontsize=7)
    figure.suptitle(f"fsdpclip plan: {result['intra_gbps']:g} Gb/s/GPU in a node, {result['inter_gbps']:g} across; "
                    "sustained TFLOP/s as measured on H200", fontsize=9)
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    parser.add_argument("--small-batch", type=int, default=32)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot-only", type=Path, help="redraw from a saved --out file")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(args.plot_only.read_text()), args.png)
        return
    from fsdpclip.plan.mesh import INTER_GBPS, INTRA_GBPS

    result = {"gpu_memory_gib": args.gpu_memory_gib, "intra_gbps": INTRA_GBPS, "inter_gbps": INTER_GBPS, "models": {
        model: {"example": curves(path, None, args.gpus_per_node, args.gpu_memory_gib),
                "small": curves(path, args.small_batch, args.gpus_per_node, args.gpu_memory_gib)}
        for model, path in EXAMPLES.items()}}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    if args.png:
        plot(result, args.png)


if __name__ == "__main__":
    main()
