"""Per-sample host cost of the data workers' steps on one core: tar reading, JPEG decode, each step of
OpenCLIP's ViT-B-32 train transform, tokenising, and seeding each sample's augmentation (fsdpclip.data.batches
forks the CPU generator per sample; `torch.manual_seed` beside the CPU generator's own seeding).
Writes one shard of 400 benchmark JPEGs (benchmarks/jpeg_data.py) under --dir first.

    python benchmarks/worker_profile.py [--dir /tmp/profshard]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jpeg_data import write_shard  # noqa: E402


def per_sample_ms(label: str, work, items: list) -> None:
    began = time.perf_counter()
    for item in items:
        work(item)
    print(f"{label:50s} {(time.perf_counter() - began) / len(items) * 1e3:.3f} ms/sample", flush=True)


def seeded(seed_with):
    def work(seed: int) -> None:
        with torch.random.fork_rng(devices=[]):
            seed_with(seed)
    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/profshard"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    import open_clip
    import webdataset as wds
    from PIL import Image

    args.dir.mkdir(parents=True, exist_ok=True)
    tar = args.dir / "000000.tar"
    if not tar.exists():
        write_shard((tar, 0, 400, 256))
    began = time.perf_counter()
    samples = list(wds.WebDataset(str(tar), shardshuffle=False))
    print(f"{'read tar + group':50s} {(time.perf_counter() - began) / len(samples) * 1e3:.3f} ms/sample")
    per_sample_ms("PIL open + load (decode)", lambda s: Image.open(io.BytesIO(s["jpg"])).load(), samples)
    images = [Image.open(io.BytesIO(s["jpg"])).convert("RGB") for s in samples]
    steps = open_clip.image_transform(224, is_train=True).transforms
    for k in range(1, len(steps) + 1):
        def through(image, chosen=steps[:k]):
            for step in chosen:
                image = step(image)
        per_sample_ms(f"transform steps 1..{k} (last: {type(steps[k - 1]).__name__})", through, images)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    per_sample_ms("tokenise one caption", lambda s: tokenizer([s["txt"].decode()]), samples)
    seeds = list(range(len(samples)))
    per_sample_ms("fork_rng + torch.manual_seed", seeded(torch.manual_seed), seeds)
    per_sample_ms("fork_rng + default_generator.manual_seed (fsdpclip)", seeded(torch.default_generator.manual_seed), seeds)


if __name__ == "__main__":
    main()
