"""Image-text retrieval, computed as CLIP_benchmark computes it: every caption's normalised embedding against
every image's; text→image recall@k (CLIP_benchmark's `image_retrieval_recall@k`) is the fraction of captions
whose image is among their k best images, image→text (`text_retrieval_recall@k`) the fraction of images with
one of their captions among their k best captions. Every rank embeds its share of the images and their
captions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Iterator, Optional

from pydantic import Field

from fsdpclip.jobspec.task import EVAL_TASKS, DatasetError, EvalTask, without_grad
from fsdpclip.jobspec.section import Section

if TYPE_CHECKING:
    import torch
    from fsdpclip.model.build import OpenClip
    from fsdpclip.jobspec.problems import Report

RECALL_K = (1, 5, 10)


class RetrievalSpec(Section):
    path: str = Field(
        description="A folder of image/caption pairs (x.jpg with x.txt, one caption per line; subfolders too) or "
                    "CLIP_benchmark retrieval shards (dataset_type.txt 'retrieval', test/nshards.txt, .txt captions).")
    name: Optional[str] = Field(default=None, description="Name in logs and results; default: the folder's name.")
    max_samples: Optional[int] = Field(
        default=None, gt=0, description="Evaluate on at most this many images (with all their captions).")

    @property
    def label(self) -> str:
        return self.name or Path(self.path).name


class RetrievalTask(EvalTask):
    kind = "retrieval"
    task = "zeroshot_retrieval"
    title = "retrieval"
    spec = RetrievalSpec
    description = "Image-text retrieval sets (recall@1/5/10 both ways, as CLIP_benchmark)."
    flag_help = ("Instead of --zeroshot: a retrieval set, a folder of image/caption pairs (x.jpg, x.txt) or "
                 "CLIP_benchmark retrieval shards.")
    metavar = "PATH"
    usage = "--retrieval DIR (image-text retrieval)"
    panel = "retrieval recall@1"

    def spec_from_flags(self, value, data, classnames, templates, max_samples) -> RetrievalSpec:
        if (data, classnames, templates) != (None, None, None):
            raise ValueError("--data, --classnames and --templates are for --zeroshot; --retrieval takes the "
                             "dataset's folder itself")
        return RetrievalSpec(path=str(Path(value)), max_samples=max_samples)

    def flags(self, spec: RetrievalSpec) -> list[str]:
        limit = [] if spec.max_samples is None else ["--max-samples", str(spec.max_samples)]
        return ["--retrieval", spec.path, *limit]

    def check_paths(self, spec: RetrievalSpec, where: str, report: Report) -> None:
        try:
            load_retrieval_set(spec, transform=None)  # its layout and captions, not its images
        except DatasetError as exc:
            report.missing(f"{where}.path", str(exc), spec.path)

    def paths(self, spec: RetrievalSpec) -> tuple[str, ...]:
        return ("path",)

    def load(self, spec: RetrievalSpec, transform: Optional[Callable]) -> RetrievalSet:
        return load_retrieval_set(spec, transform)

    def measure(self, model, tokenizer, dataset, device, batch_size, workers=2, progress=None) -> dict:
        return retrieval_metrics(model, tokenizer, dataset, device, batch_size, workers, progress)

    def line(self, name: str, values: dict) -> str:
        recalls = ", ".join(f"{direction} {'/'.join(f'{r:.3f}' for r in by_k)}"
                            for direction, by_k in recalls_by_direction(values).items())
        return (f"retrieval {name}: recall@{'/'.join(map(str, RECALL_K))} {recalls} "
                f"({values['samples']} images, {values['texts']} captions)")

    def curves(self, name: str, values: dict) -> dict[str, float]:
        return {f"{name} {direction}": recalls[0] for direction, recalls in recalls_by_direction(values).items()}

    def table(self, metrics: dict) -> tuple[list[str], list[list[str]]]:
        """recall@k a row per direction."""
        return (["", *(f"recall@{k}" for k in RECALL_K)],
                [[direction, *(f"{v:.4f}" for v in values)]
                 for direction, values in recalls_by_direction(metrics).items()])


@dataclass
class RetrievalSet:
    """Images with one or more captions each: `pairs` (image file, its captions) from a folder, or
    `shards`, CLIP_benchmark retrieval shards (an image and a .txt of captions, one per line)."""

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
        from torch.utils.data import Subset

        from fsdpclip.eval.datasets import CaptionedImages, CaptionShards, collate_captioned, loader

        assert self.transform is not None, "a set loaded for its layout only has no batches"
        if self.pairs is not None:
            share = Subset(CaptionedImages(self.pairs, self.transform),
                                            range(rank, len(self.pairs), world_size))
            return loader(share, batch_size, workers, collate=collate_captioned)
        assert self.shards is not None  # no pairs: shards
        return loader(CaptionShards(self.shards, rank, world_size, self.transform, batch_size, self.max_samples),
                       None, workers)




def load_retrieval_set(spec: RetrievalSpec, transform: Optional[Callable]) -> RetrievalSet:
    """A retrieval set: CLIP_benchmark retrieval shards, or a folder of image/caption pairs (every image
    below it, in sorted order, with the .txt of the same name beside it)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    from fsdpclip.eval.datasets import caption_lines, clip_benchmark_shards, read_text

    root = Path(spec.path)
    if not root.is_dir():
        raise DatasetError(f"retrieval dataset folder not found: {root}")
    shards = clip_benchmark_shards(root)
    if shards is not None:
        kind_file = root / "dataset_type.txt"
        kind = read_text(kind_file).strip().lower() if kind_file.is_file() else "retrieval"
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
    pairs = [(p, caption_lines(read_text(p.with_suffix(".txt")))) for p in images[:spec.max_samples]]
    empty = next((p for p, captions in pairs if not captions), None)
    if empty is not None:
        raise DatasetError(f"{empty.with_suffix('.txt')} holds no caption (one per line)")
    return RetrievalSet(spec.label, pairs=pairs, transform=transform, max_samples=spec.max_samples)


@without_grad
def retrieval_metrics(model: OpenClip, tokenizer: Callable, rs: RetrievalSet, device: torch.device,
                      batch_size: int, workers: int = 2, progress: Optional[Callable[[int], None]] = None) -> dict:
    """Text→image and image→text recall@1/5/10 over the whole set, identical on every rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fsdpclip.eval.datasets import gather_rows, in_rounds
    from fsdpclip.model.build import image_shape
    from fsdpclip.parallel.parallelize import reshard

    was_training = model.training
    model.eval()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    padding = (torch.zeros(1, *image_shape(model)), torch.tensor([-1]), [[""]])  # id -1: dropped below
    images, image_ids, texts, owners = [], [], [], []
    shares = in_rounds(rs.batches(rank, world, batch_size, workers), rs.max_samples, rank, world, device)
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
    images, image_ids, texts, owners = (gather_rows(torch.cat(parts), device)
                                        for parts in (images, image_ids, texts, owners))
    real_images, real_texts = image_ids >= 0, owners >= 0
    return _recalls(images[real_images], image_ids[real_images], texts[real_texts], owners[real_texts])


def _recalls(images: torch.Tensor, image_ids: torch.Tensor, texts: torch.Tensor, owners: torch.Tensor) -> dict:
    """Recall@k both ways from normalised image and caption features; `owners` holds each caption's image id.
    Images are put in set order and captions in their images' order (stable), as CLIP_benchmark reads them."""
    import torch

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


def recalls_by_direction(metrics: dict) -> dict[str, list[float]]:
    """A retrieval result's recall@RECALL_K, per direction ('text→image', 'image→text')."""
    names = {"text→image": "image_retrieval", "image→text": "text_retrieval"}  # CLIP_benchmark's names
    return {direction: [metrics[f"{name}_recall@{k}"] for k in RECALL_K] for direction, name in names.items()}


EVAL_TASKS.register(RetrievalTask())
