"""The webdataset stream: broken samples, uneven shards over several epochs, exact positions."""

from __future__ import annotations

import io
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


def test_image_and_text_keys(tmp_path):
    """data.image_key (';'-separated, first found) and data.text_key choose the sample's members."""
    images, labels = load_sklearn_digits()
    with wds.TarWriter(str(tmp_path / "k-000.tar")) as sink:
        for i in range(6):
            sink.write({"__key__": f"{i:04d}", "png": to_jpeg(images[i]), "caption": f"digit {labels[i]}"})
    urls = str(tmp_path / "k-000.tar")
    taken = _stream(urls, batch=6, shuffle_buffer=0, image_key="webp;png", text_key="caption")
    batch_images, batch_texts = next(iter(taken))
    assert batch_images.shape == (6, 3, 32, 32) and taken.position.broken == 0
    default = _stream(urls, batch=1, shuffle_buffer=0)  # jpg/txt: every sample lacks them
    stream = default.stream
    stream.epoch = 0
    assert list(stream) == []


def test_position_continues_exactly(tmp_path):
    urls = write_shards(tmp_path, [9, 12, 7, 11])
    full = _stream(urls, batch=4, workers=2, shuffle_buffer=5)
    iterator = iter(full)
    reference = [next(iterator)[0] for _ in range(12)]  # crosses into the second epoch
    first = _stream(urls, batch=4, workers=2, shuffle_buffer=5)
    iterator = iter(first)
    head = [next(iterator)[0] for _ in range(5)]
    saved = io.BytesIO()  # as a checkpoint keeps it: torch.save of the state dict, loaded into a new stream
    torch.save(first.state_dict(), saved)
    saved.seek(0)
    resumed = _stream(urls, batch=4, workers=2, shuffle_buffer=5)
    resumed.load_state_dict(torch.load(saved, weights_only=False))
    iterator = iter(resumed)
    tail = [next(iterator)[0] for _ in range(7)]
    for got, want in zip(head + tail, reference):
        assert torch.equal(got, want)


def test_uneven_shards_several_epochs_on_two_ranks(tmp_path):
    """Shards of 3, 60, 5 and 40 samples over 2 ranks: every rank runs every step, each running through
    its shards at least once and going on into the next epoch; the broken sample is skipped and counted
    each time a rank reads it, and the logged total is the sum of the ranks' counts."""
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
    steps = (108 * 3) // 8  # the run's length in samples: 3 epochs of 108, 8 per step
    assert records[-1]["step"] == steps
    final = tmp_path / "runs" / "uneven" / "checkpoints" / f"step-{steps:08d}"
    positions = [torch.load(final / f"rank-{rank:05d}.pt", weights_only=False)["data"] for rank in (0, 1)]
    assert all(p["epoch"] >= 1 and p["emitted"] for p in positions), positions  # both went on past their shards
    assert records[-1]["broken_samples"] == sum(p["broken"] for p in positions) >= 1
