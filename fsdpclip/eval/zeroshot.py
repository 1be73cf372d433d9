"""Zero-shot classification, computed as CLIP_benchmark computes it: class embeddings (OpenCLIP's
`build_zero_shot_classifier`) are the normalised mean of the normalised template embeddings; logits are
100 × the normalised image features against them; acc1/acc5 are top-k accuracies (acc5 is NaN under 5
classes) and mean per-class recall is the balanced accuracy over the classes present. Every rank embeds its
share of the images and all the prompts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Iterator, Literal, Optional, Union

from pydantic import Field

from fsdpclip.jobspec.task import EVAL_TASKS, DatasetError, EvalTask, without_grad
from fsdpclip.run.files import read_text_file
from fsdpclip.jobspec.section import Section

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Subset
    from torchvision.datasets import ImageFolder

    from fsdpclip.model.build import OpenClip
    from fsdpclip.jobspec.problems import Report


class ZeroShotSpec(Section):
    dataset: Literal["digits", "imagenet", "folder"] = Field(
        description="'digits' (the demo split), 'imagenet' (a val folder of synset folders, or CLIP_benchmark "
                    "webdataset) or 'folder' (one folder per class).")
    path: str = Field(description="Dataset directory.")
    name: Optional[str] = Field(
        default=None, description="Name in logs and results; default: the dataset kind ('folder': the folder's name).")
    classnames: Optional[str] = Field(
        default=None, description="File with one class name per line, in label order ('folder'; default: the class "
                                  "folders' names, or CLIP_benchmark shards' classnames.txt).")
    templates: Optional[str] = Field(
        default=None, description="'openai' (80 prompts), 'simple' or a file with one '{c}' template per line; "
                                  "default: 'openai', and the digits prompts for 'digits'.")
    max_samples: Optional[int] = Field(default=None, gt=0, description="Evaluate on at most this many images.")

    @property
    def label(self) -> str:
        return self.name or (Path(self.path).name if self.dataset == "folder" else self.dataset)


class ZeroShotTask(EvalTask):
    kind = "zeroshot"
    task = "zeroshot_classification"
    title = "zero-shot"
    spec = ZeroShotSpec
    description = "Zero-shot classification sets."
    flag_help = "Which kind of zero-shot set."
    choices = ("imagenet", "digits", "folder")
    usage = "--zeroshot KIND --data DIR (classification)"
    panel = "zero-shot acc1"

    def spec_from_flags(self, value, data, classnames, templates, max_samples) -> ZeroShotSpec:
        if data is None:
            raise ValueError("--zeroshot needs --data DIR, the dataset's folder")
        return ZeroShotSpec.model_validate({"dataset": value, "path": data, "templates": templates,
                                            "max_samples": max_samples, "classnames": classnames})

    def flags(self, spec: ZeroShotSpec) -> list[str]:
        given = {"--classnames": spec.classnames, "--templates": spec.templates, "--max-samples": spec.max_samples}
        return ["--zeroshot", spec.dataset, "--data", spec.path,
                *(part for flag, value in given.items() if value is not None for part in (flag, str(value)))]

    def check_paths(self, spec: ZeroShotSpec, where: str, report: Report) -> None:
        if not Path(spec.path).is_dir():
            report.missing(f"{where}.path", "directory not found", spec.path)
        if spec.classnames is not None and (why := _unreadable(spec.classnames)):
            report.missing(f"{where}.classnames", f"cannot read it: {why}", spec.classnames)
        if spec.templates not in (None, "openai", "simple") and (why := _unreadable(spec.templates)):
            report.missing(f"{where}.templates", f"not 'openai', 'simple' or a readable file: {why}", spec.templates)

    def paths(self, spec: ZeroShotSpec) -> tuple[str, ...]:
        return ("path", "classnames") + (() if spec.templates in (None, "openai", "simple") else ("templates",))

    def load(self, spec: ZeroShotSpec, transform: Optional[Callable]) -> ZeroShotSet:
        return load_zeroshot_set(spec, transform)

    def measure(self, model, tokenizer, dataset, device, batch_size, workers=2, progress=None) -> dict:
        return zeroshot_metrics(model, tokenizer, dataset, device, batch_size, workers, progress)

    def line(self, name: str, values: dict) -> str:
        return (f"zero-shot {name}: acc1 {values['acc1']:.3f}, acc5 {values['acc5']:.3f}, mean per-class recall "
                f"{values['mean_per_class_recall']:.3f} ({values['samples']} images)")

    def curves(self, name: str, values: dict) -> dict[str, float]:
        return {name: values["acc1"]}

    def notes(self, record: dict) -> list[str]:
        if "folder_classes" not in record:
            return []
        pairs = list(record["folder_classes"].items())
        paired = f"{', '.join(f'{f} → {c}' for f, c in pairs[:5])}{', …' if len(pairs) > 5 else ''}"
        return [f"the class names are not the folder names: paired with the folders in sorted order: {paired} "
                "(all in the result JSON, folder_classes)"]


def _unreadable(path: str) -> Optional[str]:
    """Why a text file the spec names cannot be read (directory.read_text_file), or None."""
    try:
        read_text_file(Path(path))
    except OSError as exc:
        return exc.strerror
    return None


@dataclass
class ZeroShotSet:
    """A labelled image set with its class names (in label order) and prompt templates.

    `images` is a map-style dataset of (image, label), or `shards`, a CLIP_benchmark webdataset.
    """

    kind: ClassVar[str] = "zeroshot"
    name: str
    classnames: list[str]
    templates: list[Callable[[str], str]]
    images: Optional[Union[ImageFolder, Subset]] = None
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
        from torch.utils.data import Subset

        from fsdpclip.eval.datasets import ClassShards, loader

        if self.images is not None:  # (a folder's images carry their transform)
            share = Subset(self.images, range(rank, len(self.images), world_size))
            return loader(share, batch_size, workers)
        assert self.shards is not None and self.transform is not None  # no images: shards, read with the transform
        return loader(ClassShards(self.shards, rank, world_size, self.transform, batch_size, self.max_samples),
                       None, workers)




def read_templates(choice: str) -> list[Callable[[str], str]]:
    """'openai' (80 prompts), 'simple' or a file with one '{c}' template per line."""
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

    from fsdpclip.eval.datasets import read_lines

    if choice == "openai":
        return list(OPENAI_IMAGENET_TEMPLATES)
    if choice == "simple":
        return list(SIMPLE_IMAGENET_TEMPLATES)
    return [lambda c, t=line: t.format(c=c) for line in read_lines(Path(choice))]


def load_zeroshot_set(spec: ZeroShotSpec, transform: Optional[Callable]) -> ZeroShotSet:
    """One of the spec's zero-shot sets, from a folder of class folders or CLIP_benchmark shards."""
    from fsdpclip.eval.datasets import clip_benchmark_shards

    root = Path(spec.path)
    if not root.is_dir():
        raise DatasetError(f"dataset folder not found: {root}")
    shards = clip_benchmark_shards(root)
    if shards is not None:
        classnames, templates = _names_and_templates(spec, root)
        if classnames is None:
            raise DatasetError(f"{spec.path}: CLIP_benchmark shards without classnames.txt: give --classnames (one "
                               "name per line, in label order)")
        return ZeroShotSet(spec.label, classnames, templates, shards=shards, transform=transform,
                           max_samples=spec.max_samples)
    from torch.utils.data import Subset
    from torchvision.datasets import ImageFolder

    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not folders:
        raise DatasetError(f"{root} has no class folders: expected one folder per class "
                           f"({'n01440764/, n01443537/, ...' if spec.dataset == 'imagenet' else '0/, 1/, ...'}) "
                           "or CLIP_benchmark shards (test/nshards.txt)")
    classnames, templates = _names_and_templates(spec, None)
    classnames = folders if classnames is None else classnames
    if len(folders) != len(classnames):
        source = spec.classnames or f"the {spec.dataset} class list"
        raise DatasetError(f"{root} has {len(folders)} class folders but {source} names {len(classnames)} classes")
    # torchvision labels the folders in sorted order: names that are the folders' are matched by name, others
    # are paired with the sorted folders (as the built-in class lists are made to be); a class-name file's pairing
    # is reported.
    by_name = sorted(classnames) == folders
    folder_classes = None if by_name or spec.classnames is None else dict(zip(folders, classnames))
    classnames = folders if by_name else classnames
    try:
        images = ImageFolder(str(root), transform=transform)
    except FileNotFoundError as exc:  # class folders without an image torchvision reads
        raise DatasetError(f"{root}: {exc}") from None
    if spec.max_samples is not None and spec.max_samples < len(images):
        images = Subset(images, range(spec.max_samples))
    return ZeroShotSet(spec.label, classnames, templates, images=images, folder_classes=folder_classes)


def _names_and_templates(spec: ZeroShotSpec, wds_root: Optional[Path]) -> tuple[Optional[list[str]],
                                                                               list[Callable]]:
    """Class names and templates: ImageNet's (as OpenCLIP and CLIP_benchmark have them), the digits',
    the given files, or a CLIP_benchmark dataset's own classnames.txt / templates file; no class names (None)
    for a 'folder' set that gives none."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    from fsdpclip.data.digits import CLASSNAMES, TEMPLATES
    from fsdpclip.eval.datasets import read_lines

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
        return read_lines(Path(spec.classnames)), templates
    if wds_root is not None and (wds_root / "classnames.txt").is_file():
        return read_lines(wds_root / "classnames.txt"), templates
    return None, templates


@without_grad
def zeroshot_metrics(model: OpenClip, tokenizer: Callable, zs: ZeroShotSet, device: torch.device,
                     batch_size: int, workers: int = 2, progress: Optional[Callable[[int], None]] = None) -> dict:
    """acc1, acc5 and mean per-class recall over the whole set, identical on every rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from open_clip import build_zero_shot_classifier

    from fsdpclip.eval.datasets import in_rounds
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
    shares = in_rounds(zs.batches(rank, world, batch_size, workers), zs.max_samples, rank, world, device)
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


EVAL_TASKS.register(ZeroShotTask())
