"""The webdataset stream: broken samples, uneven shards over several epochs, exact positions."""

from __future__ import annotations

import json
import sys

import torch
import webdataset as wds

from conftest import TINY_CONFIG, write_job
from ranks import run_group
from fsdpclip.data import ShardStream, WebDatasetBatches
from fsdpclip.digits import CLASSNAMES, load_sklearn_digits, to_jpeg
from fsdpclip.spec import WebDatasetSpec


def write_shards(directory, sizes: list[int], broken: dict[int, str] | None = None) -> str:
    """Shards of digit pairs with the given sizes; `broken` maps a global sample index to a defect."""
    images, labels = load_sklearn_digits()
    index = 0
    for shard, size in enumerate(sizes):
        with wds.TarWriter(str(directory / f"s-{shard:03d}.tar")) as sink:
            for _ in range(size):
                sample = {"__key__": f"{index:06d}", "jpg": to_jpeg(images[index]),
                          "txt": f"the digit {CLASSNAMES[labels[index]]}."}
                defect = (broken or {}).get(index)
                if defect == "image":
                    sample["jpg"] = b"this is not a jpeg"
                elif defect == "caption":
                    del sample["txt"]
                sink.write(sample)
                index += 1
    return str(directory / f"s-{{000..{len(sizes) - 1:03d}}}.tar")


def _stream(urls: str, batch: int, workers: int = 0, **spec) -> WebDatasetBatches:
    import torchvision.transforms as T

    spec = WebDatasetSpec(urls=urls, samples=100, workers=workers, **spec)
    tokenize = lambda texts: torch.zeros(len(texts), 4, dtype=torch.long)  # noqa: E731
    stream = ShardStream(spec, T.ToTensor(), tokenize, batch, rank=0, world_size=1, seed=0)
    return WebDatasetBatches(stream, workers, pin_memory=False)


def test_broken_samples_are_skipped_and_counted(tmp_path):
    urls = write_shards(tmp_path, [10, 10], broken={3: "image", 14: "caption"})
    batches = _stream(urls, batch=6, shuffle_buffer=0)
    iterator = iter(batches)
    images = [next(iterator)[0] for _ in range(3)]  # 18 good samples in epoch 0
    assert all(b.shape == (6, 3, 32, 32) for b in images)
    assert batches.position.epoch == 0
    assert batches.position.broken == 2


def test_position_continues_exactly(tmp_path):
    urls = write_shards(tmp_path, [9, 12, 7, 11])
    full = _stream(urls, batch=4, workers=2, shuffle_buffer=5)
    iterator = iter(full)
    reference = [next(iterator)[0] for _ in range(12)]  # crosses into the second epoch
    first = _stream(urls, batch=4, workers=2, shuffle_buffer=5)
    iterator = iter(first)
    head = [next(iterator)[0] for _ in range(5)]
    resumed = _stream(urls, batch=4, workers=2, shuffle_buffer=5)
    resumed.position = first.position
    iterator = iter(resumed)
    tail = [next(iterator)[0] for _ in range(7)]
    for got, want in zip(head + tail, reference):
        assert torch.equal(got, want)


def test_uneven_shards_several_epochs_on_two_ranks(tmp_path):
    """Ranks with 3 vs 60 samples per epoch both run every step; the broken sample is counted."""
    urls = write_shards(tmp_path, [3, 60, 5, 40], broken={70: "image"})
    job = {
        "run": {"name": "uneven", "output_dir": str(tmp_path / "runs")},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32"},
        "schedule": {"epochs": 3},
        "data": {"urls": urls, "samples": 108, "workers": 1, "shuffle_buffer": 10},
        "batch": {"per_gpu": 4},
        "logging": {"every_steps": 5},
        "launch": {"gpus_per_node": 2, "device": "cpu", "collective_timeout_s": 60},
    }
    path = write_job(tmp_path, job)
    proc = run_group([sys.executable, "-m", "fsdpclip", "launch", str(path)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-5000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "uneven" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == (108 // 8) * 3
    assert records[-1]["broken_samples"] >= 1  # a running total over all ranks
    assert (tmp_path / "runs" / "uneven" / "job.json").exists()
