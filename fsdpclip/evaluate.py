"""Zero-shot classification, computed as CLIP_benchmark computes it.

Class embeddings (OpenCLIP's `build_zero_shot_classifier`) are the normalised mean of the normalised
template embeddings; logits are 100 × the normalised image features against them; acc1/acc5 are
top-k accuracies (acc5 is NaN under 5 classes) and mean per-class recall is the balanced accuracy
over the classes present.

Every rank takes part: all embed the same prompts, each embeds its share of the images, and
a rank whose share is exhausted keeps running (padding) forwards until all are done, so no
rank ever skips a forward of the sharded model.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from fsdpclip.data import ignore_stop_signals
from fsdpclip.spec import ZeroShotSpec

if TYPE_CHECKING:
    from fsdpclip.spec import Job

WDS_IMAGE_KEYS = ("webp", "png", "jpg", "jpeg")


class DatasetError(Exception):
    """A zero-shot dataset that is missing or laid out wrongly (message meant for the user)."""


@dataclass
class ZeroShotSet:
    """A labelled image set with its class names (in label order) and prompt templates.

    `images` is a map-style dataset of (image, label), or `shards`, a CLIP_benchmark webdataset.
    """

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
            return iter(DataLoader(share, batch_size=batch_size, num_workers=workers, worker_init_fn=ignore_stop_signals))
        stream = _ClassShards(self.shards[rank::world_size], self.transform, batch_size, self.max_samples)
        return iter(DataLoader(stream, batch_size=None, num_workers=min(workers, len(stream.shards)),
                               worker_init_fn=ignore_stop_signals))


class _ClassShards(IterableDataset):
    """Batches of (image, label) from CLIP_benchmark classification shards (.webp/.png/.jpg + .cls);
    at most `limit` images per worker (no worker needs more; `_shares` makes the total exact)."""

    def __init__(self, shards: list[str], transform: Callable, batch_size: int, limit: Optional[int]):
        self.shards, self.transform, self.batch_size, self.limit = shards, transform, batch_size, limit

    def __iter__(self):
        from PIL import Image
        from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

        info = get_worker_info()
        shards = self.shards[info.id::info.num_workers] if info else self.shards
        samples = group_by_keys(tar_file_expander(url_opener({"url": s} for s in shards)))
        images, labels, seen = [], [], 0
        for sample in samples:
            if self.limit is not None and seen >= self.limit:
                break
            key = next(k for k in WDS_IMAGE_KEYS if k in sample)
            images.append(self.transform(Image.open(io.BytesIO(sample[key])).convert("RGB")))
            labels.append(int(sample["cls"]))
            seen += 1
            if len(images) == self.batch_size:
                yield torch.stack(images), torch.tensor(labels)
                images, labels = [], []
        if images:
            yield torch.stack(images), torch.tensor(labels)


# ---------------------------------------------------------------------- datasets
def read_templates(choice: str) -> list[Callable[[str], str]]:
    """'openai' (80 prompts), 'simple' or a file with one '{c}' template per line."""
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

    if choice == "openai":
        return list(OPENAI_IMAGENET_TEMPLATES)
    if choice == "simple":
        return list(SIMPLE_IMAGENET_TEMPLATES)
    return [lambda c, t=line: t.format(c=c) for line in _lines(Path(choice))]


def _lines(path: Path) -> list[str]:
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}") from None


def load_zeroshot_set(spec: ZeroShotSpec, transform: Callable) -> ZeroShotSet:
    """One of the spec's zero-shot sets, from a folder of class folders or CLIP_benchmark shards."""
    root = Path(spec.path)
    if not root.is_dir():
        raise DatasetError(f"dataset folder not found: {root}")
    wds_split = next((d for d in (root / "test", root) if (d / "nshards.txt").is_file()), None)
    if wds_split is not None:
        classnames, templates = _names_and_templates(spec, root)
        shards = [str(wds_split / f"{i}.tar") for i in range(int((wds_split / "nshards.txt").read_text()))]
        missing = [s for s in shards if not Path(s).is_file()]
        if missing:
            raise DatasetError(f"{wds_split}/nshards.txt names {len(shards)} shards but {missing[0]} is missing")
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


def _names_and_templates(spec: ZeroShotSpec, wds_root: Optional[Path]) -> tuple[list[str], list[Callable]]:
    """Class names and templates: ImageNet's (as OpenCLIP and CLIP_benchmark have them), the digits',
    the given files, or a CLIP_benchmark dataset's own classnames.txt / templates file."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    from fsdpclip.digits import CLASSNAMES, TEMPLATES

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
    a rank with nothing to take gets (None, None) and runs a padding forward."""
    taken = 0
    while True:
        batch = next(batches, None)
        size = 0 if batch is None else len(batch[1])
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
        yield ((batch[0][:share], batch[1][:share]) if share else (None, None)), left


@torch.no_grad()
def zeroshot_metrics(model: nn.Module, tokenizer: Callable, zs: ZeroShotSet, device: torch.device,
                     batch_size: int, workers: int = 2, progress: Optional[Callable[[int], None]] = None) -> dict:
    """acc1, acc5 and mean per-class recall over the whole set, identical on every rank."""
    from open_clip import build_zero_shot_classifier

    from fsdpclip.model import image_shape
    from fsdpclip.parallelize import reshard

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
    for (images, labels), taken in shares:
        if images is None:
            images, labels = padding
        if int(labels.max()) >= classes:
            raise DatasetError(f"{zs.name}: label {int(labels.max())} but only {classes} class names")
        features = F.normalize(model.encode_image(images.to(device)).float(), dim=-1)
        logits = 100.0 * features @ classifier
        labels = labels.to(device)
        keep = labels >= 0
        predicted = logits.argmax(dim=-1)
        confusion.index_put_((labels[keep], predicted[keep]), torch.ones_like(labels[keep], dtype=confusion.dtype),
                             accumulate=True)
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


def clip_benchmark_record(dataset: str, model: str, pretrained: str, metrics: dict) -> dict:
    """The JSON CLIP_benchmark writes for one zero-shot classification result."""
    return {"dataset": dataset, "model": model, "pretrained": pretrained, "task": "zeroshot_classification",
            "metrics": {k: metrics[k] for k in ("acc1", "acc5", "mean_per_class_recall")}, "language": "en"}


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
    from fsdpclip.checkpoint import CheckpointError, read_meta, read_model_state, resolve_checkpoint, run_job
    from fsdpclip.model import model_config as spec_config
    from fsdpclip.problems import ModelError
    from fsdpclip.spec import ModelSpec
    from fsdpclip.weights import load_model_weights

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
    return ModelSource(spec_config(spec), spec.label, lambda model: load_model_weights(model, str(path)))


def load_eval_model(source: ModelSource, device: torch.device, mesh, precision: str) -> nn.Module:
    """The model with its weights: plain on one process, sharded with FSDP2 over `mesh` otherwise (as the
    run that trained it was sharded, without what only training needs). Rank 0 reads the weights; the
    other ranks receive only their shards."""
    from fsdpclip.model import model_from_config
    from fsdpclip.parallelize import materialize, parallelize
    from fsdpclip.spec import ActivationCheckpointSpec, FsdpSpec

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


def evaluate_checkpoint(path: Path, spec: ZeroShotSpec, model_name: Optional[str], model_config: Optional[str],
                        precision: str, batch_size: int, workers: Optional[int],
                        progress: Callable[[str, Optional[int]], Callable[[int], None]]) -> Optional[dict]:
    """Zero-shot metrics of a checkpoint as CLIP_benchmark records them, on one process or sharded over
    the ranks torchrun started (every rank calls it; the record comes back on rank 0, None elsewhere).

    `progress(set name, images or None)` is called once and returns a callback taking images done."""
    import os

    from fsdpclip.distributed import init_distributed
    from fsdpclip.model import build_tokenizer, image_transform

    source = checkpoint_source(path, model_name, model_config)
    workers = min(4, os.cpu_count() or 1) if workers is None else workers
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    env = init_distributed("cuda" if torch.cuda.is_available() else "cpu", timeout_s=1800) if distributed else None
    device = env.device if env else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = load_eval_model(source, device, env.mesh if env else None, precision)
        zs = load_zeroshot_set(spec, image_transform(model, train=False))
        advance = progress(zs.name, zs.size)
        # One process: autocast gives bf16; sharded: FSDP's mixed precision does.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16" and env is None):
            metrics = zeroshot_metrics(model, build_tokenizer(source.config), zs, device, batch_size, workers,
                                       progress=advance)
    finally:
        if env is not None:
            dist.destroy_process_group()
    if env is not None and not env.is_main:
        return None
    dataset = {"imagenet": "imagenet1k"}.get(zs.name, zs.name)
    record = clip_benchmark_record(dataset, source.label, str(path), metrics) | {"samples": metrics["samples"]}
    return record | ({"folder_classes": zs.folder_classes} if zs.folder_classes else {})
