"""Towers from outside OpenCLIP's model configs, timm image towers and Hugging Face text towers: what building
and checking them needs whether a tower family or an OpenCLIP config names them (the families' own parts are in
`fsdpclip.model.families`).

Everything is local: a timm architecture (random weights, or a local weights file), a local timm
directory, and a local Hugging Face directory (config.json, tokenizer files, weights). A hub id
is the user's mistake, reported with its JSON location; nothing is ever downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from torch import nn

from fsdpclip.jobspec.problems import ModelError, closest, joined, relative_path_hint
from fsdpclip.run.files import read_text_file, special_file
from fsdpclip.jobspec.job import ModelSpec

HF_INSTALL = "pip install 'fsdpclip[hf]'"
# The files transformers' tokenizers read from a local directory, where present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model")
LOCAL_HINT = "fsdpclip never downloads: save the model (save_pretrained) or copy its files into a local directory"


# ------------------------------------------------------------------------- configs
def compose(cfg: dict, spec: ModelSpec) -> dict:
    """The OpenCLIP config `cfg` with the spec's embed_dim and its tower families' towers (timm, Hugging Face)
    put in; every tower checked to be local."""
    if spec.embed_dim is not None:
        cfg["embed_dim"] = spec.embed_dim
    for tower, key in (("image", "vision_cfg"), ("text", "text_cfg")):
        if (chosen := getattr(spec, tower).family) is not None:
            family, block = chosen
            cfg[key] = family.config(block)
    base = "model.name" if spec.name else "model.config"
    if "hf_model_name" in cfg["text_cfg"] and spec.text.family is None:
        check_hf_dir(cfg["text_cfg"]["hf_model_name"], base, from_spec=False)
    if "timm_model_name" in cfg["vision_cfg"] and spec.image.family is None:
        check_timm_name(cfg["vision_cfg"]["timm_model_name"], base)
    return cfg


def check_timm_name(name: str, location: str) -> str:
    """A timm registry name or a local timm directory ('local-dir:PATH'); never a hub id."""
    import timm

    source, colon, rest = name.partition(":")
    if colon and source == "local-dir":
        if not (Path(rest) / "config.json").is_file():
            raise ModelError("not a local timm directory with a config.json", location, rest,
                             hint=joined(relative_path_hint(rest), LOCAL_HINT))
        return name
    if colon or "/" in name:
        raise ModelError(f"the timm tower '{name}' is a hub id", location, name, hint=LOCAL_HINT)
    if not timm.is_model(name):
        near = closest(name, timm.list_models(), n=3)
        raise ModelError(f"unknown timm architecture '{name}'", location, name,
                         hint=f"closest: {near}" if near else "see timm.list_models()")
    return name


def create_timm(name: str, location: str) -> nn.Module:
    """A timm model with random weights (no download), or a ModelError at `location`."""
    import timm

    try:
        return timm.create_model(name, pretrained=False)
    except (RuntimeError, ValueError, TypeError, KeyError, OSError) as exc:
        raise ModelError(f"timm cannot build it: {exc}", location, name) from None


def timm_image_size(trunk: Any) -> int | list[int]:  # a timm model
    """The input size a timm trunk was built for (a ViT's patch grid fixes it)."""
    size = getattr(getattr(trunk, "patch_embed", None), "img_size", None) or trunk.pretrained_cfg["input_size"][1:]
    size = [int(s) for s in size]
    return size[0] if size[0] == size[1] else size


def check_hf_dir(path: str, location: str, from_spec: bool) -> None:
    """A local Hugging Face directory of a family HFTextEncoder builds, and transformers to build it."""
    config = Path(path) / "config.json"
    if not config.is_file():
        if from_spec:
            raise ModelError("not a local directory with a config.json", location, path,
                             hint=joined(relative_path_hint(path), LOCAL_HINT))
        raise ModelError(f"its text tower '{path}' is a Hugging Face hub id", location, path,
                         hint=joined(relative_path_hint(path), "set model.text.hf.path to a local directory with "
                                                               "that model's files"))
    try:
        import transformers  # noqa: F401  (only whether it is there)
    except ImportError:
        raise ModelError("a Hugging Face text tower needs the 'transformers' package", location, path,
                         hint=HF_INSTALL) from None
    from open_clip.hf_model import arch_dict

    register_hf_families()
    try:
        model_type = json.loads(read_text_file(config)).get("model_type")
    except OSError as exc:
        raise ModelError(f"cannot read {config}: {exc.strerror}", location, path) from None
    except (json.JSONDecodeError, AttributeError):
        raise ModelError(f"{config} is not a JSON object", location, path) from None
    special = [(name, kind) for name in TOKENIZER_FILES if (kind := special_file(Path(path) / name))]
    if special:  # the tokenizer would read it and block (a FIFO) or never end (a device)
        raise ModelError(f"its {special[0][0]} is not a regular file but {special[0][1]}", location, path)
    if model_type not in arch_dict:
        raise ModelError(f"model_type '{model_type}' is not a text tower OpenCLIP's HFTextEncoder builds", location,
                         path, hint=f"supported: {', '.join(sorted(arch_dict))}")


def register_hf_families() -> None:
    """Let OpenCLIP's HFTextEncoder build T5 as it builds mT5 (same layout; OpenCLIP lists only mT5).
    Called before a Hugging Face tower is checked or built; doing it again changes nothing."""
    from open_clip.hf_model import arch_dict

    arch_dict.setdefault("t5", arch_dict["mt5"])


def hf_max_tokens(model: nn.Module) -> Optional[int]:
    """The most tokens a Hugging Face text tower takes (None: no HF tower, or no limit as with T5)."""
    config = getattr(getattr(getattr(model, "text", None), "transformer", None), "config", None)
    if config is None or config.model_type in ("t5", "mt5"):
        return None
    offset = config.pad_token_id + 1 if config.model_type in ("roberta", "xlm-roberta") else 0  # positions after pad
    return config.max_position_embeddings - offset
