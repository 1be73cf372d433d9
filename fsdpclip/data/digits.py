"""The offline demo dataset: scikit-learn's bundled handwritten digits as CLIP training data.

Training pairs go to webdataset shards with captions ("a photo of the number three"); a
held-out split goes to one folder per class for zero-shot classification, each image with two
captions beside it (`test/3/000123.jpg` and `.txt`, one per line) for retrieval.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np

CLASSNAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CAPTIONS = ("a photo of the number {}.", "the digit {}.", "a handwritten {}.", "a picture of a {}.",
            "{} written by hand.", "a small image of the number {}.")
TEMPLATES = ("a photo of the number {c}.", "the digit {c}.", "a handwritten {c}.")
IMAGE_SIZE = 32
TEST_CAPTIONS = 2  # per held-out image


def load_sklearn_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise RuntimeError("the digits demo needs scikit-learn: pip install 'fsdpclip[demo]'") from None
    pixels, target = load_digits(return_X_y=True)
    return pixels.reshape(-1, 8, 8), target  # the 8×8 images (as load_digits().images)


def to_jpeg(image: np.ndarray) -> bytes:
    """An 8×8 digit (0..16) as an RGB JPEG of IMAGE_SIZE pixels."""
    from PIL import Image

    pixels = (np.clip(image, 0, 16) * (255 / 16)).astype(np.uint8)
    picture = Image.fromarray(pixels, mode="L").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)
    picture = picture.convert("RGB")
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def write_digits(out_dir: Path, shards: int = 8, held_out: float = 0.2, seed: int = 0) -> dict:
    """Write `shards` training shards and a held-out zero-shot split under `out_dir`."""
    from webdataset.writer import TarWriter  # (webdataset's own stubs leave it out of the package)

    images, labels = load_sklearn_digits()
    order = np.random.default_rng(seed).permutation(len(labels))
    n_eval = int(round(len(labels) * held_out))
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    captions = random.Random(seed)
    for shard, chunk in enumerate(np.array_split(train_idx, shards)):
        path = out_dir / f"train-{shard:06d}.tar"
        partial = path.with_suffix(".tar.partial")
        with TarWriter(str(partial)) as sink:
            for i in chunk:
                caption = captions.choice(CAPTIONS).format(CLASSNAMES[labels[i]])
                sink.write({"__key__": f"{i:06d}", "jpg": to_jpeg(images[i]), "txt": caption, "cls": int(labels[i])})
        partial.replace(path)
    test_dir = out_dir / "test"
    for label in range(len(CLASSNAMES)):
        (test_dir / str(label)).mkdir(parents=True, exist_ok=True)
    for i in eval_idx:
        image = test_dir / str(labels[i]) / f"{i:06d}.jpg"
        image.write_bytes(to_jpeg(images[i]))
        chosen = captions.sample(CAPTIONS, TEST_CAPTIONS)
        image.with_suffix(".txt").write_text("".join(c.format(CLASSNAMES[labels[i]]) + "\n" for c in chosen))
    (out_dir / "classnames.txt").write_text("\n".join(CLASSNAMES) + "\n")
    (out_dir / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    info = {"train_samples": int(len(train_idx)), "train_shards": shards, "test_samples": int(n_eval),
            "train_urls": str(out_dir / f"train-{{000000..{shards - 1:06d}}}.tar"), "test_dir": str(test_dir)}
    (out_dir / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
