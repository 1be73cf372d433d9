"""A validation loss: held-out image-text webdataset shards through the model's evaluation preprocessing and the
run's tokenizer, their contrastive loss computed as open_clip_train's `evaluate()` computes its `clip_val_loss`
on `--val-data`: per batch, (cross-entropy of logit_scale × images @ texts.T over the texts + the same over the
images) / 2, averaged over the set weighted by the batches' sizes. Beside it, the fraction of images whose
caption is their best within their batch (image→text recall@1) and of captions whose image is (text→image).

The contrastive loss depends on what shares a batch, so the batches are fixed by the set alone: the shards in
their order, each cut into batches of `batch_size` pairs in its own order (its last batch may be short; no
batch spans two shards). Every rank reads every world_size-th shard (split over its data workers) and the sums
are added over the ranks, so any number of ranks and data workers gives the same batches, and the same loss up
to the order of the sums. open_clip_train (one process, its `--batch-size`) gives these batches where each of its
data workers reads one shard (`--workers` = the shards) or where every shard holds a multiple of the batch; its
R@1 ranks each image among the whole set's captions, which is the recall@1 here where the set is one batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Iterator, Optional

from pydantic import Field

from fsdpclip.jobspec.webdataset_spec import Urls
from fsdpclip.jobspec.task import EVAL_TASKS, DatasetError, EvalTask, without_grad
from fsdpclip.jobspec.section import Section

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fsdpclip.jobspec.problems import Report

RECALLS = {"image→text": "image_to_text_batch_R@1", "text→image": "text_to_image_batch_R@1"}  # direction: key


class ValidationSpec(Section):
    urls: Urls = Field(
        description="Held-out webdataset shards (an image, .jpg/.png/.jpeg/.webp, and its caption, .txt, per "
                    "sample), as `data.urls`: URLs or paths with brace expansion (made absolute by launch).")
    name: str = Field(default="val", min_length=1,
                      description="Name in logs and results (metrics.jsonl's 'validation/NAME').")
    batch_size: Optional[int] = Field(
        default=None, gt=0,
        description="Pairs per batch of the contrastive loss (which depends on it); each shard is cut into batches "
                    "of its own. Default: `eval.batch_per_gpu` (`fsdpclip eval --batch-size`).")

    @property
    def label(self) -> str:
        return self.name


class ValidationTask(EvalTask):
    kind = "validation"
    task = "contrastive_validation"
    title = "validation"
    spec = ValidationSpec
    description = ("Held-out image-text shards: their contrastive loss (open_clip_train's clip_val_loss) and "
                   "in-batch recall@1 both ways.")
    flag_help = ("Instead of --zeroshot: held-out image-text shards (brace expansion), their contrastive loss in "
                 "batches of --batch-size.")
    metavar = "SHARDS"
    usage = "--validation SHARDS (contrastive loss)"
    panel = "validation loss"

    def spec_from_flags(self, value, data, classnames, templates, max_samples) -> ValidationSpec:
        if (data, classnames, templates) != (None, None, None):
            raise ValueError("--data, --classnames and --templates are for --zeroshot; --validation takes the "
                             "shards themselves")
        if max_samples is not None:
            raise ValueError("--max-samples is not for --validation: its batches are whole shards' (give fewer "
                             "shards)")
        return ValidationSpec(urls=value)

    def flags(self, spec: ValidationSpec) -> list[str]:
        urls = spec.urls if isinstance(spec.urls, str) else "::".join(spec.urls)
        return ["--validation", urls, *([] if spec.batch_size is None else ["--batch-size", str(spec.batch_size)])]

    def check(self, spec: ValidationSpec, where: str, report: Report) -> None:
        from fsdpclip.data.sources.webdataset import check_shard_urls

        shards = check_shard_urls(spec.urls, f"{where}.urls", report)
        if shards is not None and shards.count == 0:
            report.error(f"{where}.urls", "no shards", spec.urls)

    def check_paths(self, spec: ValidationSpec, where: str, report: Report) -> None:
        from fsdpclip.data.sources.webdataset import check_local_shards
        from fsdpclip.jobspec.urls import ShardPatterns

        try:
            shards = ShardPatterns(spec.urls)
        except ValueError:  # `check` says so
            return
        check_local_shards(shards, f"{where}.urls", report)

    def paths(self, spec: ValidationSpec) -> tuple[str, ...]:
        return ("urls",)

    def load(self, spec: ValidationSpec, transform: Optional[Callable]) -> ValidationSet:
        from fsdpclip.jobspec.urls import shard_urls

        try:
            shards = shard_urls(spec.urls)
        except ValueError as exc:
            raise DatasetError(f"{spec.name}: {exc}") from None
        if not shards:
            raise DatasetError(f"{spec.name}: no shards in {spec.urls!r}")
        return ValidationSet(spec.label, shards, transform, spec.batch_size)

    def measure(self, model, tokenizer, dataset, device, batch_size, workers=2, progress=None) -> dict:
        return validation_metrics(model, tokenizer, dataset, device, batch_size, workers, progress)

    def line(self, name: str, values: dict) -> str:
        recalls = ", ".join(f"{direction} {values[key]:.3f}" for direction, key in RECALLS.items())
        return (f"validation {name}: loss {values['loss']:.4f}, in-batch recall@1 {recalls} ({values['samples']} "
                f"pairs, batches of {values['batch_size']})")

    def curves(self, name: str, values: dict) -> dict[str, float]:
        return {name: values["loss"]}

    def table(self, metrics: dict) -> tuple[list[str], list[list[str]]]:
        """The loss and the in-batch recall@1 both ways, with the batch they depend on."""
        return (["loss", *(f"{direction} R@1" for direction in RECALLS), "batch"],
                [[f"{metrics['loss']:.4f}", *(f"{metrics[key]:.4f}" for key in RECALLS.values()),
                  str(metrics["batch_size"])]])


@dataclass
class ValidationSet:
    """Image-text shards in their order, cut into batches of `batch_size` each (None: the evaluation's)."""

    kind: ClassVar[str] = "validation"
    name: str
    shards: list[str]
    transform: Optional[Callable] = None
    batch_size: Optional[int] = None
    size: ClassVar[Optional[int]] = None  # pairs: unknown before the shards are read

    def batches(self, rank: int, world_size: int, batch_size: int, workers: int) -> Iterator:
        """This rank's (images, captions) batches: those of every world_size-th shard."""
        from fsdpclip.eval.datasets import PairShards, loader

        assert self.transform is not None, "a set is read with the model's transform (`load`'s)"
        return loader(PairShards(self.shards, rank, world_size, self.transform, batch_size, None), None, workers)


@without_grad
def validation_metrics(model: nn.Module, tokenizer: Callable, vs: ValidationSet, device: torch.device,
                       batch_size: int, workers: int = 2, progress: Optional[Callable[[int], None]] = None) -> dict:
    """The contrastive loss and in-batch recall@1 both ways over the whole set, identical on every rank, with
    the batch size they were measured in (the set's, else `batch_size`) and the pairs counted."""
    import torch
    import torch.distributed as dist

    from fsdpclip.eval.datasets import in_rounds
    from fsdpclip.model.build import image_shape
    from fsdpclip.parallel.parallelize import reshard

    batch_size = vs.batch_size or batch_size
    was_training = model.training
    model.eval()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    padding = (torch.zeros(1, *image_shape(model)), [""])
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss × pairs, pairs, image→text, text→image hits
    shares = in_rounds(vs.batches(rank, world, batch_size, workers), None, rank, world, device)
    with contextlib.closing(shares):
        for batch, taken in shares:
            images, captions = batch or padding
            image_features, text_features, logit_scale = _outputs(model(images.to(device),
                                                                        tokenizer(captions).to(device)))
            if batch is not None:
                sums += _batch_sums(image_features.float(), text_features.float(), logit_scale.float().mean())
            if progress is not None:
                progress(taken)
    if world > 1:
        dist.all_reduce(sums)
    reshard(model)
    model.train(was_training)
    loss, pairs, image_hits, text_hits = sums.tolist()
    if pairs == 0:
        raise DatasetError(f"{vs.name}: no samples found")
    return {"loss": loss / pairs, RECALLS["image→text"]: image_hits / pairs,
            RECALLS["text→image"]: text_hits / pairs, "batch_size": batch_size, "samples": int(pairs)}


def _outputs(out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(image features, text features, logit scale) of an OpenCLIP forward, a tuple or a dict (`output_dict`)."""
    if isinstance(out, dict):
        return out["image_features"], out["text_features"], out["logit_scale"]
    return out[0], out[1], out[2]


def _batch_sums(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """(loss × pairs, pairs, image→text hits, text→image hits) of one batch, its loss as open_clip_train's
    `evaluate()` computes it."""
    import torch
    import torch.nn.functional as F

    logits_per_image = logit_scale * image_features @ text_features.t()
    logits_per_text = logits_per_image.t()
    pairs = len(image_features)
    labels = torch.arange(pairs, device=image_features.device)
    loss = (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2
    return torch.stack([loss.double() * pairs, torch.tensor(pairs, dtype=torch.float64, device=labels.device),
                        (logits_per_image.argmax(dim=1) == labels).sum().double(),
                        (logits_per_text.argmax(dim=1) == labels).sum().double()])


EVAL_TASKS.register(ValidationTask())
