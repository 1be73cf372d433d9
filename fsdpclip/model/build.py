"""Build OpenCLIP models from the spec, find each tower's blocks, and the inputs a model takes.

Knows nothing of sharding: everything here works on the meta device as on real storage,
and every name it returns is an original (unwrapped) parameter or module name.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import re
import sys
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from fsdpclip.jobspec.preprocess import PREPROCESSING_KEYS, PreprocessSpec
from fsdpclip.model.towers import compose, register_hf_families, timm_image_size
from fsdpclip.jobspec.problems import ModelError, relative_path_hint
from fsdpclip.run.files import read_text_file
from fsdpclip.jobspec.job import SHARED_PARAMETERS, TOWERS, Job, ModelSpec
from fsdpclip.jobspec.family import TOWER_FAMILIES

# An OpenCLIP model, or one of its towers or trunks: OpenCLIP builds them from configs and gives them attributes
# (a tower's preprocess_cfg, a text tower's context length, the encoders) that nn.Module's typing cannot follow,
# so they are read untyped.
OpenClip = Any

# Repeated blocks of OpenCLIP's own towers; the tower families add theirs (`known_block_classes`).
OPENCLIP_BLOCK_CLASSES = ("ResidualAttentionBlock", "CustomResidualAttentionBlock", "Bottleneck", "BasicBlock")
# Parameters outside the blocks that come before them (embeddings, stems); the rest are the head.
EMBEDDING_RE = re.compile(
    r"(^|\.)(conv1|bn1|conv2|bn2|conv3|bn3|class_embedding|positional_embedding|ln_pre|token_embedding|"
    r"patch_embed|cls_token|reg_token|pos_embed|norm_pre|embeddings|embed_tokens|shared|stem|cls_emb)(\.|$)")


# ------------------------------------------------------------------------ building
def model_config(spec: ModelSpec, preprocess: Optional[PreprocessSpec] = None) -> dict:
    """The OpenCLIP model config the spec asks for: its base config (name or file), the towers
    it composes in, and its overrides; with its preprocessing under PREPROCESSING_KEYS (`preprocessing`).
    Never refers to anything that is not local."""
    import open_clip

    own_preprocess = {}
    if spec.config is not None:
        try:
            raw = json.loads(read_text_file(Path(spec.config)))
        except OSError as exc:
            raise ModelError(f"cannot read model config: {exc.strerror}", "model.config", spec.config,
                             hint=relative_path_hint(spec.config)) from None
        except json.JSONDecodeError as exc:
            raise ModelError(f"model config is not valid JSON: {exc.msg} at line {exc.lineno}", "model.config",
                             spec.config) from None
        cfg = raw.get("model_cfg", raw) if isinstance(raw, dict) else None
        missing = [k for k in ("embed_dim", "vision_cfg", "text_cfg") if not isinstance(cfg, dict) or k not in cfg]
        if missing:
            raise ModelError(f"model config lacks {', '.join(missing)}", "model.config", spec.config)
        assert isinstance(raw, dict) and isinstance(cfg, dict)  # as the line above found
        own_preprocess = raw.get("preprocess_cfg") or cfg.get("preprocess_cfg") or {}  # an open_clip local-dir's
    elif spec.name is not None:
        cfg = open_clip.get_model_config(spec.name)
        if cfg is None:
            raise ModelError(f"unknown OpenCLIP model '{spec.name}'", "model.name", spec.name)
    else:
        cfg = {"embed_dim": spec.embed_dim, "vision_cfg": {}, "text_cfg": {}}
    cfg = compose(cfg, spec)
    vision, text = cfg["vision_cfg"], cfg["text_cfg"]
    if spec.quick_gelu:
        cfg["quick_gelu"] = True
    if spec.image.patch_dropout is not None:
        vision["patch_dropout"] = spec.image.patch_dropout
    if spec.image.image_size is not None:
        vision["image_size"] = spec.image.image_size
    if spec.text.context_length is not None:
        text["context_length"] = spec.text.context_length
    # Never download: towers start from random weights or the spec's local files.
    if "timm_model_name" in vision:
        vision["timm_model_pretrained"] = False
    if "hf_model_name" in text:
        text["hf_model_pretrained"] = False
    if spec.name is not None and spec.published_tag is not None:
        own_preprocess = {**own_preprocess, **open_clip.get_pretrained_cfg(spec.name, spec.published_tag)}
    return cfg | preprocessing(own_preprocess, preprocess or PreprocessSpec())


def training_config(job: Job) -> dict:
    """The model config a job trains: `model_config` with its data block's `preprocess` (a webdataset one's)."""
    return model_config(job.model, getattr(job.data, "preprocess", None))


def preprocessing(own: dict, spec: PreprocessSpec) -> dict:
    """A model's preprocessing as a model config holds it: OpenCLIP's PreprocessCfg (its defaults, under the
    model's `own` ones: its config file's, its published tag's) and AugmentationCfg (its defaults), each
    under what `spec` sets. The image size is the model's (`model_from_config`)."""
    from open_clip.transform import AugmentationCfg, PreprocessCfg, merge_preprocess_dict

    overrides = spec.overrides()
    preprocess = merge_preprocess_dict(merge_preprocess_dict(PreprocessCfg(), own), overrides["preprocess_cfg"])
    preprocess.pop("size")
    augmentation = {k: v for k, v in asdict(AugmentationCfg()).items() if v is not None and k != "use_timm"}
    return {"preprocess_cfg": json.loads(json.dumps(preprocess)),
            "augmentation_cfg": json.loads(json.dumps(augmentation | overrides["augmentation_cfg"]))}


@contextmanager
def without_modules(names: tuple[str, ...]):
    """Inside, importing any of `names` not yet imported fails with ImportError, as if it were not
    installed (what optional imports like OpenCLIP's expect); afterwards it imports as usual."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # pyright: ignore[reportArgumentType]  (None: an import of it fails)
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def import_open_clip_as_the_ranks_do(spec: ModelSpec, logs_to_wandb: bool = False) -> None:
    """Import OpenCLIP without what `left_out_of_open_clip` leaves out, as the rank entry does
    (fsdpclip.launch.entry); `fsdpclip launch` does it where its ranks are forked from it. For a process that
    runs one job: its later imports keep OpenCLIP as it was imported."""
    with without_modules(left_out_of_open_clip(spec, logs_to_wandb)):
        import open_clip  # noqa: F401


def left_out_of_open_clip(spec: ModelSpec, logs_to_wandb: bool = False) -> tuple[str, ...]:
    """The installed libraries that OpenCLIP's import would import for nothing in a process that trains this
    model: transformers where the model has no Hugging Face text tower (2.6 s of its import on the GPU hosts),
    and wandb (~1 CPU-second on 2 cores; timm imports it for a logging helper OpenCLIP never calls) unless
    the job logs to W&B, whose rank 0 imports it while OpenCLIP's import may still run on another thread."""
    return (() if hf_text_tower(spec) else ("transformers",)) + (() if logs_to_wandb else ("wandb",))


def hf_text_tower(spec: ModelSpec) -> bool:
    """Whether the model's text tower may be a Hugging Face one, read from the spec and the config file
    it names (its own, or OpenCLIP's bundled one) without importing OpenCLIP. True wherever that
    config cannot be read here: the answer only lets OpenCLIP's import leave transformers out."""
    if any("transformers" in family.imports for family, _ in filter(None, (spec.image.family, spec.text.family))):
        return True
    if spec.config is not None:
        path = Path(spec.config)
    else:
        found = importlib.util.find_spec("open_clip")
        if found is None or not found.submodule_search_locations:
            return True
        path = Path(found.submodule_search_locations[0]) / "model_configs" / f"{spec.name}.json"
    try:
        raw = json.loads(read_text_file(path))
        return "hf_model_name" in raw.get("model_cfg", raw)["text_cfg"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return True


def known_block_classes() -> tuple[str, ...]:
    """The repeated blocks of every tower OpenCLIP and the registered tower families build (also those
    OpenCLIP's own configs name: timm and Hugging Face towers)."""
    return OPENCLIP_BLOCK_CLASSES + tuple(c for family in TOWER_FAMILIES for c in family.block_classes)


def build_model(spec: ModelSpec, device: str | torch.device = "meta") -> nn.Module:
    """Instantiate the model the spec asks for (random init; `meta` allocates nothing)."""
    return model_from_config(model_config(spec), device)


def model_from_config(cfg: dict, device: str | torch.device = "meta") -> nn.Module:
    """Instantiate an OpenCLIP model config the way open_clip.create_model does.

    `logit_scale`/`logit_bias` become 1-element tensors, which FSDP2 can shard; export
    turns them back into OpenCLIP's 0-d shape.
    """
    import open_clip
    from open_clip.transform import AugmentationCfg, PreprocessCfg, merge_preprocess_dict

    cfg = copy.deepcopy(cfg)
    preprocess, augmentation = (cfg.pop(key, {}) for key in PREPROCESSING_KEYS)
    text_cfg = cfg["text_cfg"]
    if "multimodal_cfg" in cfg:
        raise ModelError("CoCa models (a config with multimodal_cfg) are not supported: the contrastive losses "
                         "cannot train their captioning decoder")
    if "hf_model_name" in text_cfg:
        register_hf_families()
    model_class = open_clip.CustomTextCLIP if cfg.pop("custom_text", False) or "hf_model_name" in text_cfg \
        else open_clip.CLIP
    try:
        with torch.device(device):
            model: OpenClip = model_class(**cfg, nonscalar_logit_scale=True)
            fit_timm_input(model.visual, cfg["vision_cfg"].get("image_size"))
    except (ImportError, RuntimeError, OSError) as exc:
        raise ModelError(str(exc)) from None
    except (TypeError, ValueError, AssertionError, KeyError) as exc:
        raise ModelError(f"model config does not build: {type(exc).__name__}: {exc}") from None
    if "hf_model_name" in text_cfg:  # HFTextEncoder takes any length: use the tokenizer's
        from open_clip.tokenizer import DEFAULT_CONTEXT_LENGTH

        model.context_length = model.text.context_length = text_cfg.get("context_length", DEFAULT_CONTEXT_LENGTH)
    size = getattr(model.visual, "image_size", None)
    preprocess = merge_preprocess_dict(merge_preprocess_dict(PreprocessCfg(), preprocess), {"size": size})
    open_clip.model.set_model_preprocess_cfg(model, preprocess)
    model.visual.augmentation_cfg = asdict(AugmentationCfg(**augmentation))  # fsdpclip's: training's augmentation
    return model


def fit_timm_input(visual: nn.Module, image_size) -> None:
    """Resize a timm trunk built for another image size, as open_clip.create_model's force_image_size does."""
    from open_clip.timm_model import TimmModel
    from timm.layers.helpers import to_2tuple

    if isinstance(visual, TimmModel) and image_size is not None and \
            tuple(to_2tuple(image_size)) != tuple(to_2tuple(timm_image_size(visual.trunk))):
        visual.set_input_size(image_size)


def count(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def image_shape(model: OpenClip) -> tuple[int, int, int]:
    """(channels, height, width) of the images the model takes."""
    size = model.visual.preprocess_cfg["size"]
    height, width = (size, size) if isinstance(size, int) else size
    return 3, height, width


def text_shape(model: OpenClip) -> tuple[int, int]:
    """(context length, vocabulary size) of the token ids the model takes."""
    text = getattr(model, "text", model)
    return text.context_length, text.vocab_size


@contextmanager
def fake_batch(model: nn.Module, samples: int = 2):
    """(images, token ids) of `samples` for a forward of a meta-device model. Hugging Face towers look
    into their attention masks, so a model holding one runs in a FakeTensorMode, which lets them skip
    that as traced; any other model runs on plain meta tensors (2.5x faster: FLOP counts at start-up)."""
    context, _ = text_shape(model)

    def inputs():
        return (torch.empty(samples, *image_shape(model), device="meta"),
                torch.zeros(samples, context, dtype=torch.long, device="meta"))

    if not holds_hugging_face_modules(model):
        yield inputs()
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # it logs a failing op's traceback; callers report
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield inputs()
    finally:
        quiet.setLevel(level)


def training_flops_per_sample(model: nn.Module) -> float:
    """FLOPs of one forward and backward per sample, counted once on the meta device.

    Call it on the unwrapped model with its frozen parameters set, before activation
    checkpointing (recomputation is not useful work).
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with fake_batch(model) as (images, texts), counter:
        outputs = model(images, texts)
        (outputs[0].float().sum() + outputs[1].float().sum()).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 2


def holds_hugging_face_modules(model: nn.Module) -> bool:
    """Whether any submodule comes from transformers (a Hugging Face text tower)."""
    return any(type(module).__module__.startswith("transformers.") for module in model.modules())


def original_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Parameter shapes as OpenCLIP defines them (its logit scale and bias are 0-d)."""
    return {name: torch.Size([]) if name in SHARED_PARAMETERS else p.shape for name, p in model.named_parameters()}


# -------------------------------------------------------------------------- towers
def tower_of(name: str) -> Optional[str]:
    """Which tower an original parameter or module name belongs to (None: shared logit scale/bias)."""
    if name == "visual" or name.startswith("visual."):
        return "image"
    if name in SHARED_PARAMETERS or name == "":
        return None
    return "text"


@dataclass
class Tower:
    """One tower of a CLIP model: its repeated blocks and its parameters, by original name."""

    name: str
    block_classes: tuple[str, ...]
    blocks: list[str] = field(default_factory=list)
    parameters: list[str] = field(default_factory=list)
    classes: set[str] = field(default_factory=set)
    block_index: dict[str, int] = field(default_factory=dict)  # parameter -> its block

    def add_parameters(self, names: Iterable[str]) -> None:
        """Record the tower's parameters (in registration order) and the block each belongs to.

        A parameter between two blocks (a stage's downsampling in ConvNeXt or Swin) goes with
        the block after it, which it runs before."""
        index = {block: i for i, block in enumerate(self.blocks)}
        between: list[str] = []
        for name in names:
            self.parameters.append(name)
            parts = name.split(".")
            owner = next((index[p] for p in (".".join(parts[:n]) for n in range(1, len(parts))) if p in index), None)
            if owner is None:
                between.append(name)
                continue
            if self.block_index:  # blocks were seen before: the parameters since then lie between blocks
                self.block_index.update((b, owner) for b in between)
            between = []
            self.block_index[name] = owner

    def block_of(self, parameter: str) -> Optional[int]:
        """Index of the block holding `parameter`, or None outside the blocks."""
        return self.block_index.get(parameter)

    def part_of(self, parameter: str) -> str:
        """'block', 'embeddings' (before the blocks) or 'head' (after them)."""
        if parameter in self.block_index:
            return "block"
        return "embeddings" if EMBEDDING_RE.search(parameter) else "head"


def find_towers(model: nn.Module, block_classes: Optional[dict[str, Optional[list[str]]]] = None) -> dict[str, Tower]:
    """The image and text towers of `model` with their blocks in forward order.

    `block_classes` names a tower's block classes (default: the known ones found in it).
    """
    overrides = block_classes or {}
    modules = {name: module for name, module in model.named_modules() if name}
    classes: dict[str, set[str]] = {t: set() for t in TOWERS}
    for name, module in modules.items():
        if (tower := tower_of(name)) is not None:
            classes[tower].add(type(module).__name__)
    towers = {}
    for tower_name in TOWERS:
        wanted = overrides.get(tower_name)
        names = tuple(wanted) if wanted is not None else tuple(
            c for c in known_block_classes() if c in classes[tower_name])
        towers[tower_name] = Tower(tower_name, names, instances(modules.items(), tower_name, names),
                                   classes=classes[tower_name])
    names = [name for name, _ in model.named_parameters()]
    for tower in towers.values():
        tower.add_parameters(n for n in names if tower_of(n) == tower.name)
    return towers


def instances(modules: Iterable[tuple[str, nn.Module]], tower: str, class_names: Iterable[str]) -> list[str]:
    """Names of the outermost modules of `tower` whose class is in `class_names`, in order."""
    class_names = set(class_names)
    found: list[str] = []
    for name, module in modules:
        if tower_of(name) == tower and type(module).__name__ in class_names:
            if not any(name.startswith(outer + ".") for outer in found):
                found.append(name)
    return found


# -------------------------------------------------------------------------- inputs
def build_tokenizer(cfg: dict):
    """The tokenizer OpenCLIP pairs with a model config (local files only)."""
    import open_clip

    text = cfg["text_cfg"]
    context = text.get("context_length", open_clip.tokenizer.DEFAULT_CONTEXT_LENGTH)
    kwargs = text.get("tokenizer_kwargs") or {}
    if text.get("hf_tokenizer_name"):
        from open_clip.tokenizer import HFTokenizer

        return HFTokenizer(text["hf_tokenizer_name"], context_length=context,
                           tokenizer_mode=text.get("tokenizer_mode"), **kwargs)
    return open_clip.SimpleTokenizer(context_length=context, **kwargs)


def image_transform(model: OpenClip, train: bool) -> Callable:
    """OpenCLIP's preprocessing for this model (`visual.preprocess_cfg`; train: with its augmentation,
    `visual.augmentation_cfg`, where model_from_config set one)."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    augmentation = getattr(model.visual, "augmentation_cfg", None) if train else None
    with warnings.catch_warnings():  # OpenCLIP calls the jitter's and grayscale's keys unused, and uses them
        warnings.filterwarnings("ignore", "Unused augmentation cfg items")
        transform = image_transform_v2(PreprocessCfg(**model.visual.preprocess_cfg), is_train=train,
                                       aug_cfg=augmentation)
    assert callable(transform)  # one transform (not the tuple OpenCLIP gives for other arguments)
    return transform
