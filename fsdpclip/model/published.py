"""OpenCLIP's published weights: their tags, where the Hugging Face cache keeps them, fetching them.

Nothing here reaches the network except `fetch`; `cached_weights` only looks into the cache (the
directory of HF_HUB_CACHE, else HF_HOME/hub, read when called), so `validate` never downloads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from fsdpclip.jobspec.problems import ModelError, closest
from fsdpclip.jobspec.job import ModelSpec

FETCH_HINT = "fetch it where the hub is reachable: fsdpclip fetch {name} {tag} (with the same HF_HOME)"


def published_tags() -> dict[str, list[str]]:
    """Every architecture OpenCLIP publishes weights for, with its tags (open_clip.list_pretrained())."""
    import open_clip

    tags: dict[str, list[str]] = {}
    for name, tag in open_clip.list_pretrained():
        tags.setdefault(name, []).append(tag)
    return tags


def published_config(name: str, tag: str) -> dict:
    """OpenCLIP's entry for NAME's weights TAG (hub file, QuickGELU, normalisation); {} when it has none."""
    from open_clip.pretrained import get_pretrained_cfg

    return get_pretrained_cfg(name, tag)


def tag_problem(name: Optional[str], tag: str) -> Optional[tuple[str, str]]:
    """(message, hint) when TAG is not one of the weights OpenCLIP publishes for architecture NAME."""
    if name is None:
        return ("published weights need model.name, the architecture they were trained for",
                "give model.name, or a local file's path (./weights.pt)")
    if published_config(name, tag):
        return None
    tags = published_tags()
    if name not in tags:
        return (f"OpenCLIP publishes no weights for '{name}'",
                "a local file needs a directory or a suffix (./weights.pt); fsdpclip models --pretrained lists them")
    near = closest(tag, tags[name], n=3, cutoff=0.5)
    return (f"not a file, nor a tag OpenCLIP publishes for '{name}'",
            f"{'closest' if near else 'tags'}: {near or ', '.join(tags[name])}; a local file needs a directory or a "
            "suffix (./weights.pt)")


def quick_gelu_mismatch(name: str, tag: str, model_quick_gelu: bool) -> Optional[str]:
    """A sentence when the weights were trained with another activation than the model uses (open_clip only warns)."""
    trained = bool(published_config(name, tag).get("quick_gelu", False))
    if trained == model_quick_gelu:
        return None
    used, other = ("QuickGELU", "GELU") if trained else ("GELU", "QuickGELU")
    return f"the '{tag}' weights were trained with {used}, but the model uses {other}"


def hub_cache() -> Path:
    """The Hugging Face hub cache as the environment names it now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set (as huggingface_hub reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _hub_files(name: str, tag: str) -> tuple[str, list[str]]:
    """(repository id, the files open_clip would take from it, the safetensors one first)."""
    from open_clip.constants import HF_WEIGHTS_NAME
    from open_clip.pretrained import _get_safe_alternatives

    repo_id, filename = os.path.split(published_config(name, tag)["hf_hub"])
    filename = filename or HF_WEIGHTS_NAME
    return repo_id, [*_get_safe_alternatives(filename), filename]


def cached_weights(name: str, tag: str) -> Optional[str]:
    """The cached file of NAME's weights TAG, or None when the cache lacks it (never downloads)."""
    from huggingface_hub import try_to_load_from_cache

    repo_id, files = _hub_files(name, tag)
    for filename in files:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=hub_cache())
        if isinstance(found, str):
            return found
    return None


def fetch(name: str, tag: str) -> tuple[str, bool]:
    """NAME's weights TAG in the cache, downloaded when missing: (file, whether it was downloaded).
    ModelError when the tag is unknown, the cache lacks it and HF_HUB_OFFLINE is set, or the hub fails."""
    problem = tag_problem(name, tag)
    if problem:
        raise ModelError(f"{tag}: {problem[0]}", "model.pretrained", tag, problem[1])
    cached = cached_weights(name, tag)
    if cached is not None:
        return cached, False
    if hub_offline():
        raise ModelError(f"the '{tag}' weights of {name} are not in the Hugging Face cache ({hub_cache()}) and "
                         "HF_HUB_OFFLINE is set", "model.pretrained", tag, FETCH_HINT.format(name=name, tag=tag))
    from open_clip.pretrained import download_pretrained

    try:
        return download_pretrained(published_config(name, tag), cache_dir=str(hub_cache())), True
    except (OSError, RuntimeError) as exc:  # FileNotFoundError carries the hub's own error
        detail = " ".join(str(exc).split())
        raise ModelError(f"cannot fetch the '{tag}' weights of {name}: {detail[:300]}", "model.pretrained", tag,
                         "check the network, or copy the Hugging Face cache from a machine that has them") from None


def weights_file(spec: ModelSpec) -> str:
    """The file `model.pretrained` names: its path, or the cached file of a published tag (ModelError when
    the cache lacks it)."""
    tag = spec.published_tag
    if tag is None:
        assert spec.pretrained is not None, "model.pretrained names no weights"
        return spec.pretrained
    assert spec.name is not None  # published weights are a named model's (validated)
    found = cached_weights(spec.name, tag)
    if found is None:
        hint = FETCH_HINT.format(name=spec.name, tag=tag)
        raise ModelError(f"the '{tag}' weights of {spec.name} are not in the Hugging Face cache of this node "
                         f"({hub_cache()}): {hint}", "model.pretrained", tag, hint)
    return found
