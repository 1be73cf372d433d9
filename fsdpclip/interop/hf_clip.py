"""An OpenCLIP model as a Hugging Face transformers `CLIPModel` directory (`fsdpclip export RUN OUT --format hf`).

OpenCLIP's ViT image tower and its text transformer are the layers of OpenAI's CLIP, which `CLIPModel` holds
under other names: each attention's packed q/k/v projection split in three, the projections transposed into
`nn.Linear` weights, the rest renamed. What `CLIPModel` has no place for (a timm or Hugging Face tower, layer
scale, attentional pooling, CoCa's decoder, SigLIP's logit bias, ...) is refused by `hf_refusal`, naming the
config key. Written without transformers installed: config.json by hand, the weights as model.safetensors, the
image processor's preprocessor_config.json from the model's preprocessing, and the tokenizer's files from the
BPE vocabulary inside OpenCLIP's package where the model uses OpenCLIP's default tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import torch

from fsdpclip.checkpoint.layout import PARTIAL_SUFFIX
from fsdpclip.run.files import write_atomically
from fsdpclip.jobspec.preprocess import PREPROCESSING_KEYS

HF_WEIGHTS = "model.safetensors"
# OpenCLIP's config keys CLIPModel has no place for (given with a value other than OpenCLIP's default): what each is
UNMAPPED = {
    "multimodal_cfg": "CoCa's captioning decoder",
    "init_logit_bias": "a logit bias (SigLIP's): CLIPModel has none, and SiglipModel is not written (OpenCLIP's "
                       "SigLIP image towers are timm's, which this does not map)",
    "timm_model_name": "a timm image tower",
    "hf_model_name": "a Hugging Face text tower",
    "attentional_pool": "attentional pooling",
    "ls_init_value": "layer scale",
    "no_ln_pre": "no LayerNorm before the transformer",
    "pos_embed_type": "position embeddings that are not learned",
    "pool_type": "pooling other than CLIP's (the class token; the end-of-text token, found by argmax)",
    "embed_cls": "a class token in the text tower",
    "no_causal_mask": "a text tower without the causal mask",
    "proj_bias": "a bias in the text projection (CLIPModel's has none)",
    "proj_type": "a text projection that is not linear",
    "act_kwargs": "activation options",
    **dict.fromkeys(("block_type", "qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner", "scale_attn",
                     "scale_fc"), "OpenCLIP's custom attention block"),
}
# Keys that `hf_config` maps (their values checked by `hf_refusal`), or that matter only in training, to the
# tokenizer (whose files are then not written) or to an option refused above
NEUTRAL = {*PREPROCESSING_KEYS, "embed_dim", "quick_gelu", "custom_text", "init_logit_scale", "cast_dtype",
           "vision_cfg", "text_cfg", "layers", "width", "head_width", "heads", "mlp_ratio", "patch_size", "image_size",
           "context_length", "vocab_size", "norm_kwargs", "patch_dropout", "final_ln_after_pool", "output_tokens",
           "pad_id", "eos_id", "hf_tokenizer_name", "tokenizer_mode", "tokenizer_kwargs"}
OWN_TOKENIZER = ("hf_tokenizer_name", "tokenizer_mode", "tokenizer_kwargs")  # text_cfg keys: not OpenCLIP's default
INTERPOLATION = {"bicubic": 3, "bilinear": 2, "nearest": 0}  # PIL's resampling codes, as transformers writes them


def hf_refusal(config: dict) -> Optional[str]:
    """Why an OpenCLIP model config does not map onto `CLIPModel`: the first config key (dotted) it cannot hold,
    and what that key is; None where it maps."""
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    blocks = (("", config, {}), ("vision_cfg.", config["vision_cfg"], _defaults(CLIPVisionCfg)),
              ("text_cfg.", config["text_cfg"], _defaults(CLIPTextCfg)))
    for prefix, block, defaults in blocks:
        for key, value in block.items():
            if key not in NEUTRAL and value != defaults.get(key, None):
                return f"{prefix}{key} ({UNMAPPED.get(key, 'an option CLIPModel has no equivalent for')})"
    vision, text = _towers(config)
    if not isinstance(vision["layers"], int):
        return "vision_cfg.layers (a ResNet image tower)"
    for key in ("image_size", "patch_size"):
        if len(set(_pair(vision[key]))) > 1:
            return f"vision_cfg.{key} (not square: CLIPModel's are)"
    for prefix, block in (("vision_cfg.", vision), ("text_cfg.", text)):
        if set(block["norm_kwargs"] or {}) - {"eps"}:
            return f"{prefix}norm_kwargs (LayerNorm options other than eps)"
    return None


def hf_config(config: dict) -> dict:
    """The config.json of the `CLIPModel` an OpenCLIP model config maps onto (`hf_refusal` None)."""
    vision, text = _towers(config)
    shared = {"hidden_act": "quick_gelu" if config.get("quick_gelu") else "gelu", "projection_dim": config["embed_dim"]}
    vision_config = {
        "hidden_size": vision["width"], "intermediate_size": int(vision["width"] * vision["mlp_ratio"]),
        "num_hidden_layers": vision["layers"], "num_attention_heads": vision["width"] // vision["head_width"],
        "image_size": _pair(vision["image_size"])[0], "patch_size": _pair(vision["patch_size"])[0],
        "num_channels": 3, "layer_norm_eps": _eps(vision), "model_type": "clip_vision_model", **shared}
    text_config = {
        "vocab_size": text["vocab_size"], "hidden_size": text["width"],
        "intermediate_size": int(text["width"] * text["mlp_ratio"]), "num_hidden_layers": text["layers"],
        "num_attention_heads": text["heads"], "max_position_embeddings": text["context_length"],
        "layer_norm_eps": _eps(text), "model_type": "clip_text_model", **shared,
        # eos 2: CLIPTextTransformer pools the token of the largest id (argmax), as OpenCLIP's text tower does
        "bos_token_id": 49406, "eos_token_id": 2, "pad_token_id": 1}
    return {"architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": config["embed_dim"],
            "text_config": text_config, "vision_config": vision_config}


def hf_files(config: dict, preprocess: dict) -> tuple[dict[str, str], list[str]]:
    """The export's files beside its weights (name → content): config.json, the image processor's and the
    tokenizer's where they can be written; and a line for each left out, saying why."""
    files, notes = {"config.json": json.dumps(hf_config(config), indent=2)}, []
    text = config["text_cfg"]
    own = next((key for key in OWN_TOKENIZER if text.get(key) is not None), None)
    if own:
        notes.append(f"no tokenizer files: text_cfg.{own} makes a tokenizer other than OpenCLIP's default, the one "
                     "export writes (from the BPE vocabulary in OpenCLIP's package, without a download)")
    else:
        files.update(tokenizer_files(_towers(config)[1]["context_length"]))
    unsupported = preprocess_refusal(preprocess)
    if unsupported:
        notes.append(f"no preprocessor_config.json: CLIPImageProcessor cannot do {unsupported}")
    else:
        processor_class = {} if own else {"processor_class": "CLIPProcessor"}  # what CLIPProcessor loads with
        files["preprocessor_config.json"] = json.dumps(image_processor_config(preprocess) | processor_class, indent=2)
    return files, notes


def write_hf(out: Path, state: dict[str, torch.Tensor], config: dict, files: dict[str, str]) -> Path:
    """Write an OpenCLIP model's state (of `config`, which `hf_refusal` passes) as a `CLIPModel` directory `out`,
    with `files` (`hf_files`) beside its weights. The weights are written last, under their name only once whole;
    returns their path."""
    from safetensors.torch import save_file

    weights = Path(out) / HF_WEIGHTS
    weights.parent.mkdir(parents=True, exist_ok=True)
    partial = weights.with_name(weights.name + PARTIAL_SUFFIX)
    try:
        for name, content in files.items():
            write_atomically(weights.with_name(name), content)
        save_file(hf_state(state, config), str(partial), metadata={"format": "pt"})
        partial.replace(weights)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return weights


def hf_state(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """OpenCLIP's state dict (`CLIP`, or `CustomTextCLIP` with OpenCLIP's text transformer) as `CLIPModel`'s."""
    text = "text." if config.get("custom_text") else ""
    out = {
        "logit_scale": state["logit_scale"].reshape(()),
        "text_model.embeddings.token_embedding.weight": state[f"{text}token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state[f"{text}positional_embedding"],
        "text_projection.weight": state[f"{text}text_projection"].t().contiguous(),
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        "visual_projection.weight": state["visual.proj"].t().contiguous(),
    }
    norms = {f"{text}ln_final": "text_model.final_layer_norm", "visual.ln_pre": "vision_model.pre_layrnorm",
             "visual.ln_post": "vision_model.post_layernorm"}
    for theirs, ours in norms.items():
        out.update({f"{ours}.{kind}": state[f"{theirs}.{kind}"] for kind in ("weight", "bias")})
    for tower, model in ((f"{text}transformer", "text_model"), ("visual.transformer", "vision_model")):
        out.update(_layers(state, f"{tower}.resblocks.", f"{model}.encoder.layers."))
    return out


def _layers(state: dict[str, torch.Tensor], theirs: str, ours: str) -> dict[str, torch.Tensor]:
    """The residual attention blocks under `theirs` (OpenCLIP's names) as CLIPModel's encoder layers under `ours`."""
    out = {}
    for index in sorted({int(key[len(theirs):].split(".")[0]) for key in state if key.startswith(theirs)}):
        block, layer = f"{theirs}{index}.", f"{ours}{index}."
        for kind in ("weight", "bias"):
            for name, part in zip("qkv", state[f"{block}attn.in_proj_{kind}"].chunk(3)):
                out[f"{layer}self_attn.{name}_proj.{kind}"] = part.clone()  # a view would share the packed storage
            for source, target in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"),
                                   ("ln_2", "layer_norm2"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                out[f"{layer}{target}.{kind}"] = state[f"{block}{source}.{kind}"]
    return out


def preprocess_refusal(preprocess: dict) -> Optional[str]:
    """What of OpenCLIP's evaluation preprocessing (`visual.preprocess_cfg`) `CLIPImageProcessor` cannot do, or None."""
    if preprocess.get("resize_mode") == "longest":
        return "OpenCLIP's resize_mode 'longest' (which pads to a square)"
    if preprocess.get("interpolation", "bicubic") not in INTERPOLATION:
        return f"OpenCLIP's interpolation {preprocess['interpolation']!r}"
    return None


def image_processor_config(preprocess: dict) -> dict:
    """`CLIPImageProcessor`'s preprocessor_config.json for OpenCLIP's evaluation preprocessing (`preprocess_refusal`
    None): the shorter side resized and a centre crop ('shortest'), or both sides resized ('squash')."""
    size, squash = _pair(preprocess["size"])[0], preprocess.get("resize_mode") == "squash"
    return {"image_processor_type": "CLIPImageProcessor", "do_resize": True,
            "size": {"height": size, "width": size} if squash else {"shortest_edge": size},
            "resample": INTERPOLATION[preprocess.get("interpolation", "bicubic")],
            "do_center_crop": not squash, "crop_size": {"height": size, "width": size}, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(preprocess["mean"]),
            "image_std": list(preprocess["std"]), "do_convert_rgb": True}


def tokenizer_files(context_length: int) -> dict[str, str]:
    """`CLIPTokenizer`'s files for OpenCLIP's default tokenizer, OpenAI's BPE that OpenCLIP's package ships: the same
    vocabulary and merges, its start and end of text under transformers' names."""
    from open_clip.tokenizer import SimpleTokenizer

    tokenizer = SimpleTokenizer()
    start, end = "<|startoftext|>", "<|endoftext|>"
    names = {"<start_of_text>": start, "<end_of_text>": end}
    vocab = {names.get(token, token): index for token, index in tokenizer.encoder.items()}
    merges = sorted(tokenizer.bpe_ranks, key=tokenizer.bpe_ranks.__getitem__)
    special = {"bos_token": start, "eos_token": end, "unk_token": end, "pad_token": end}
    return {"vocab.json": json.dumps(vocab, ensure_ascii=False),
            "merges.txt": "#version: 0.2\n" + "".join(f"{first} {second}\n" for first, second in merges),
            "tokenizer_config.json": json.dumps({"tokenizer_class": "CLIPTokenizer", "processor_class": "CLIPProcessor",
                                                 "model_max_length": context_length, **special}, indent=2),
            "special_tokens_map.json": json.dumps(special, indent=2)}


def _defaults(cfg_class: type) -> dict[str, Any]:
    return {field.name: field.default for field in dataclasses.fields(cfg_class)}


def _towers(config: dict) -> tuple[dict, dict]:
    """The config's vision_cfg and text_cfg over OpenCLIP's defaults."""
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    return _defaults(CLIPVisionCfg) | config["vision_cfg"], _defaults(CLIPTextCfg) | config["text_cfg"]


def _pair(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value, value)


def _eps(tower: dict) -> float:
    return (tower["norm_kwargs"] or {}).get("eps", 1e-5)  # OpenCLIP's LayerNorm's, as torch's
