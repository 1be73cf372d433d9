"""Zero-shot classification and image-text retrieval, computed as CLIP_benchmark computes them.

Classification: class embeddings (OpenCLIP's `build_zero_shot_classifier`) are the normalised mean
of the normalised template embeddings; logits are 100 × the normalised image features against
them; acc1/acc5 are top-k accuracies (acc5 is NaN under 5 classes) and mean per-class recall is
the balanced accuracy over the classes present.

Retrieval: every caption's normalised embedding against every image's; text→image recall@k
(CLIP_benchmark's `image_retrieval_recall@k`) is the fraction of captions whose image is among
their k best images, image→text (`text_retrieval_recall@k`) the fraction of images with one of
their captions among their k best captions.

Every rank takes part: each embeds its share of the images (and, for retrieval, their captions;
for classification all embed the same prompts), and a rank whose share is exhausted keeps running
(padding) forwards until all are done, so no rank ever skips a forward of the sharded model.
"""

from __future__ import annotations

import contextlib
import io
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from fsdpclip.data.batches import ignore_stop_signals, shutdown_workers
from fsdpclip.run.directory import read_text_file
from fsdpclip.spec.job import RetrievalSpec, ZeroShotSpec

if TYPE_CHECKING:
    from fsdpclip.spec.job import Job

WDS_IMAGE_KEYS = ("webp", "png", "jpg", "jpeg")
RECALL_K = (1, 5, 10)


class DatasetError(Exception):
    """An evaluation dataset that is missing or laid out wrongly (message meant for the user)."""


@dataclass
class ZeroShotSet:
    """A labelled image set with its class names (in label order) and prompt templates.

    `images` is a map-style dataset of (image, label), or `shards`, a CLIP_benchmark webdataset.
    """

    task: ClassVar[str] = "zeroshot_classification"  # CLIP_benchmark's name
    kind: ClassVar[str] = "zeroshot"  # the prefix of its results in metrics.jsonl
    name: str
    classnames: list[str]
    templates: list[Callable[[str], str]]
    images: Optional[Dataset] = None
    shards: Optional[list[str]] = None
    transform: Optional[Callable] = None
    max_samples: Optional[int] = None
    # A folder set whose class names are not its folder names: folder -> class name, as paired (label order).
    folder_classes: Optional[dict[str, str]] = None

    @property
    def size(self) -> Optional[int]:
        """Number of images, when known without reading the shards."""
        return len(self.images) if self.images is not None else None

    def batches(self, rank: int, world_size: int, batch_size: int, workers: int) -> Iterator:
        """This rank's (images, labels) batches: every world_size-th sample or shard."""
        if self.images is not None:
            share = torch.utils.data.Subset(self.images, range(rank, len(self.images), world_size))
            return _loader(share, batch_size, workers)
        return _loader(_ClassShards(self.shards, rank, world_size, self.transform, batch_size, self.max_samples),
                       None, workers)


@dataclass
class RetrievalSet:
    """Images with one or more captions each: `pairs` (image file, its captions) from a folder, or
    `shards`, CLIP_benchmark retrieval shards (an image and a .txt of captions, one per line)."""

    task: ClassVar[str] = "zeroshot_retrieval"
    kind: ClassVar[str] = "retrieval"
    name: str
    pairs: Optional[list[tuple[Path, list[str]]]] = None
    shards: Optional[list[str]] = None
    transform: Optional[Callable] = None
    max_samples: Optional[int] = None

    @property
    def size(self) -> Optional[int]:
        """Number of images, when known without reading the shards."""
        return len(self.pairs) if self.pairs is not None else None

    def batches(self, rank: int, world_size: int, batch_size: int, workers: int) -> Iterator:
        """This rank's (images, ids, captions) batches: every world_size-th pair or shard. An image's id
        orders it in the set (its index, or its shard's index << 32 | its position there); `captions`
        holds a list of captions per image."""
        if self.pairs is not None:
            share = torch.utils.data.Subset(_CaptionedImages(self.pairs, self.transform),
                                            range(rank, len(self.pairs), world_size))
            return _loader(share, batch_size, workers, collate=_collate_captioned)
        return _loader(_CaptionShards(self.shards, rank, world_size, self.transform, batch_size, self.max_samples),
                       None, workers)


EvalSet = Union[ZeroShotSet, RetrievalSet]


def _loader(data: Dataset, batch_size: Optional[int], workers: int, collate: Optional[Callable] = None) -> Iterator:
    """Batches of a map-style dataset, or of a `_Shards` stream (`batch_size` None: it batches itself).
    Closing it stops its data workers at once (they ignore the stop signals, so none may outlive it)."""
    if isinstance(data, _Shards):
        workers = min(workers, len(data.shards))
    batches = iter(DataLoader(data, batch_size=batch_size, num_workers=workers, collate_fn=collate,
                              worker_init_fn=ignore_stop_signals))
    try:
        for batch in batches:
            if isinstance(batch, DatasetError):  # passed on by a data worker (see _Shards)
                raise batch
            yield batch
    finally:
        shutdown_workers(batches)


class _Shards(IterableDataset):
    """Batches from this rank's share of CLIP_benchmark shards (every world_size-th), split over the data
    workers; at most `limit` images per worker (no worker needs more; `_shares` makes the total exact)."""

    def __init__(self, shards: list[str], rank: int, world_size: int, transform: Callable, batch_size: int,
                 limit: Optional[int]):
        self.shards = list(enumerate(shards))[rank::world_size]
        self.transform, self.batch_size, self.limit = transform, batch_size, limit

    def __iter__(self):
        batch = []
        try:
            for sample_id, sample, where in itertools.islice(self._samples(), self.limit):
                batch.append(self.read(sample_id, sample, where))
                if len(batch) == self.batch_size:
                    yield self.collate(batch)
                    batch = []
        except DatasetError as exc:  # to the main process as it is (a worker's exception comes wrapped in text)
            yield exc
            return
        if batch:
            yield self.collate(batch)

    def _samples(self) -> Iterator[tuple[int, dict, str]]:
        """(id, sample, where) of this worker's shards: id = the shard's index << 32 | the sample's position."""
        from fsdpclip.data.tarshards import shard_samples

        info = get_worker_info()
        for index, url in self.shards[info.id::info.num_workers] if info else self.shards:
            for position, sample in enumerate(shard_samples(url, handler=lambda exc: False)):  # errors raise
                yield index << 32 | position, sample, f"{url}: sample {sample['__key__']}"

    def image(self, sample: dict, where: str) -> torch.Tensor:
        from PIL import Image

        key = next((k for k in WDS_IMAGE_KEYS if k in sample), None)
        if key is None:
            raise DatasetError(f"{where} has no image ({', '.join('.' + k for k in WDS_IMAGE_KEYS)})")
        return self.transform(Image.open(io.BytesIO(sample[key])).convert("RGB"))

    def read(self, sample_id: int, sample: dict, where: str) -> tuple:
        raise NotImplementedError

    def collate(self, batch: list[tuple]) -> tuple:
        raise NotImplementedError


class _ClassShards(_Shards):
    """(images, labels) from classification shards (an image and a .cls label)."""

    def read(self, sample_id: int, sample: dict, where: str) -> tuple:
        return self.image(sample, where), int(sample["cls"])

    def collate(self, batch: list[tuple]) -> tuple:
        images, labels = zip(*batch)
        return torch.stack(images), torch.tensor(labels)


class _CaptionShards(_Shards):
    """(images, ids, captions) from retrieval shards (an image and a .txt of captions, one per line)."""

    def read(self, sample_id: int, sample: dict, where: str) -> tuple:
        captions = _captions(sample["txt"].decode("utf-8")) if "txt" in sample else []
        if not captions:
            raise DatasetError(f"{where} has no captions (.txt, one per line)")
        return self.image(sample, where), sample_id, captions

    def collate(self, batch: list[tuple]) -> tuple:
        return _collate_captioned(batch)


class _CaptionedImages(Dataset):
    """(image, index, captions) of image files with their captions."""

    def __init__(self, pairs: list[tuple[Path, list[str]]], transform: Callable):
        self.pairs, self.transform = pairs, transform

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple:
        from PIL import Image

        path, captions = self.pairs[index]
        with Image.open(path) as image:
            return self.transform(image.convert("RGB")), index, captions


def _collate_captioned(batch: list[tuple]) -> tuple:
    images, ids, captions = zip(*batch)
    return torch.stack(images), torch.tensor(ids, dtype=torch.int64), list(captions)


def _captions(text: str) -> list[str]:
    """The captions of a caption file: one per non-empty line."""
    return [line.strip() for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------------- datasets
def read_templates(choice: str) -> list[Callable[[str], str]]:
    """'openai' (80 prompts), 'simple' or a file with one '{c}' template per line."""
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

    if choice == "openai":
        return list(OPENAI_IMAGENET_TEMPLATES)
    if choice == "simple":
        return list(SIMPLE_IMAGENET_TEMPLATES)
    return [lambda c, t=line: t.format(c=c) for line in _lines(Path(choice))]


def _text(path: Path) -> str:
    """A text file of a dataset (read_text_file: a regular UTF-8 file of bounded size)."""
    try:
        return read_text_file(path)
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}") from None


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in _text(path).splitlines() if line.strip()]


def load_zeroshot_set(spec: ZeroShotSpec, transform: Callable) -> ZeroShotSet:
    """One of the spec's zero-shot sets, from a folder of class folders or CLIP_benchmark shards."""
    root = Path(spec.path)
    if not root.is_dir():
        raise DatasetError(f"dataset folder not found: {root}")
    shards = _wds_shards(root)
    if shards is not None:
        classnames, templates = _names_and_templates(spec, root)
        return ZeroShotSet(spec.label, classnames, templates, shards=shards, transform=transform,
                           max_samples=spec.max_samples)
    from torchvision.datasets import ImageFolder

    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not folders:
        raise DatasetError(f"{root} has no class folders: expected one folder per class "
                           f"({'n01440764/, n01443537/, ...' if spec.dataset == 'imagenet' else '0/, 1/, ...'}) "
                           "or CLIP_benchmark shards (test/nshards.txt)")
    classnames, templates = _names_and_templates(spec, None)
    if len(folders) != len(classnames):
        source = spec.classnames or f"the {spec.dataset} class list"
        raise DatasetError(f"{root} has {len(folders)} class folders but {source} names {len(classnames)} classes")
    # torchvision labels the folders in sorted order: names that are the folders' are matched by name,
    # others are paired with the sorted folders and the pairing is reported.
    by_name = sorted(classnames) == folders
    folder_classes = None if by_name else dict(zip(folders, classnames))
    classnames = folders if by_name else classnames
    try:
        images = ImageFolder(str(root), transform=transform)
    except FileNotFoundError as exc:  # class folders without an image torchvision reads
        raise DatasetError(f"{root}: {exc}") from None
    if spec.max_samples is not None and spec.max_samples < len(images):
        images = torch.utils.data.Subset(images, range(spec.max_samples))
    return ZeroShotSet(spec.label, classnames, templates, images=images, folder_classes=folder_classes)


def _wds_shards(root: Path) -> Optional[list[str]]:
    """The test shards of a CLIP_benchmark webdataset (ROOT/test/nshards.txt, or ROOT/nshards.txt), or None."""
    split = next((d for d in (root / "test", root) if (d / "nshards.txt").is_file()), None)
    if split is None:
        return None
    count = _text(split / "nshards.txt").strip()
    if not count.isdigit() or int(count) == 0:
        raise DatasetError(f"{split}/nshards.txt should hold the number of shards, not {count!r}")
    shards = [str(split / f"{i}.tar") for i in range(int(count))]
    missing = [s for s in shards if not Path(s).is_file()]
    if missing:
        raise DatasetError(f"{split}/nshards.txt names {len(shards)} shards but {missing[0]} is missing")
    return shards


def load_retrieval_set(spec: RetrievalSpec, transform: Callable) -> RetrievalSet:
    """A retrieval set: CLIP_benchmark retrieval shards, or a folder of image/caption pairs (every image
    below it, in sorted order, with the .txt of the same name beside it)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    root = Path(spec.path)
    if not root.is_dir():
        raise DatasetError(f"retrieval dataset folder not found: {root}")
    shards = _wds_shards(root)
    if shards is not None:
        kind_file = root / "dataset_type.txt"
        kind = _text(kind_file).strip().lower() if kind_file.is_file() else "retrieval"
        if kind != "retrieval":
            raise DatasetError(f"{kind_file} says {kind!r}: CLIP_benchmark retrieval sets say 'retrieval' "
                               "(their samples carry captions, .txt, not labels)")
        return RetrievalSet(spec.label, shards=shards, transform=transform, max_samples=spec.max_samples)
    images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMG_EXTENSIONS and p.is_file())
    if not images:
        raise DatasetError(f"{root} holds no images: a retrieval set is a folder of image/caption pairs (x.jpg with "
                           "x.txt, one caption per line) or CLIP_benchmark retrieval shards (test/nshards.txt)")
    missing = [p for p in images if not p.with_suffix(".txt").is_file()]
    if missing:
        others = f" (and {len(missing) - 1} other images lack theirs)" if len(missing) > 1 else ""
        raise DatasetError(f"{missing[0]} has no caption file {missing[0].with_suffix('.txt').name}{others}")
    pairs = [(p, _captions(_text(p.with_suffix(".txt")))) for p in images[:spec.max_samples]]
    empty = next((p for p, captions in pairs if not captions), None)
    if empty is not None:
        raise DatasetError(f"{empty.with_suffix('.txt')} holds no caption (one per line)")
    return RetrievalSet(spec.label, pairs=pairs, transform=transform, max_samples=spec.max_samples)


def load_eval_set(spec: Union[ZeroShotSpec, RetrievalSpec], transform: Callable) -> EvalSet:
    """The zero-shot or retrieval set a spec describes."""
    if isinstance(spec, RetrievalSpec):
        return load_retrieval_set(spec, transform)
    return load_zeroshot_set(spec, transform)


def _names_and_templates(spec: ZeroShotSpec, wds_root: Optional[Path]) -> tuple[list[str], list[Callable]]:
    """Class names and templates: ImageNet's (as OpenCLIP and CLIP_benchmark have them), the digits',
    the given files, or a CLIP_benchmark dataset's own classnames.txt / templates file."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    from fsdpclip.data.digits import CLASSNAMES, TEMPLATES

    own_templates = wds_root / "zeroshot_classification_templates.txt" if wds_root else None
    if spec.templates is not None:
        templates = read_templates(spec.templates)
    elif spec.dataset == "digits":
        templates = [lambda c, t=t: t.format(c=c) for t in TEMPLATES]
    elif spec.dataset == "folder" and own_templates is not None and own_templates.is_file():
        templates = read_templates(str(own_templates))
    else:
        templates = read_templates("openai")
    if spec.dataset == "imagenet":
        return list(IMAGENET_CLASSNAMES), templates
    if spec.dataset == "digits":
        return list(CLASSNAMES), templates
    if spec.classnames is not None:
        return _lines(Path(spec.classnames)), templates
    if wds_root is not None and (wds_root / "classnames.txt").is_file():
        return _lines(wds_root / "classnames.txt"), templates
    raise DatasetError(f"{spec.path}: a 'folder' dataset needs --classnames (one name per line, in label order)")


# ----------------------------------------------------------------------- metrics
def _shares(batches: Iterator, limit: Optional[int], rank: int, world: int, device: torch.device) -> Iterator:
    """This rank's batches with the images all ranks take in that round, ending on every rank at once:
    when all ranks' batches are done or `limit` images are taken. Each round the ranks take images
    in rank order up to the limit, so the count is exact for any number of ranks and data workers;
    a rank with nothing to take gets None and runs a padding forward."""
    taken = 0
    while True:
        batch = next(batches, None)
        size = 0 if batch is None else len(batch[0])
        sizes = [size]
        if world > 1:
            gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
            dist.all_gather(gathered, torch.tensor([size], dtype=torch.int64, device=device))
            sizes = torch.cat(gathered).tolist()
        left = sum(sizes) if limit is None else min(sum(sizes), limit - taken)
        if left <= 0:
            return
        share = max(0, min(size, left - sum(sizes[:rank])))
        taken += left
        yield (tuple(part[:share] for part in batch) if share else None), left


@torch.no_grad()
def zeroshot_metrics(model: nn.Module, tokenizer: Callable, zs: ZeroShotSet, device: torch.device,
                     batch_size: int, workers: int = 2, progress: Optional[Callable[[int], None]] = None) -> dict:
    """acc1, acc5 and mean per-class recall over the whole set, identical on every rank."""
    from open_clip import build_zero_shot_classifier

    from fsdpclip.model.build import image_shape
    from fsdpclip.parallel.parallelize import reshard

    was_training = model.training
    model.eval()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    classifier = build_zero_shot_classifier(model, tokenizer, zs.classnames, zs.templates, device=device,
                                            num_classes_per_batch=max(1, batch_size // len(zs.templates)))
    classes = len(zs.classnames)
    confusion = torch.zeros(classes, classes, dtype=torch.float64, device=device)
    top5 = torch.zeros((), dtype=torch.float64, device=device)
    padding = (torch.zeros(1, *image_shape(model)), torch.tensor([-1]))
    shares = _shares(zs.batches(rank, world, batch_size, workers), zs.max_samples, rank, world, device)
    with contextlib.closing(shares):
        for batch, taken in shares:
            images, labels = batch or padding
            if int(labels.max()) >= classes:
                raise DatasetError(f"{zs.name}: label {int(labels.max())} but only {classes} class names")
            features = F.normalize(model.encode_image(images.to(device)).float(), dim=-1)
            logits = 100.0 * features @ classifier
            labels = labels.to(device)
            keep = labels >= 0
            predicted = logits.argmax(dim=-1)
            confusion.index_put_((labels[keep], predicted[keep]),
                                 torch.ones_like(labels[keep], dtype=confusion.dtype), accumulate=True)
            top5 += (logits.topk(min(5, classes), dim=-1).indices == labels[:, None]).any(dim=-1)[keep].sum()
            if progress is not None:
                progress(taken)
    if world > 1:
        dist.all_reduce(confusion)
        dist.all_reduce(top5)
    reshard(model)
    model.train(was_training)
    total = confusion.sum()
    if total == 0:
        raise DatasetError(f"{zs.name}: no images found")
    per_class = confusion.diag() / confusion.sum(dim=1).clamp(min=1)
    present = confusion.sum(dim=1) > 0
    return {"acc1": (confusion.diag().sum() / total).item(),
            "acc5": (top5 / total).item() if classes >= 5 else float("nan"),
            "mean_per_class_recall": per_class[present].mean().item(), "samples": int(total.item())}


@torch.no_grad()
def retrieval_metrics(model: nn.Module, tokenizer: Callable, rs: RetrievalSet, device: torch.device,
                      batch_size: int, workers: int = 2, progress: Optional[Callable[[int], None]] = None) -> dict:
    """Text→image and image→text recall@1/5/10 over the whole set, identical on every rank."""
    from fsdpclip.model.build import image_shape
    from fsdpclip.parallel.parallelize import reshard

    was_training = model.training
    model.eval()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    padding = (torch.zeros(1, *image_shape(model)), torch.tensor([-1]), [[""]])  # id -1: dropped below
    images, image_ids, texts, owners = [], [], [], []
    shares = _shares(rs.batches(rank, world, batch_size, workers), rs.max_samples, rank, world, device)
    with contextlib.closing(shares):
        for batch, taken in shares:
            pixels, ids, captions = batch or padding
            images.append(F.normalize(model.encode_image(pixels.to(device)).float(), dim=-1))
            tokens = tokenizer([caption for group in captions for caption in group]).to(device)
            texts.append(F.normalize(model.encode_text(tokens).float(), dim=-1))
            image_ids.append(ids.to(device))
            owners.append(ids.repeat_interleave(torch.tensor([len(group) for group in captions])).to(device))
            if progress is not None:
                progress(taken)
    reshard(model)
    model.train(was_training)
    if not images:  # not one round: the set is empty (every rank knows)
        raise DatasetError(f"{rs.name}: no images found")
    images, image_ids, texts, owners = (_gather_rows(torch.cat(parts), device)
                                        for parts in (images, image_ids, texts, owners))
    real_images, real_texts = image_ids >= 0, owners >= 0
    return _recalls(images[real_images], image_ids[real_images], texts[real_texts], owners[real_texts])


def _gather_rows(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """This rank's rows and every other rank's, in rank order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(rows)], dtype=torch.int64, device=device))
    counts = torch.cat(counts).tolist()
    padded = torch.zeros((max(counts), *rows.shape[1:]), dtype=rows.dtype, device=device)
    padded[:len(rows)] = rows
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:n] for g, n in zip(gathered, counts)])


def _recalls(images: torch.Tensor, image_ids: torch.Tensor, texts: torch.Tensor, owners: torch.Tensor) -> dict:
    """Recall@k both ways from normalised image and caption features; `owners` holds each caption's image id.
    Images are put in set order and captions in their images' order (stable), as CLIP_benchmark reads them."""
    order = image_ids.argsort()
    images, image_ids = images[order], image_ids[order]
    owner = torch.searchsorted(image_ids, owners)  # each caption's image, as a row of `images`
    caption_order = owner.argsort(stable=True)
    texts, owner = texts[caption_order], owner[caption_order]
    scores = texts @ images.T  # (captions, images), as CLIP_benchmark computes it
    image_rows = torch.arange(len(images), device=images.device)[:, None]
    metrics = {}
    for k in RECALL_K:
        best_images = scores.topk(min(k, len(images)), dim=1).indices
        best_captions = scores.T.topk(min(k, len(texts)), dim=1).indices
        metrics[f"image_retrieval_recall@{k}"] = (best_images == owner[:, None]).any(dim=1).float().mean().item()
        metrics[f"text_retrieval_recall@{k}"] = (owner[best_captions] == image_rows).any(dim=1).float().mean().item()
    return metrics | {"samples": len(images), "texts": len(texts)}


def evaluate_set(model: nn.Module, tokenizer: Callable, dataset: EvalSet, device: torch.device, batch_size: int,
                 workers: int = 2, progress: Optional[Callable[[int], None]] = None) -> dict:
    """The metrics of a zero-shot or a retrieval set (every rank calls it; every rank gets them)."""
    measure = retrieval_metrics if isinstance(dataset, RetrievalSet) else zeroshot_metrics
    return measure(model, tokenizer, dataset, device, batch_size, workers, progress)


def recalls_by_direction(metrics: dict) -> dict[str, list[float]]:
    """A retrieval result's recall@RECALL_K, per direction ('text→image', 'image→text')."""
    names = {"text→image": "image_retrieval", "image→text": "text_retrieval"}  # CLIP_benchmark's names
    return {direction: [metrics[f"{name}_recall@{k}"] for k in RECALL_K] for direction, name in names.items()}


def result_line(key: str, values: dict) -> str:
    """One evaluation result for the log: 'zero-shot digits: acc1 ...' or 'retrieval digits: ...'."""
    kind, name = key.split("/", 1)
    if kind == "zeroshot":
        return (f"zero-shot {name}: acc1 {values['acc1']:.3f}, acc5 {values['acc5']:.3f}, mean per-class recall "
                f"{values['mean_per_class_recall']:.3f} ({values['samples']} images)")
    recalls = ", ".join(f"{direction} {'/'.join(f'{r:.3f}' for r in by_k)}"
                        for direction, by_k in recalls_by_direction(values).items())
    return (f"retrieval {name}: recall@{'/'.join(map(str, RECALL_K))} {recalls} "
            f"({values['samples']} images, {values['texts']} captions)")


COUNTS = ("samples", "texts")  # in a set's metrics next to the scores: how many images and captions


def clip_benchmark_record(task: str, dataset: str, model: str, pretrained: str, metrics: dict) -> dict:
    """The JSON CLIP_benchmark writes for one result."""
    return {"dataset": dataset, "model": model, "pretrained": pretrained, "task": task,
            "metrics": {k: v for k, v in metrics.items() if k not in COUNTS}, "language": "en"}


# ------------------------------------------------------------------------ models
WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "open_clip_pytorch_model.bin",
                "open_clip_pytorch_model.pth", "model.safetensors", "pytorch_model.bin")


@dataclass
class ModelSource:
    """A model to evaluate: its OpenCLIP config, a label, how to fill a full CPU model with its weights,
    and the sharding of the run that trained it (None: an exported file, sharded by default)."""

    config: dict
    label: str
    fill: Callable[[nn.Module], None]
    job: Optional["Job"] = None


def checkpoint_source(path: Path, model_name: Optional[str], model_config: Optional[str]) -> ModelSource:
    """What `path` holds: a run or checkpoint directory of fsdpclip, an exported file, or an open_clip local-dir."""
    from fsdpclip.checkpoint.sharded import CheckpointError, read_meta, read_model_state, resolve_checkpoint, run_job
    from fsdpclip.model.build import model_config as spec_config
    from fsdpclip.model.weights import load_model_weights
    from fsdpclip.problems import ModelError
    from fsdpclip.spec.job import ModelSpec

    path = Path(path)
    try:
        checkpoint = resolve_checkpoint(path)
    except CheckpointError:
        checkpoint = None
    if checkpoint is not None:
        if model_name is not None or model_config is not None:
            raise ModelError(f"{path} is an fsdpclip checkpoint, which names its own model: --model and "
                             "--model-config are for exported weights files")
        meta = read_meta(checkpoint)
        return ModelSource(meta["model"]["open_clip_config"], meta["model"]["label"],
                           lambda model: model.load_state_dict(read_model_state(checkpoint, model)),
                           run_job(checkpoint))
    if path.is_dir() and (path / "open_clip_config.json").is_file():
        weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
        if weights is None:
            raise ModelError(f"{path} has open_clip_config.json but none of {', '.join(WEIGHT_FILES)}")
        model_config, path = str(path / "open_clip_config.json"), weights
    elif not path.is_file():
        raise ModelError(f"{path} is not a checkpoint: expected a run or checkpoint directory, "
                         "an OpenCLIP weights file or an open_clip local-dir")
    if (model_name is None) == (model_config is None):
        raise ModelError(f"{path} is an OpenCLIP weights file: give --model NAME or --model-config FILE")
    spec = ModelSpec(name=model_name, config=model_config)
    return ModelSource(spec_config(spec), spec.label, lambda model: load_model_weights(model, str(path), spec.label))


def load_eval_model(source: ModelSource, device: torch.device, mesh, precision: str) -> nn.Module:
    """The model with its weights: plain on one process, sharded with FSDP2 over `mesh` otherwise (as the
    run that trained it was sharded, without what only training needs). Rank 0 reads the weights; the
    other ranks receive only their shards."""
    from fsdpclip.model.build import model_from_config
    from fsdpclip.parallel.parallelize import materialize, parallelize
    from fsdpclip.spec.job import ActivationCheckpointSpec, FsdpSpec

    rank = dist.get_rank() if dist.is_initialized() else 0
    weights = None
    if rank == 0:
        weights = model_from_config(source.config, device="cpu")
        source.fill(weights)
    if mesh is None:
        return weights.to(device).eval()
    model = model_from_config(source.config, device="meta")
    trained = source.job.fsdp if source.job is not None else FsdpSpec()
    fsdp = trained.model_copy(update={"param_dtype": precision, "reduce_dtype": "fp32", "compile": False,
                                      "activation_checkpointing": ActivationCheckpointSpec()})
    parallelize(model, fsdp, mesh, source.job.model.block_classes if source.job is not None else None)
    materialize(model, device, fsdp.cpu_offload, weights)
    return model.eval()


def evaluate_checkpoint(path: Path, spec: Union[ZeroShotSpec, RetrievalSpec], model_name: Optional[str],
                        model_config: Optional[str], precision: str, batch_size: int, workers: Optional[int],
                        progress: Callable[[str, Optional[int]], Callable[[int], None]]) -> Optional[dict]:
    """Zero-shot or retrieval metrics of a checkpoint as CLIP_benchmark records them (with the counts of
    images and captions), on one process or sharded over the ranks torchrun started (every rank calls
    it; the record comes back on rank 0, None elsewhere).

    `progress(set name, images or None)` is called once and returns a callback taking images done."""
    import os

    from fsdpclip.model.build import build_tokenizer, image_transform
    from fsdpclip.parallel.distributed import init_distributed

    source = checkpoint_source(path, model_name, model_config)
    workers = min(4, os.cpu_count() or 1) if workers is None else workers
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    env = init_distributed("cuda" if torch.cuda.is_available() else "cpu", timeout_s=1800) if distributed else None
    device = env.device if env else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = load_eval_model(source, device, env.mesh if env else None, precision)
        dataset = load_eval_set(spec, image_transform(model, train=False))
        advance = progress(dataset.name, dataset.size)
        # One process: autocast gives bf16; sharded: FSDP's mixed precision does.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16" and env is None):
            metrics = evaluate_set(model, build_tokenizer(source.config), dataset, device, batch_size, workers,
                                   progress=advance)
    finally:
        if env is not None:
            dist.destroy_process_group()
    if env is not None and not env.is_main:
        return None
    name = {"imagenet": "imagenet1k"}.get(dataset.name, dataset.name)
    record = clip_benchmark_record(dataset.task, name, source.label, str(path), metrics)
    record |= {k: metrics[k] for k in COUNTS if k in metrics}
    folder_classes = getattr(dataset, "folder_classes", None)
    return record | ({"folder_classes": folder_classes} if folder_classes else {})
