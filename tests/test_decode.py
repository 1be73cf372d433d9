"""Training images: OpenCLIP's train transform split between the data workers (uint8) and the device, and
data.decode "gpu" (workers draw the crops, the device decodes, crops, resizes) and "mixed" (workers decode
and draw the crops, the device crops and resizes) against the "cpu" path."""

from __future__ import annotations

import io
import itertools
import os
import warnings
import zlib
from typing import Iterator

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from conftest import TINY_CONFIG, write_job
from fsdpclip.data import transform as decode
from fsdpclip.data.batches import WebDatasetBatches
from fsdpclip.jobspec.webdataset_spec import WebDatasetSpec
from fsdpclip.jobspec.preprocess import ColorJitterSpec, PreprocessSpec
from fsdpclip.jobspec.problems import SpecError
from fsdpclip.data.stream import ShardStream
from fsdpclip.data.jpeg import read_header, rgb_pixels
from fsdpclip.data.augment import coloured, crop_box
from fsdpclip.data.resize import resample_weights
from fsdpclip.data.transform import CroppedBatch, EncodedBatch, TrainImages, decode_mode, pooled_batch, unpacked

SIZE = 48  # the model's image size in these tests


def picture(rng, height: int, width: int) -> Image.Image:
    """A smooth random RGB image (JPEG-friendly, like a photo)."""
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BICUBIC)


def encoded(image: Image.Image, fmt: str = "JPEG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}), **options)
    return out.getvalue()


def train_transform(size: int = SIZE):
    """OpenCLIP's train transform, as fsdpclip.model.build.image_transform builds it for a model of this size."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    return image_transform_v2(PreprocessCfg(size=size), is_train=True)


def batches(tmp_path, images: list[tuple[str, bytes]], decode: str, transform, batch: int, workers: int = 0,
            engine_share: float = 0.0):
    """The first micro batch of `batch` samples of a shard of (key, image) samples, whose captions are
    their indices, decoded as `decode` says, through a real stream; and the stream. With `engine_share`, the
    hardware JPEG engines take that share of a 'mixed' stream (nvImageCodec's CPU decoder here)."""
    path = tmp_path / f"shard-{decode}.tar"
    with wds.TarWriter(str(path)) as sink:
        for index, (key, data) in enumerate(images):
            sink.write({"__key__": f"{index:04d}", key: data, "txt": f"sample {index}"})
    spec = WebDatasetSpec(urls=str(path), samples=batch, workers=workers, shuffle_buffer=0, decode=decode,
                          jpeg_engines=bool(engine_share))
    worker_transform = TrainImages(transform, decode, torch.device("cpu")).worker_transform
    stream = WebDatasetBatches(ShardStream(spec, worker_transform, caption_indices, batch, rank=0, world_size=1,
                                           seed=3), workers, pin_memory=False, engines=bool(engine_share))
    if engine_share:
        stream.engines.value[0] = engine_share
    return next(iter(stream)), stream


def caption_indices(captions: list[str]) -> torch.Tensor:
    """The tokens of `batches`' captions: each one's sample index."""
    return torch.tensor([[int(c.split()[-1])] for c in captions])


def levels(a: torch.Tensor, b: torch.Tensor, transform) -> torch.Tensor:
    """|a - b| of two normalised batches, in 8-bit levels of the pixels they were made from."""
    std = torch.tensor(transform.transforms[-1].std, device=a.device).view(-1, 1, 1)
    return ((a - b).abs() * std * 255).cpu()


def test_the_split_transform_is_open_clips_bit_for_bit():
    """Workers run OpenCLIP's train transform up to ToTensor and give uint8; the device's /255 and
    Normalize then give exactly what the whole transform gives, for the same seed (crops of several
    sizes, grayscale, upscaled)."""
    from fsdpclip.model.build import build_model, image_transform
    from fsdpclip.jobspec.job import ModelSpec

    transform = image_transform(build_model(ModelSpec(config=str(TINY_CONFIG))), train=True)
    split = TrainImages(transform, "cpu", torch.device("cpu"))
    rng = np.random.default_rng(0)
    sources = [picture(rng, 64, 64), picture(rng, 90, 50), picture(rng, 20, 24), picture(rng, 70, 80).convert("L")]
    for seed, image in enumerate(sources):
        image = image.convert("RGB")
        torch.manual_seed(seed)
        want = transform(image)
        torch.manual_seed(seed)
        pixels = split.worker_transform(image)
        assert pixels.dtype == torch.uint8
        got = split(pixels[None])[0]
        assert got.dtype == torch.float32 and torch.equal(got, want), seed


def test_a_transform_the_split_cannot_express_is_refused():
    from torchvision import transforms as T

    with pytest.raises(ValueError, match="cannot be split"):
        TrainImages(T.Compose([T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3), T.RandomErasing()]), "cpu", "cpu")
    jitter = train_transform()
    jitter.transforms.insert(1, T.ColorJitter(0.4))
    TrainImages(jitter, "cpu", "cpu")  # the workers can do it
    for mode in ("gpu", "mixed"):
        with pytest.raises(ValueError, match=f"'{mode}' crops .* also does .*ColorJitter.*use data.decode 'cpu'"):
            TrainImages(jitter, mode, "cpu")


def _both_paths(tmp_path, transform=None, copies: int = 1) -> tuple[list[bytes], torch.Tensor, EncodedBatch]:
    """JPEGs of several sizes (up- and downscaled, grayscale; `copies` times) through the "cpu" and "gpu"
    streams with the same seed: the JPEGs, the cpu path's uint8 batch and the gpu path's encoded one, whose
    crop boxes give, cropped and resized by PIL (and coloured by its colour draws), exactly the cpu path's
    pixels."""
    rng = np.random.default_rng(1)
    shapes = [(64, 64), (80, 52), (40, 36), (64, 100), (30, 30), (120, 90)]
    data = ([encoded(picture(rng, *shape)) for shape in shapes] + [encoded(picture(rng, 60, 70).convert("L"))]) * copies
    transform = transform or train_transform()
    (cpu_images, cpu_texts), _ = batches(tmp_path, [("jpg", d) for d in data], "cpu", transform, len(data))
    (encoded_batch, texts), _ = batches(tmp_path, [("jpg", d) for d in data], "gpu", transform, len(data))
    assert isinstance(encoded_batch, EncodedBatch) and encoded_batch.pixels is None
    assert torch.equal(texts, cpu_texts) and cpu_images.dtype == torch.uint8
    decoded = [Image.open(io.BytesIO(d)).convert("RGB") for d in data]
    colours = None if encoded_batch.colours is None else encoded_batch.colours[encoded_batch.order]
    assert torch.equal(coloured(pil_crops(decoded, encoded_batch), colours), cpu_images)
    return data, cpu_images, encoded_batch


def pil_crops(images: list[Image.Image], batch: EncodedBatch) -> torch.Tensor:
    """The batch's crop boxes cut from `images` and resized by PIL, as the cpu path does."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import pil_to_tensor, resized_crop

    boxes = [batch.boxes[row].tolist() for row in batch.order.tolist()]
    return torch.stack([pil_to_tensor(resized_crop(image, *box, list(batch.size), InterpolationMode.BICUBIC))
                        for image, box in zip(images, boxes)])


def test_gpu_decode_on_the_cpu_gives_the_cpu_paths_crops_and_pixels(tmp_path):
    """The device part run on the CPU (torchvision's libjpeg-turbo decoder, the same as PIL's) is PIL's
    bicubic resize in floating point: within 2 levels of PIL's 22-bit fixed-point one, mean 0.1 (PIL
    rounds between its two passes, and newer Pillows choose which pass comes first)."""
    _, cpu_images, batch = _both_paths(tmp_path)
    transform, device = train_transform(), torch.device("cpu")
    got = TrainImages(transform, "gpu", device)(batch)
    error = levels(got, TrainImages(transform, "cpu", device)(cpu_images), transform)
    assert error.max() <= 2 + 1e-3 and error.mean() <= 0.1, (error.max(), error.mean())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_on_cuda_matches_the_cpu_path(tmp_path):
    """On CUDA, as the trainer runs it (decoded by the DataLoader's pinning thread: EncodedBatch.pin_memory,
    on a stream of its own): the crops and resizes are PIL's, within 2 levels, of the pixels nvJPEG
    decoded; those differ from PIL's libjpeg-turbo (chroma upsampling, IDCT): on H200 by up to 26 levels,
    mean 1.8, on these images after the resize."""
    from torchvision.io import ImageReadMode, decode_jpeg

    data, cpu_images, batch = _both_paths(tmp_path)
    transform, cuda = train_transform(), torch.device("cuda")
    got = TrainImages(transform, "gpu", cuda)(batch.pin_memory())
    assert got.device.type == "cuda"
    nvjpeg = [Image.fromarray(decode_jpeg(torch.frombuffer(bytearray(d), dtype=torch.uint8), mode=ImageReadMode.RGB,
                                          device=cuda).permute(1, 2, 0).cpu().numpy()) for d in data]
    cpu = TrainImages(transform, "cpu", cuda)
    error = levels(got, cpu(pil_crops(nvjpeg, batch)), transform)
    assert error.max() <= 2 + 1e-3 and error.mean() <= 0.1, (error.max(), error.mean())
    assert levels(got, cpu(cpu_images), transform).mean() <= 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_mixed_decode_gives_the_cpu_paths_crops_and_pixels(tmp_path, device):
    """"mixed": the workers' crops are PIL's pixels in the gpu path's crop boxes (the same draws), and the
    device's resize is PIL's within 2 levels, mean 0.1, as for "gpu" on the CPU (on CUDA: as the trainer
    runs it, pinned by the pinning thread)."""
    data, cpu_images, encoded_batch = _both_paths(tmp_path)
    transform = train_transform()
    (batch, _), _ = batches(tmp_path, [("jpg", d) for d in data], "mixed", transform, len(data))
    assert isinstance(batch, CroppedBatch) and batch.pixels.dtype == torch.uint8
    boxes = encoded_batch.boxes[encoded_batch.order]
    assert torch.equal(batch.boxes[:, 2:], boxes[:, 2:]) and not batch.boxes[:, :2].any()
    assert len({tuple(box) for box in boxes[:, 2:].tolist()}) > 1  # crops of several sizes
    crop_bytes = 3 * boxes[:, 2] * boxes[:, 3]
    assert batch.pixels.shape == (int(crop_bytes.sum() + 3 * boxes[:, 3].max()),)  # end to end, not padded
    for crop, jpeg, (top, left, height, width) in zip(unpacked(batch.pixels, batch.boxes), data, boxes.tolist()):
        whole = torch.from_numpy(np.array(Image.open(io.BytesIO(jpeg)).convert("RGB")))  # (H, W, 3), as PIL
        assert torch.equal(crop[:height, :width], whole[top:top + height, left:left + width])
    target = torch.device(device)
    got = TrainImages(transform, "mixed", target)(batch.pin_memory() if device == "cuda" else batch)
    assert got.device.type == device
    error = levels(got, TrainImages(transform, "cpu", target)(cpu_images), transform)
    assert error.max() <= 2 + 1e-3 and error.mean() <= 0.1, (error.max(), error.mean())


def test_the_jpeg_engines_take_their_share_with_the_cpu_paths_crops(tmp_path, monkeypatch):
    """'mixed' with the hardware JPEG engines (nvImageCodec's CPU decoder stands in for them): the workers, started
    from a fork server, leave the share's JPEGs encoded; the others (the PNG among them) are cropped on the workers;
    the batch, decoded, cropped and resized on the device in sample order, is the cpu path's within 2 levels."""
    pytest.importorskip("nvidia.nvimgcodec")
    from fsdpclip.data import engines

    monkeypatch.setattr(engines, "_refused", [])
    monkeypatch.setattr(engines, "_DECODERS", {})  # this test's decoder leaves with it (later loaders fork)
    data, cpu_images, _ = _both_paths(tmp_path, copies=3)
    images = [("jpg", d) for d in data] + [("png", encoded(picture(np.random.default_rng(4), 50, 70), "PNG"))]
    transform = train_transform()
    (cpu_images, cpu_texts), _ = batches(tmp_path, images, "cpu", transform, len(images))
    (batch, texts), stream = batches(tmp_path, images, "mixed", transform, len(images), workers=1, engine_share=0.5)
    assert engines.worker_context(True).get_start_method() == "forkserver"
    assert torch.equal(texts, cpu_texts)
    assert isinstance(batch, CroppedBatch) and batch.jpegs is not None and batch.jpegs.engines
    assert 0 < len(batch.jpegs.lengths) < len(data) and len(batch.boxes) + len(batch.jpegs.lengths) == len(images)
    device = torch.device("cpu")
    error = levels(TrainImages(transform, "mixed", device)(batch), TrainImages(transform, "cpu", device)(cpu_images),
                   transform)
    assert error.max() <= 2 + 1e-3 and error.mean() <= 0.1, (error.max(), error.mean())
    assert engines._refused == [] and engines._failed_in_a_row == 0  # decoded by nvImageCodec, not the fallback


def test_where_the_engines_decode_nothing_the_jpegs_are_decoded_otherwise_and_none_are_sent(tmp_path, monkeypatch):
    """Engines that cannot start (a GPU without them, a driver too old): the batch's JPEGs are decoded as nvJPEG's
    path decodes them, and the share falls to 0 at the next batch, for good."""
    from fsdpclip.data import engines

    data, cpu_images, _ = _both_paths(tmp_path)
    transform = train_transform()
    (batch, _), stream = batches(tmp_path, [("jpg", d) for d in data], "mixed", transform, len(data), engine_share=1.0)
    assert isinstance(batch, EncodedBatch) and batch.engines  # every JPEG to the engines (no workers: in this process)

    class Refusing:
        def __init__(self, device):
            raise RuntimeError("no hardware JPEG decoder on this device")

    monkeypatch.setattr(engines, "_Decoder", Refusing)
    monkeypatch.setattr(engines, "_DECODERS", {})
    monkeypatch.setattr(engines, "_refused", [])
    device = torch.device("cpu")
    error = levels(TrainImages(transform, "mixed", device)(batch), TrainImages(transform, "cpu", device)(cpu_images),
                   transform)
    assert error.max() <= 2 + 1e-3, error.max()
    for _ in range(4):
        stream.supply_waited(0.5, 1.0, stream.engines.window)  # the step waits: it would be raised, but
    assert stream.jpeg_engine_share == 0.0


def test_a_decoder_that_decodes_nothing_for_a_while_is_given_up(monkeypatch):
    """One batch the engines cannot decode is decoded otherwise and changes nothing; REFUSED_IN_A_ROW in a row
    and the share falls to 0."""
    from fsdpclip.data import engines

    class Blind:
        def __init__(self, device):
            pass

        def decode(self, jpegs):
            return [None] * len(jpegs)

    monkeypatch.setattr(engines, "_Decoder", Blind)
    monkeypatch.setattr(engines, "_DECODERS", {})
    monkeypatch.setattr(engines, "_refused", [])
    monkeypatch.setattr(engines, "_failed_in_a_row", 0)
    share = engines.EngineShare(window=1)
    jpegs = [torch.zeros(4, dtype=torch.uint8)] * 2
    for _ in range(engines.REFUSED_IN_A_ROW - 1):
        engines.decode(jpegs, torch.device("cpu"))
        share.observe(0.0, 1.0, 1)
    assert share.level == engines.EngineShare.START
    engines.decode(jpegs, torch.device("cpu"))
    share.observe(0.0, 1.0, 1)
    assert share.share == 0.0


def test_two_pinning_threads_decode_on_the_engines_each_their_own_batch(monkeypatch):
    """The next epoch's loader pins batches while this epoch's still does: two threads decoding on one device's
    engines at once each get their own JPEGs' pixels (the decoder's reused images are copied out under its lock)."""
    pytest.importorskip("nvidia.nvimgcodec")
    from concurrent.futures import ThreadPoolExecutor

    from fsdpclip.data import engines

    monkeypatch.setattr(engines, "_refused", [])
    monkeypatch.setattr(engines, "_DECODERS", {})
    rng = np.random.default_rng(8)
    batches = [[encoded(picture(rng, int(h), int(w))) for h, w in rng.integers(20, 90, (6, 2))] for _ in range(8)]
    want = [[torch.from_numpy(np.array(Image.open(io.BytesIO(d)).convert("RGB"))).permute(2, 0, 1) for d in batch]
            for batch in batches]

    def decoded(batch):
        return engines.decode([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in batch], torch.device("cpu"))

    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            for got, expected in zip(pool.map(decoded, batches), want):
                assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_a_process_holding_a_decoder_starts_its_workers_from_a_fork_server(monkeypatch):
    """Any DataLoader of a rank whose pinning thread holds the engines' decoder (evaluation's too) starts its
    workers from the fork server; a process without one forks them."""
    from fsdpclip.data import engines
    from fsdpclip.eval.datasets import loader

    monkeypatch.setattr(engines, "_DECODERS", {})
    assert engines.worker_context() is None
    monkeypatch.setattr(engines, "_DECODERS", {torch.device("cpu"): object()})
    assert engines.worker_context().get_start_method() == "forkserver"
    batches = list(loader(list(range(10)), 5, workers=1))  # through the fork server
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_the_engines_share_rises_while_the_step_waits_and_falls_when_they_are_the_bottleneck(monkeypatch):
    """Judged per window of batches: raised by a step while the step waits for its batches, held once it does not,
    lowered (and no longer raised) when a raise made the wait longer."""
    from fsdpclip.data import engines
    from fsdpclip.data.engines import EngineShare

    monkeypatch.setattr(engines, "_refused", [])
    share = EngineShare(window=4)

    def window(waited: float) -> int:  # two log windows of 2 micro batches: one judged window
        share.observe(waited / 2, 0.5, 2)
        share.observe(waited / 2, 0.5, 2)
        assert share.value[0].item() == pytest.approx(share.share)
        return share.level

    start = EngineShare.START
    assert window(0.0) == start  # no wait: held
    assert window(0.3) == start + 1  # the step waits: raised
    assert window(0.2) == start + 2  # still waits, less: raised again
    assert window(0.5) == start + 1  # the last raise made it wait longer: lowered
    assert window(0.0) == start + 1  # held
    for _ in range(EngineShare.EXPIRES - 2):  # the windows after the lowering one, this held one among them
        assert window(0.3) == start + 1  # waits, but the engines could not take more: held for a while
    assert window(0.3) == start + 2  # then tried again
    rising = EngineShare(window=1)
    for _ in range(40):
        rising.observe(0.3, 1.0, 1)
        assert rising.level <= EngineShare.MOST
    assert rising.level == EngineShare.MOST


def test_a_share_sends_the_same_samples_to_the_engines_on_every_run():
    from fsdpclip.data.engines import to_engines

    seeds = [hash((3, 0, 0, 0, emitted)) for emitted in range(4000)]
    drawn = [to_engines(seed, 0.3) for seed in seeds]
    assert drawn == [to_engines(seed, 0.3) for seed in seeds]
    assert 0.27 <= sum(drawn) / len(drawn) <= 0.33
    assert not any(to_engines(seed, 0.0) for seed in seeds)
    assert all(to_engines(seed, 0.6) for seed, sent in zip(seeds, drawn) if sent)  # a larger share keeps these
    import random  # not the augmentation's own first draw (the colour jitter's coin)

    first = [random.Random(seed).random() < 0.3 for seed in seeds]
    assert 0.05 <= sum(a and b for a, b in zip(first, drawn)) / len(seeds) <= 0.13


def test_jpeg_engines_true_is_refused_where_they_have_nothing_to_take(cli, tiny_job, tmp_path, monkeypatch):
    """data.jpeg_engines true needs decode 'mixed' and nvImageCodec; 'auto' settles to them on CUDA where it is
    installed, and validate's summary says so."""
    from fsdpclip.data import engines

    job = dict(tiny_job, data={**tiny_job["data"], "decode": "cpu", "jpeg_engines": True})
    code, out = cli.validate_json(write_job(tmp_path, job), "--no-check-paths")
    assert code == 2 and [e["location"] for e in out["errors"]] == ["data.jpeg_engines"], out["errors"]
    assert "decoded 'cpu'" in out["errors"][0]["message"]
    monkeypatch.setattr(engines, "missing", lambda: "nvImageCodec did not import (test)")
    job = dict(tiny_job, data={**tiny_job["data"], "decode": "mixed", "jpeg_engines": True})
    code, out = cli.validate_json(write_job(tmp_path, job), "--no-check-paths")
    assert code == 2 and "nvImageCodec did not import" in out["errors"][0]["message"], out["errors"]
    monkeypatch.setattr(engines, "installed", lambda: False)
    auto = dict(tiny_job, launch={**tiny_job["launch"], "device": "cuda"})
    code, out = cli.validate_json(write_job(tmp_path, auto), "--no-check-paths")
    assert code == 0 and out["summary"]["batch"]["decode"] == "mixed", out
    monkeypatch.setattr(engines, "installed", lambda: True)
    code, out = cli.validate_json(write_job(tmp_path, auto), "--no-check-paths")
    assert code == 0 and out["summary"]["batch"]["decode"] == "mixed+engines", out


def test_a_large_photo_is_resized_on_the_worker_not_padded_into_its_batch(tmp_path):
    """A photo of more than LARGEST_ON_DEVICE times the output's pixels: "mixed" resizes its crop on the worker
    as the worker transform does (the cpu path's pixels exactly), "gpu" decodes it on the worker; the other
    images' crops are padded only to the largest of theirs, and every sample's pixels are the cpu path's."""
    rng = np.random.default_rng(2)
    data = [encoded(picture(rng, 64, 64)), encoded(picture(rng, 500, 700)), encoded(picture(rng, 40, 36))]
    transform, device = train_transform(), torch.device("cpu")
    samples = [("jpg", d) for d in data]
    (cpu, _), _ = batches(tmp_path, samples, "cpu", transform, len(data))
    (mixed, _), _ = batches(tmp_path, samples, "mixed", transform, len(data))
    assert mixed.boxes[:, 2:].max() <= 64
    assert mixed.boxes[1].tolist() == [0, 0, SIZE, SIZE]
    assert torch.equal(unpacked(mixed.pixels, mixed.boxes)[1, :SIZE, :SIZE], cpu[1].permute(1, 2, 0))
    (gpu, _), _ = batches(tmp_path, samples, "gpu", transform, len(data))
    assert len(gpu.lengths) == 2 and gpu.pixels is not None and torch.equal(gpu.pixels[0], cpu[1])
    for batch, decode in ((mixed, "mixed"), (gpu, "gpu")):
        error = levels(TrainImages(transform, decode, device)(batch), TrainImages(transform, "cpu", device)(cpu),
                       transform)
        assert error[1].max() <= 1e-3 and error.max() <= 2 + 1e-3, (decode, error.max())


PREPROCESS = PreprocessSpec(mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), crop_scale=(0.3, 1.0), grayscale_prob=0.3,
                            color_jitter=ColorJitterSpec(prob=0.8, brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1))


def preprocessed_transforms():
    """The train transform fsdpclip builds for PREPROCESS (the spec's block, the model config, the model),
    and OpenCLIP's own for the same options."""
    from open_clip.transform import AugmentationCfg, PreprocessCfg, image_transform_v2

    from fsdpclip.model.build import image_transform, model_config, model_from_config
    from fsdpclip.jobspec.job import ModelSpec

    model = model_from_config(model_config(ModelSpec(config=str(TINY_CONFIG), image={"image_size": SIZE}), PREPROCESS))
    with warnings.catch_warnings():  # OpenCLIP calls the jitter's and grayscale's keys unused, and uses them
        warnings.simplefilter("ignore")
        theirs = image_transform_v2(PreprocessCfg(size=SIZE, mean=PREPROCESS.mean, std=PREPROCESS.std), is_train=True,
                                    aug_cfg=AugmentationCfg(scale=PREPROCESS.crop_scale, color_jitter_prob=0.8,
                                                            color_jitter=(0.4, 0.4, 0.4, 0.1), gray_scale_prob=0.3))
    return image_transform(model, train=True), theirs


def test_preprocess_options_give_open_clips_transform_bit_for_bit():
    """data.preprocess's mean, std, crop scale, colour jitter and grayscale make OpenCLIP's train transform for
    the same options: the split transform ("cpu": the workers' part, then the device's) gives its pixels for
    the same seed of torch's and Python's generators (OpenCLIP flips the jitter's and grayscale's coins with
    Python's), and jitters and grays some of the images."""
    import random

    ours, theirs = preprocessed_transforms()
    split = TrainImages(ours, "cpu", torch.device("cpu"))
    plain = TrainImages(train_transform(), "cpu", torch.device("cpu"))
    rng = np.random.default_rng(0)
    sources = [picture(rng, 64, 64), picture(rng, 90, 50), picture(rng, 20, 24)]
    changed = gray = 0
    for seed in range(24):
        image = sources[seed % len(sources)]
        torch.manual_seed(seed)
        random.seed(seed)
        want = theirs(image)
        torch.manual_seed(seed)
        pixels = split.worker_transform(image)
        assert torch.equal(split(pixels[None])[0], want), seed
        torch.manual_seed(seed)
        changed += not torch.equal(plain.worker_transform(image), pixels)
        gray += bool((pixels[0] == pixels[1]).all() and (pixels[1] == pixels[2]).all())
    assert changed == 24 and 2 <= gray <= 16, (changed, gray)


def test_device_paths_apply_the_preprocess_options_as_the_cpu_path(tmp_path):
    """"gpu" and "mixed" with data.preprocess: the workers draw the cpu path's crops and colour draws (the
    same for both), and the device's colour jitter and grayscale (`coloured`) turn PIL's crops into exactly the
    cpu path's pixels (_both_paths). The device's resize is PIL's within 2 levels, which the jitter can
    stretch (factors up to 1.4, contrast's mean and hue's 8-bit HSV moved by a level): the device paths'
    output is within 8 levels of the cpu path's, mean 0.05 (6 and 0.012 on these images)."""
    transform, _ = preprocessed_transforms()
    data, cpu_images, encoded_batch = _both_paths(tmp_path, transform, copies=3)
    draws = encoded_batch.colours[encoded_batch.order]
    assert (~draws[:, 4:8].isnan()).any(dim=1).sum() >= 10 and draws[:, 8].sum() >= 2  # jittered, grayed
    (mixed, _), _ = batches(tmp_path, [("jpg", d) for d in data], "mixed", transform, len(data))
    assert torch.allclose(mixed.colours, draws, equal_nan=True)
    device = torch.device("cpu")
    cpu = TrainImages(transform, "cpu", device)(cpu_images)
    for decode_mode_, batch in (("gpu", encoded_batch), ("mixed", mixed)):
        error = levels(TrainImages(transform, decode_mode_, device)(batch), cpu, transform)
        assert error.max() <= 8 + 1e-3 and error.mean() <= 0.05, (decode_mode_, error.max(), error.mean())


def test_pooled_batch_buffers_are_reused_only_once_released(monkeypatch):
    """A worker's pooled batch buffers: a held one is never handed out again; a released one is, for any batch
    that fits; a free one too small is replaced; past decode.POOLED buffers in use, a batch gets fresh memory
    that the pool does not keep."""
    monkeypatch.setattr(decode, "_POOL", [])
    first, first_released = pooled_batch((2, 8, 8, 3))
    second, _ = pooled_batch((2, 8, 8, 3))
    assert first.is_shared() and first.shape == (2, 8, 8, 3) and first.dtype == torch.uint8
    assert second.data_ptr() != first.data_ptr()  # the first is held
    first_released.fill_(1)
    smaller, smaller_released = pooled_batch((1, 8, 8, 3))
    assert smaller.data_ptr() == first.data_ptr() and smaller.is_contiguous()  # released: written again
    smaller_released.fill_(1)
    larger, _ = pooled_batch((4, 8, 8, 3))
    assert larger.data_ptr() != first.data_ptr()
    assert len(decode._POOL) == 2 and first.data_ptr() not in [s.data_ptr() for s, _ in decode._POOL]  # replaced
    held = [pooled_batch((1, 2, 2, 3)) for _ in range(decode.POOLED)]
    assert len(decode._POOL) == decode.POOLED
    assert len({batch.data_ptr() for batch, _ in held}) == decode.POOLED and decode._POOL[-1][0].data_ptr() not in \
        [batch.data_ptr() for batch, _ in held[-2:]]  # the pool full and all in use: fresh memory, not kept


def test_the_rank_hands_a_buffer_back_once_it_is_read(monkeypatch):
    """The pinning thread releases a batch's buffer after its pinned copy, not before; without a pinning
    thread TrainImages releases it after the resize; a batch releases its buffer once (a second release must
    not hand back a buffer the worker has since taken again)."""
    flag = torch.zeros(1, dtype=torch.int32)

    class WorkersBuffer:  # what the pinning thread copies
        def pin_memory(self):
            assert flag.item() == 0, "handed back before the copy was made"
            return torch.zeros(2, 8, 8, 3, dtype=torch.uint8)

    monkeypatch.setattr(decode, "_ahead_of_the_step", lambda pixels_on: pixels_on)  # no CUDA device here
    boxes = torch.tensor([[0, 0, 8, 8], [0, 0, 6, 7]])
    batch = CroppedBatch(WorkersBuffer(), boxes, (4, 4), flag)
    batch.pin_memory()
    assert flag.item() == 1
    flag.zero_()  # the worker took it again
    batch.release()
    assert flag.item() == 0
    flag = torch.zeros(1, dtype=torch.int32)
    pixels = torch.randint(0, 256, (3 * (8 * 8 + 6 * 7 + 8),), dtype=torch.uint8)
    got = TrainImages(train_transform(), "mixed", torch.device("cpu"))(CroppedBatch(pixels, boxes, (4, 4), flag))
    assert got.shape == (2, 3, 4, 4) and flag.item() == 1


def test_a_workers_reused_buffers_leave_every_held_batch_intact(tmp_path):
    """"mixed" through a real data worker: batches the rank still holds keep their pixels while the worker
    goes on (it writes only buffers the rank released), those it released are written again (the same shared
    memory comes back), and every batch, held or not, equals the in-process stream's, byte for byte."""
    rng = np.random.default_rng(4)
    data = [encoded(picture(rng, 40 + index % 5, 44 + index % 3)) for index in range(60)]
    path = tmp_path / "shard.tar"
    with wds.TarWriter(str(path)) as sink:
        for index, jpeg in enumerate(data):
            sink.write({"__key__": f"{index:04d}", "jpg": jpeg, "txt": f"sample {index}"})
    spec = WebDatasetSpec(urls=str(path), samples=len(data), workers=1, shuffle_buffer=0, decode="mixed")
    tokenize = lambda captions: torch.tensor([[int(c.split()[-1])] for c in captions])  # noqa: E731
    transform = TrainImages(train_transform(), "mixed", torch.device("cpu")).worker_transform

    def first_epoch(workers: int) -> Iterator[CroppedBatch]:
        batches = WebDatasetBatches(ShardStream(spec, transform, tokenize, 4, rank=0, world_size=1, seed=3),
                                    workers, pin_memory=False)
        try:
            yield from (batch for batch, _ in itertools.islice(batches, len(data) // 4))
        finally:
            batches.close()

    want = list(first_epoch(0))
    assert len(want) == 15 and all(isinstance(batch, CroppedBatch) for batch in want)

    def shm_file(batch: CroppedBatch) -> int:
        return os.fstat(batch.pixels.untyped_storage()._share_fd_cpu_()[0]).st_ino

    files, held = [], []
    for index, batch in enumerate(first_epoch(1)):
        assert torch.equal(batch.pixels, want[index].pixels) and torch.equal(batch.boxes, want[index].boxes), index
        files.append(shm_file(batch))
        if index < 3:
            held.append(batch)  # kept while the worker makes the next ones
        else:
            batch.release()  # from here on the worker may write it again: the rank no longer reads it
        if index == 9:
            for kept, expected in zip(held, want):
                assert torch.equal(kept.pixels, expected.pixels)  # intact after 7 more batches
                kept.release()
    assert len(files) == len(want)
    assert len(set(files[:3])) == 3 and not set(files[:3]) & set(files[3:9])  # held: not written again
    assert len(set(files[3:])) < len(files[3:])  # released: the same buffers came back


def test_resize_weights_made_at_the_taps_are_the_dense_definitions():
    """resample_weights computes the bicubic weights only at each output pixel's taps (a band as wide as
    the batch's widest support) and spreads them into the dense matrix: it equals PIL's coefficients written
    densely (every input pixel's distance to every output centre), for down- and upscaled boxes, boxes at
    either edge and a batch mixing supports of several widths."""
    def dense(start, length, extent, out):
        start, length = start.double()[:, None, None], length.double()[:, None, None]
        scale = length / out
        centres = start + (torch.arange(out, dtype=torch.float64)[None, :, None] + 0.5) * scale
        pixels = torch.arange(extent, dtype=torch.float64)[None, None, :] + 0.5
        x = ((pixels - centres) / scale.clamp(min=1)).abs()
        cubic = torch.where(x < 1, (1.5 * x - 2.5) * x * x + 1,
                            torch.where(x < 2, -0.5 * (((x - 5) * x + 8) * x - 4), 0))
        cubic = cubic * ((pixels > start) & (pixels < start + length))
        return cubic / cubic.sum(-1, keepdim=True)

    extent = 300
    start = torch.tensor([0, 0, 17, 300 - 40, 5, 0, 299])
    length = torch.tensor([300, 224, 250, 40, 7, 1, 1])  # down 1.34×, none, down 1.12×, up, up 32×, 1-pixel boxes
    for out in (224, 37):  # the second: supports up to 8× as wide
        got = resample_weights(start, length, extent, out, torch.device("cpu"))
        want = dense(start, length, extent, out)
        assert got.shape == (len(start), out, extent)
        # float32's centres are off by up to an ulp of the pixel position; a missed tap would be off by ~0.01
        assert torch.allclose(got.double(), want, atol=1e-4), (out, (got.double() - want).abs().max())


def test_host_pixels_are_pils_whichever_decoder_reads_them(monkeypatch):
    """rgb_pixels ("mixed"'s worker decode): baseline, progressive, 4:4:4, 4:2:2, grayscale JPEGs and one
    followed by zero bytes go through torchvision's libjpeg-turbo, a CMYK JPEG, a PNG and a JPEG it
    refuses through PIL; all are the pixels of PIL's convert("RGB")."""
    import torchvision.io

    rng = np.random.default_rng(5)
    image = picture(rng, 37, 53)
    through_torchvision = [encoded(image), encoded(image, progressive=True), encoded(image, subsampling=0),
                           encoded(image, subsampling=1), encoded(image.convert("L")), encoded(image) + b"\0" * 7]
    through_pil = [encoded(image.convert("CMYK")), encoded(image, "PNG")]
    calls = []
    real = torchvision.io.decode_jpeg
    monkeypatch.setattr(torchvision.io, "decode_jpeg", lambda *a, **k: calls.append(1) or real(*a, **k))
    for data in through_torchvision + through_pil:
        got = rgb_pixels(data, read_header(data))
        assert got.shape == (37, 53, 3) and got.dtype == np.uint8
        assert np.array_equal(got, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    assert len(calls) == len(through_torchvision)

    def refuses(*args, **kwargs):
        raise RuntimeError("refused")

    monkeypatch.setattr(torchvision.io, "decode_jpeg", refuses)
    data = through_torchvision[0]
    assert np.array_equal(rgb_pixels(data, read_header(data)),
                          np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_crop_boxes_are_torchvisions_draw_for_draw():
    """crop_box gives the box RandomResizedCrop.get_params draws with torch's default generator seeded the
    same, for OpenCLIP's crop and two others, on images where an early, a late or no attempt fits (the
    central crop), and leaves the default generator as it was."""
    from torchvision.transforms import InterpolationMode, RandomResizedCrop

    rng = np.random.default_rng(7)
    shapes = [(256, 256), (256, 341), (480, 640), (1000, 62), (65, 900), (3, 5), (1, 1)]
    crops = [RandomResizedCrop(SIZE, scale=scale, ratio=ratio, interpolation=InterpolationMode.BICUBIC)
             for scale, ratio in [((0.9, 1.0), (3 / 4, 4 / 3)), ((0.08, 1.0), (3 / 4, 4 / 3)), ((0.5, 1.0), (0.5, 2.0))]]
    state = torch.get_rng_state()
    fallbacks = 0
    for crop, (height, width) in itertools.product(crops, shapes):
        for seed in rng.integers(-2**63, 2**63 - 1, 300, dtype=np.int64).tolist():
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                want = crop.get_params(torch.empty(3, height, width), crop.scale, crop.ratio)
            assert crop_box(crop, height, width, seed) == want, (crop, height, width, seed)
            fallbacks += want == ((height - want[2]) // 2, (width - want[3]) // 2, *want[2:])
    assert fallbacks > 300  # the central crop was among the boxes
    assert torch.equal(torch.get_rng_state(), state)
    default = torch.get_default_dtype()
    for dtype in (torch.float64, torch.float16):  # float64 draws take two outputs each: get_params itself
        torch.set_default_dtype(dtype)
        try:
            for seed in range(300):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    want = crops[1].get_params(torch.empty(3, 256, 341), crops[1].scale, crops[1].ratio)
                assert crop_box(crops[1], 256, 341, seed) == want, (dtype, seed)
        finally:
            torch.set_default_dtype(default)


def test_jpeg_headers_are_read_as_pil_reads_them():
    """read_header reads plain JPEGs itself (baseline, progressive, 4:4:4, grayscale, a large ICC profile, a
    comment, optimised Huffman tables, Adobe RGB) as PIL would, and leaves CMYK, EXIF, MPO, PNG, segments PIL
    reads otherwise or refuses to PIL, which reads them or raises; it refuses any image past PIL's
    decompression-bomb limit (`refuse_huge`: PIL would only warn below twice it). Cut at every byte or damaged at
    random, a JPEG it reads itself is read as PIL reads it."""
    from fsdpclip.data.jpeg import _plain_jpeg_header

    rng = np.random.default_rng(4)
    image = picture(rng, 37, 53)
    mpo = io.BytesIO()
    image.save(mpo, "MPO", save_all=True, append_images=[picture(rng, 37, 53)])
    plain = [encoded(image), encoded(image, progressive=True), encoded(image, subsampling=0),
             encoded(image.convert("L")), encoded(image, icc_profile=b"x" * 70000), encoded(image, comment=b"a comment"),
             encoded(image, optimize=True), encoded(image, keep_rgb=True), encoded(picture(rng, 3000, 20))]
    others = [encoded(image.convert("CMYK")), encoded(image, exif=Image.Exif()), mpo.getvalue(), encoded(image, "PNG")]

    def pil(data: bytes):
        opened = Image.open(io.BytesIO(data))
        return opened.format, opened.mode, opened.height, opened.width, bool(opened.info.get("progressive"))

    for data in plain + others:
        header = read_header(data)
        assert (header.format, header.mode, header.height, header.width, header.progressive) == pil(data)
        assert (header.opened is None) == (data in plain)  # PIL opened all but the plain JPEGs
    base = plain[0]
    frame = base.index(b"\xff\xc0")
    segment = lambda marker, payload: bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload  # noqa
    scan, end = base.index(b"\xff\xda"), frame + 2 + int.from_bytes(base[frame + 2:frame + 4], "big")
    other = bytearray(base[frame + 2:end])
    other[3:7] = (999).to_bytes(2, "big") + (777).to_bytes(2, "big")  # a frame of another size
    left_to_pil = [base[:2] + b"\xff\x01\x00\x02" + base[2:],  # TEM, which PIL does not know
                   base[:2] + segment(0xE0, b"JFIF\0") + base[2:], base[:2] + segment(0xEE, b"Adobe") + base[2:],
                   base[:2] + segment(0xE2, b"ICC_PROFILE\0") + base[2:], base[:2] + segment(0xDB, bytes(11)) + base[2:],
                   base[:end] + b"\xff\xde" + other + base[end:],  # DHP: a frame to PIL
                   base[:end] + segment(0xF0, b"\xff\xc0" + other) + base[end:],  # JPG0: PIL reads no length
                   base[:scan + 2] + b"\xff\xf0" + base[scan + 4:],  # a scan header past the end
                   base[:2] + b"\xff\xd9" + base[2:], base[:frame + 4] + b"\x0c" + base[frame + 5:],  # EOI first; 12-bit
                   base[:frame] + segment(0xC0, base[frame + 4:end] + b"\0") + base[end:],  # a frame a byte long
                   base[:2] + segment(0xED, b"Photoshop 3.0\0" + b"8BIM\x03\xed") + base[2:]]  # PIL raises on it
    assert all(_plain_jpeg_header(data) is None for data in left_to_pil)
    assert pil(left_to_pil[5])[2:4] == pil(left_to_pil[6])[2:4] == (999, 777)  # PIL reads the other frame
    damaged = [data[:cut] for data in plain[:4] for cut in range(len(data))]
    for _ in range(3000):
        data = bytearray(plain[rng.integers(4)])
        data[rng.integers(min(len(data), 700))] = rng.integers(256)
        damaged.append(bytes(data))
    read = 0
    for data in damaged:
        header = _plain_jpeg_header(data)
        if header is not None:
            assert (header.format, header.mode, header.height, header.width, header.progressive) == pil(data)
            read += 1
    assert read > 1000  # most damage is to the pixels, after the header
    assert Image.MAX_IMAGE_PIXELS == 89478485 and 9459 ** 2 <= 89478485 < 9460 ** 2
    for side in (9459, 9460, 10000, 20000):  # at PIL's limit, past it (PIL warns), past twice it (PIL raises)
        huge = bytearray(base)
        huge[frame + 5:frame + 9] = side.to_bytes(2, "big") * 2
        png = bytearray(encoded(image, "PNG"))  # its IHDR's size, and the chunk's CRC
        png[16:24] = side.to_bytes(4, "big") * 2
        png[29:33] = zlib.crc32(png[12:29]).to_bytes(4, "big")
        for data in (bytes(huge), bytes(png)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                if side == 9459:
                    assert (read_header(data).height, read_header(data).width) == (side, side)
                    continue
                with pytest.raises(Image.DecompressionBombError, match="decompression bomb"):
                    read_header(data)
    for data in [encoded(image)[:40], b"\xff\xd8\xff" + bytes(50)]:
        with pytest.raises(OSError):
            read_header(data)


def solid_jpeg(side: int) -> bytes:
    """A side × side mid-grey grayscale baseline JPEG, made without encoding its pixels: a small one's header
    with its frame's size changed, then each 8×8 block's entropy-coded data, the same 6 bits (a DC difference
    of 0, end of block: the standard Huffman tables PIL writes), so 1.2 MB for 100 megapixels."""
    small = encoded(Image.new("L", (16, 16), 128))
    frame, scan = small.index(b"\xff\xc0"), small.index(b"\xff\xda")
    header = bytearray(small[:scan + 2 + int.from_bytes(small[scan + 2:scan + 4], "big")])
    header[frame + 5:frame + 9] = side.to_bytes(2, "big") * 2
    blocks = (side // 8) ** 2
    assert side % 8 == 0 and blocks % 4 == 0  # 4 blocks: 24 bits
    return bytes(header) + b"\x28\xa2\x8a" * (blocks // 4) + b"\xff\xd9"


BAD_IMAGES = {  # name: decodable (else a broken sample)
    "truncated": False, "truncated progressive": False, "CMYK": True, "progressive": True, "grayscale": True,
    "PNG named .jpg": True, "WebP named .jpg": True, "100 megapixels": False, "zero bytes": False}


def bad_image(name: str) -> bytes:
    rng = np.random.default_rng(8)
    image = picture(rng, 60, 80)
    jpeg, progressive = encoded(image), encoded(image, progressive=True)
    return {"truncated": jpeg[:len(jpeg) * 2 // 3], "truncated progressive": progressive[:len(progressive) // 2],
            "CMYK": encoded(image.convert("CMYK")), "progressive": progressive,
            "grayscale": encoded(image.convert("L")), "PNG named .jpg": encoded(image, "PNG"),
            "WebP named .jpg": encoded(image, "WEBP"), "100 megapixels": solid_jpeg(10000), "zero bytes": b""}[name]


@pytest.mark.parametrize("name", BAD_IMAGES)
def test_a_bad_image_is_decoded_or_counted_broken_on_every_path(tmp_path, name):
    """A shard's bad image, stored as `.jpg` between two good JPEGs: on every decode path ("cpu", "mixed" and
    "gpu", its device part on the CPU), through a real data worker, it is decoded as the cpu path decodes it
    (CMYK, progressive, grayscale, PNG and WebP) or skipped and counted as broken (truncated, zero bytes, and
    100 megapixels: over PIL's MAX_IMAGE_PIXELS, refused from its header before anything decodes it, where
    PIL alone would only warn and decode it, and the device paths would pad the batch to it)."""
    rng = np.random.default_rng(9)
    data, decodable = bad_image(name), BAD_IMAGES[name]
    shard = [("jpg", encoded(picture(rng, 64, 64))), ("jpg", data), ("jpg", encoded(picture(rng, 50, 70)))]
    transform, device = train_transform(), torch.device("cpu")
    pixels = {}
    for mode in ("cpu", "mixed", "gpu"):
        (images, texts), stream = batches(tmp_path, shard, mode, transform, 2, workers=1)
        assert texts[:, 0].tolist() == ([0, 1] if decodable else [0, 2]), mode
        assert stream.position.broken == (not decodable), mode
        pixels[mode] = TrainImages(transform, mode, device)(images)
    for mode in ("mixed", "gpu"):
        error = levels(pixels[mode], pixels["cpu"], transform)
        assert error.max() <= 2 + 1e-3, (mode, error.max())
    if name == "100 megapixels":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            assert Image.open(io.BytesIO(data)).size == (10000, 10000)  # PIL reads it (and would decode it)
        with pytest.raises(Image.DecompressionBombError, match="MAX_IMAGE_PIXELS"):
            read_header(data)


def test_a_batch_of_mixed_images(tmp_path):
    """JPEGs of two sizes and a grayscale one go to the device; a PNG and a CMYK JPEG are decoded on the
    worker and take their places among them; an image that is no JPEG and a truncated JPEG are skipped
    and counted as broken, as the cpu path does; "mixed" decodes and crops all of them on the worker. Through
    a real DataLoader worker process."""
    rng = np.random.default_rng(2)
    jpeg = encoded(picture(rng, 64, 64))
    shard = [("jpg", jpeg), ("png", encoded(picture(rng, 50, 70), "PNG")), ("jpg", encoded(picture(rng, 90, 60))),
             ("jpg", b"this is not a jpeg"), ("jpg", encoded(picture(rng, 56, 56).convert("CMYK"))),
             ("jpg", jpeg[: len(jpeg) // 2]), ("jpg", encoded(picture(rng, 64, 48).convert("L")))]
    good = [0, 1, 2, 4, 6]
    transform = train_transform()

    def run(decode):
        (images, texts), stream = batches(tmp_path, shard, decode, transform, len(good), workers=1)
        return images, texts, stream.position.broken

    cpu_images, cpu_texts, cpu_broken = run("cpu")
    mixed, mixed_texts, mixed_broken = run("mixed")
    assert torch.equal(mixed_texts, cpu_texts) and mixed_broken == cpu_broken == 2  # every format on the workers
    assert isinstance(mixed, CroppedBatch) and mixed.boxes.shape[0] == len(good)
    error = levels(TrainImages(transform, "mixed", torch.device("cpu"))(mixed),
                   TrainImages(transform, "cpu", torch.device("cpu"))(cpu_images), transform)
    assert (error.amax(dim=(1, 2, 3)) <= 2 + 1e-3).all(), error.amax(dim=(1, 2, 3))
    batch, texts, broken = run("gpu")
    assert texts[:, 0].tolist() == cpu_texts[:, 0].tolist() == good
    assert broken == cpu_broken == 2
    assert isinstance(batch, EncodedBatch) and len(batch.lengths) == 3 and batch.pixels.shape == (2, 3, SIZE, SIZE)
    on_worker = [sample for sample, row in enumerate(batch.order.tolist()) if row >= 3]
    assert [good[i] for i in on_worker] == [1, 4]  # the PNG and the CMYK JPEG
    assert torch.equal(batch.pixels, cpu_images[on_worker])
    device = torch.device("cpu")
    error = levels(TrainImages(transform, "gpu", device)(batch), TrainImages(transform, "cpu", device)(cpu_images),
                   transform)
    assert (error.amax(dim=(1, 2, 3)) <= 2 + 1e-3).all(), error.amax(dim=(1, 2, 3))
    assert error[on_worker].max() == 0


def test_decode_mode_is_settled_in_one_place(cli, tiny_job, tmp_path):
    """'auto', the default, is the path measured fastest where the run trains: 'mixed' on CUDA, 'cpu' on
    the CPU; validate reports what the trainer will do."""
    assert decode_mode("auto", "cpu") == "cpu" and decode_mode("gpu", "cpu") == "gpu"
    assert decode_mode("auto", "cuda") == "mixed"
    unset = {k: v for k, v in tiny_job["data"].items() if k != "decode"}
    unset["jpeg_engines"] = False  # 'auto' and the engines: test_jpeg_engines_true_is_refused_where_...
    for device, asked, settled in (("cpu", None, "cpu"), ("cuda", None, "mixed"), ("cpu", "gpu", "gpu"),
                                   ("cpu", "mixed", "mixed"), ("cuda", "cpu", "cpu")):
        job = dict(tiny_job, data=unset if asked is None else {**unset, "decode": asked},
                   launch={**tiny_job["launch"], "device": device})
        code, out = cli.validate_json(write_job(tmp_path, job), "--no-check-paths")
        assert code == 0 and out["summary"]["batch"]["decode"] == settled, (device, asked, out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_data_wait_is_what_the_step_waits_for(device):
    """data_wait counts a batch that takes 0.3 s to come while the device is idle, and (on CUDA) not one
    that takes as long while the device still works through a second of earlier steps."""
    import time
    from collections import deque
    from types import SimpleNamespace

    from fsdpclip.run.lock import StartupClock
    from fsdpclip.train.feeding import DataFeed
    from fsdpclip.train.metrics import Window

    def slow_batches():
        while True:
            time.sleep(0.3)
            yield torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.long)

    feed = DataFeed.__new__(DataFeed)  # its path to the device, over batches of its own
    feed.env, feed.images, feed.data_spans = SimpleNamespace(device=torch.device(device)), None, deque()
    feed.batch_iter, feed.startup = slow_batches(), StartupClock()

    def waited(window: Window) -> float:
        """The window's data wait once the device has passed every span (those not yet seen done too)."""
        if device == "cuda":
            torch.cuda.synchronize()
        return window.data_wait + sum(start.elapsed_time(end) / 1e3 for start, end in feed.data_spans)

    idle = Window()
    feed.next_batch(idle)
    assert 0.29 <= waited(idle) <= 0.5, waited(idle)
    if device == "cuda":
        feed.data_spans.clear()
        busy, work = Window(), torch.randn(8192, 8192, device=device)
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(60):
            work = work @ work / 8192
        feed.next_batch(busy)
        assert waited(busy) < 0.05, waited(busy)
        assert time.perf_counter() - began > 0.6  # the device was busy for longer than the fetch took


def test_changing_where_images_are_decoded_keeps_the_data_position(tiny_job):
    """A relaunch with another data.decode continues the stream where it stopped (the same samples and
    crops); another shuffle buffer restarts the epoch."""
    import json

    from fsdpclip.jobspec.jobfile import parse_job
    from fsdpclip.jobspec.resume import keeps_data_position, spec_changes

    saved = json.loads(parse_job(dict(tiny_job, data={**tiny_job["data"], "decode": "cpu"})).to_json())
    for changed, keeps in (({"decode": "gpu"}, True), ({"shuffle_buffer": 7}, False)):
        job = parse_job(dict(tiny_job, data={**tiny_job["data"], "decode": "cpu", **changed}))
        assert keeps_data_position(spec_changes(saved, job)) is keeps, changed


def test_validate_shows_the_resolved_preprocess_and_refuses_what_it_cannot_mean(cli, tiny_job, tmp_path):
    """validate's summary holds data.preprocess over the model's own (OpenCLIP's defaults for the tiny
    config); values out of range are refused at their JSON location."""
    preprocess = {"std": [0.5, 0.5, 0.5], "resize_mode": "squash", "color_jitter": {"brightness": 0.4, "hue": 0.1}}
    job = dict(tiny_job, data={**tiny_job["data"], "decode": "mixed", "preprocess": preprocess})
    code, out = cli.validate_json(write_job(tmp_path, job), "--no-check-paths")
    assert code == 0, out
    assert out["summary"]["preprocess"] == {
        "size": [32, 32], "mean": [0.48145466, 0.4578275, 0.40821073], "std": [0.5, 0.5, 0.5],
        "interpolation": "bicubic", "resize_mode": "squash", "crop_scale": [0.9, 1.0], "grayscale_prob": 0.0,
        "color_jitter": {"prob": 0.8, "brightness": 0.4, "contrast": 0.0, "saturation": 0.0, "hue": 0.1}}
    for wrong, location in [({"crop_scale": [0.9, 0.5]}, "data.preprocess"), ({"std": [0.5, 0, 0.5]}, "data.preprocess"),
                            ({"color_jitter": {"hue": 0.7}}, "data.preprocess.color_jitter.hue"),
                            ({"grayscale_prob": 1.5}, "data.preprocess.grayscale_prob"),
                            ({"resize_mode": "fit"}, "data.preprocess.resize_mode")]:
        job = dict(tiny_job, data={**tiny_job["data"], "preprocess": wrong})
        code, out = cli.validate_json(write_job(tmp_path, job), "--no-check-paths")
        assert code == 2 and [e["location"] for e in out["errors"]] == [location], (wrong, out["errors"])


def test_what_lies_past_a_packed_crop_weighs_nothing_in_its_resize():
    """`unpacked` fills each crop's batch slot past its box with the next crops' bytes: the resize of that
    batch equals, exactly, the resize of the same crops zero-padded."""
    from fsdpclip.data.resize import resized_crops
    from fsdpclip.data.transform import packed

    rng = np.random.default_rng(5)
    crops = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((30, 17), (9, 41), (25, 25), (40, 8))]
    boxes = torch.tensor([(0, 0, *crop.shape[:2]) for crop in crops])
    flat, _ = packed(crops)
    batch = unpacked(flat, boxes)
    zeroed = torch.zeros_like(batch)
    for slot, crop in zip(zeroed, crops):
        slot[:crop.shape[0], :crop.shape[1]] = torch.from_numpy(crop)
    assert not torch.equal(batch, zeroed)  # the slots past the crops hold other bytes
    for size in ((16, 16), (48, 20)):
        assert torch.equal(resized_crops(batch.permute(0, 3, 1, 2), boxes, size),
                           resized_crops(zeroed.permute(0, 3, 1, 2), boxes, size))


@pytest.mark.slow
def test_the_plan_settles_the_jpeg_engines_without_importing_nvimgcodec(tiny_job, tmp_path):
    """validate's plan (which the launcher and rank 0 make) settles data.jpeg_engines 'auto' without importing
    nvImageCodec, whose import initialises the CUDA driver, after which no fork of that process can use CUDA."""
    import importlib.util
    import subprocess
    import sys
    import textwrap

    if importlib.util.find_spec("nvidia.nvimgcodec") is None:
        pytest.skip("nvImageCodec is not installed")
    job = write_job(tmp_path, dict(tiny_job, launch={**tiny_job["launch"], "device": "cuda", "gpus_per_node": 1}))
    script = textwrap.dedent(f"""
        import json, sys
        from typer.testing import CliRunner
        from fsdpclip.cli.commands import app
        validated = CliRunner().invoke(app, ["validate", {str(job)!r}, "--no-check-paths", "--json"])
        print(validated.exit_code, json.loads(validated.stdout)["summary"]["batch"]["decode"],
              "nvidia.nvimgcodec" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.stdout.split() == ["0", "mixed+engines", "False"], done.stdout + done.stderr


def test_a_rank_whose_nvimgcodec_fails_to_import_decodes_on_its_workers_or_stops_where_the_engines_were_asked_for(
        tmp_path, monkeypatch, caplog):
    """The plan settles the engines from nvImageCodec being installed (`engines.installed`); a rank imports it
    before its data starts. Where that import fails, 'auto' leaves every JPEG to the workers with a warning
    saying why, and `true` stops the rank with the reason."""
    from fsdpclip.data import batches as data_batches

    monkeypatch.setattr(data_batches, "missing", lambda: "nvImageCodec is not installed (libnvjpeg.so.13: none)")
    settled = {"decode": "mixed", "jpeg_engines": True, "workers": 0}

    def rank_batches(jpeg_engines):
        spec = WebDatasetSpec(urls=str(tmp_path / "s.tar"), samples=4, workers=0, jpeg_engines=jpeg_engines)
        return data_batches.webdataset_batches(spec, settled, train_transform(), caption_indices, 4, 0, 1, 3,
                                               torch.device("cpu"))[0]

    with caplog.at_level("INFO", logger="fsdpclip.data.batches"):
        assert rank_batches("auto").engines is None
    assert [record.getMessage() for record in caplog.records] == [
        "data: the data workers decode every JPEG: nvImageCodec is not installed (libnvjpeg.so.13: none)"]
    with pytest.raises(SpecError, match="data.jpeg_engines: nvImageCodec is not installed"):
        rank_batches(True)


@pytest.mark.slow
@pytest.mark.parametrize("engines", ["on", "auto"])
def test_a_rank_starts_its_workers_fork_server_as_it_starts_where_the_engines_take_a_share(engines):
    """`prepare_rank` (before the process group forms): where the engines take a share (here `true`, nvImageCodec's
    CPU decoder), the fork server the data workers start from is already running, loading while the rank starts;
    without them ('auto' on the CPU) no server starts."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import multiprocessing.forkserver as forkserver, os, signal
        from fsdpclip.jobspec.source import DATA_SOURCES
        from fsdpclip.jobspec.webdataset_spec import WebDatasetSpec
        spec = WebDatasetSpec(urls="/shards/{{0..1}}.tar", samples=8, workers=1, decode="mixed",
                              jpeg_engines={engines == "on"!r} or "auto")
        DATA_SOURCES["webdataset"].prepare_rank(spec, "cpu")
        pid = forkserver._forkserver._forkserver_pid
        print("running:", pid is not None and os.waitpid(pid, os.WNOHANG)[0] == 0)
        if pid is not None:  # this test's server, stopped by its number
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.stdout.split() == ["running:", str(engines == "on")], done.stdout + done.stderr


def test_the_engines_are_off_where_python_has_no_nvidia_package(monkeypatch):
    """`installed` asks without importing: looking up `nvidia.nvimgcodec` imports the `nvidia` package, which a CPU,
    ROCm or macOS torch does not have; then the engines are simply not installed."""
    import importlib.util

    from fsdpclip.data import engines

    def no_parent(name):
        raise ModuleNotFoundError("No module named 'nvidia'", name="nvidia")

    monkeypatch.setattr(importlib.util, "find_spec", no_parent)
    assert engines.installed() is False and engines.engines_on("auto", "cuda") is False
