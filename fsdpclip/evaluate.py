"""Zero-shot classification, computed as CLIP_benchmark does (100× logits, per-class template means).

Every rank takes part: all compute the same class embeddings, each embeds an equal share of
the images (padded), and the confusion counts are summed, so no rank ever skips a forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fsdpclip.spec import ZeroShotSpec


@dataclass
class ZeroShotSet:
    """Images with labels, the class names in label order and the prompt templates."""

    name: str
    images: Dataset
    classnames: list[str]
    templates: list[Callable[[str], str]]


def read_templates(choice: str) -> list[Callable[[str], str]]:
    """'openai' (80 prompts), 'simple' or a file with one '{c}' template per line."""
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

    if choice == "openai":
        return list(OPENAI_IMAGENET_TEMPLATES)
    if choice == "simple":
        return list(SIMPLE_IMAGENET_TEMPLATES)
    lines = [line.strip() for line in Path(choice).read_text().splitlines() if line.strip()]
    return [lambda c, t=line: t.format(c=c) for line in lines]


def load_zeroshot_set(spec: ZeroShotSpec, transform: Callable) -> ZeroShotSet:
    """Build one of the spec's zero-shot sets (a folder of class folders)."""
    from torchvision.datasets import ImageFolder

    images = ImageFolder(spec.path, transform=transform)
    if spec.dataset == "digits":
        from fsdpclip.digits import CLASSNAMES, TEMPLATES

        classnames = list(CLASSNAMES)
        templates = [lambda c, t=t: t.format(c=c) for t in TEMPLATES] if spec.templates is None \
            else read_templates(spec.templates)
    elif spec.dataset == "imagenet":
        from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

        classnames, templates = list(IMAGENET_CLASSNAMES), read_templates(spec.templates or "openai")
    else:
        classnames = [line.strip() for line in Path(spec.classnames).read_text().splitlines() if line.strip()]
        templates = read_templates(spec.templates or "openai")
    if len(classnames) != len(images.classes):
        raise ValueError(f"{spec.path} has {len(images.classes)} class folders but {len(classnames)} class names")
    if spec.max_samples is not None and spec.max_samples < len(images):
        images = torch.utils.data.Subset(images, range(spec.max_samples))
    return ZeroShotSet(spec.label, images, classnames, templates)


@torch.no_grad()
def class_embeddings(model: nn.Module, tokenizer: Callable, classnames: Sequence[str],
                     templates: Sequence[Callable[[str], str]], device: torch.device, batch_size: int) -> torch.Tensor:
    """[embed_dim, classes]: per class, the normalised mean of its normalised template embeddings."""
    columns = []
    for name in classnames:
        prompts = [template(name) for template in templates]
        embedded = torch.cat([model.encode_text(tokenizer(prompts[i:i + batch_size]).to(device), normalize=True)
                              for i in range(0, len(prompts), batch_size)])
        columns.append(F.normalize(embedded.float().mean(dim=0), dim=-1))
    return torch.stack(columns, dim=1)


class _RankShare(Dataset):
    """This rank's share of a dataset, padded to the same length on every rank (padding label -1)."""

    def __init__(self, dataset: Dataset, rank: int, world_size: int):
        self.dataset, self.indices = dataset, list(range(rank, len(dataset), world_size))
        self.length = -(-len(dataset) // world_size)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        if i < len(self.indices):
            return self.dataset[self.indices[i]]
        image, _ = self.dataset[0]
        return image, -1


@torch.no_grad()
def zeroshot_metrics(model: nn.Module, tokenizer: Callable, zs: ZeroShotSet, device: torch.device,
                     batch_size: int, workers: int = 2) -> dict:
    """acc1, acc5 and mean per-class recall over the whole set, identical on every rank."""
    was_training = model.training
    model.eval()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    classifier = class_embeddings(model, tokenizer, zs.classnames, zs.templates, device, batch_size)
    classes = len(zs.classnames)
    confusion = torch.zeros(classes, classes, dtype=torch.float64, device=device)
    top5 = torch.zeros((), dtype=torch.float64, device=device)
    loader = DataLoader(_RankShare(zs.images, rank, world), batch_size=batch_size, num_workers=workers)
    for images, labels in loader:
        features = model.encode_image(images.to(device), normalize=True).float()
        logits = 100.0 * features @ classifier
        labels = labels.to(device)
        keep = labels >= 0
        predicted = logits.argmax(dim=-1)
        confusion.index_put_((labels[keep], predicted[keep]), torch.ones_like(labels[keep], dtype=confusion.dtype),
                             accumulate=True)
        k = min(5, classes)
        top5 += (logits.topk(k, dim=-1).indices == labels[:, None]).any(dim=-1)[keep].sum()
    if world > 1:
        dist.all_reduce(confusion)
        dist.all_reduce(top5)
    model.train(was_training)
    total = confusion.sum()
    per_class = confusion.diag() / confusion.sum(dim=1).clamp(min=1)
    present = confusion.sum(dim=1) > 0
    return {"acc1": (confusion.diag().sum() / total).item(),
            "acc5": (top5 / total).item() if classes >= 5 else float("nan"),
            "mean_per_class_recall": per_class[present].mean().item(), "samples": int(total.item())}
