"""The job spec: one JSON document that describes a whole training job.

Pure data: pydantic models with `extra="forbid"` everywhere, no torch. The blocks of registered implementations
(data sources, tower families, eval tasks, launcher backends, losses: `fsdpclip.jobspec.registry`) are declared once,
when this module loads, from what the registries hold then. `fsdpclip.jobspec.jobfile` reads a file into a `Job`
(structural problems as `Problem`s with JSON locations); meaning (does the model exist, do the regexes match) is
checked by `fsdpclip.validate.checks`.
"""

from __future__ import annotations

import math
import re
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, ClassVar, Iterator, Literal, Optional, Union

from pydantic import (
    BeforeValidator,
    Field,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    create_model,
    field_validator,
    model_validator,
)

from fsdpclip.jobspec.source import DATA_SOURCES
from fsdpclip.jobspec.task import EVAL_TASKS
from fsdpclip.jobspec.backend import LAUNCHER_BACKENDS
from fsdpclip.jobspec.family import TOWER_FAMILIES, TowerFamily
from fsdpclip.jobspec.problems import MAX_WORLD_SIZE
from fsdpclip.run.files import write_atomically
from fsdpclip.jobspec.section import OneLine, Section, auto_or_block, environment_names, tagged_union
from fsdpclip.jobspec.losses import LOSSES

Dtype = Literal["bf16", "fp16", "fp32"]
TOWERS = ("image", "text")
SHARED_PARAMETERS = ("logit_scale", "logit_bias")  # the model's parameters outside both towers
SLICE_RE = re.compile(r"^\s*-?\d*\s*:\s*-?\d*\s*(:\s*-?\d+\s*)?$")


MAX_COUNT = 2 ** 20  # a per-GPU batch, an accumulation, a unit size: beyond any job's, and their products fit int64


def _auto_or_count(value: Any, handler) -> Any:
    """One error for a value that is neither 'auto' nor an integer from 1 to MAX_COUNT (not one per union member);
    a number in a string ("32") is no count, nor is true/false."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError("expected a number, not true/false" if isinstance(value, bool) else
                         f"expected 'auto' or an integer from 1 to {MAX_COUNT:,}") from None


AutoOrCount = Annotated[Union[Literal["auto"], Annotated[int, Field(ge=1, le=MAX_COUNT, strict=True)]],
                        WrapValidator(_auto_or_count)]


def _scalar(value: Any, handler) -> Any:
    """One error for a value that is not a JSON scalar (not one per union member)."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError("expected true/false, a number, a string or null") from None


def _dotted(value: Any) -> Any:
    """Nested objects as dotted names, as inductor names its nested options ({"triton": {"cudagraphs": true}},
    what `--set fsdp.compile_options.triton.cudagraphs=true` writes, is "triton.cudagraphs")."""
    if not isinstance(value, dict):
        return value
    flat = {}
    for key, item in value.items():
        if isinstance(item, dict):
            flat.update({f"{key}.{inner}": leaf for inner, leaf in _dotted(item).items()})
        else:
            flat[key] = item
    return flat


InductorOptions = Annotated[dict[str, Annotated[Union[bool, int, float, str, None], WrapValidator(_scalar)]],
                            BeforeValidator(_dotted)]


URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/\s]\S*$")


def is_url(value: str) -> bool:
    """Whether a checkpoint location is a URL of object storage (`scheme://bucket/...`), not a local path."""
    return bool(URL_RE.match(value))


def object_storage_url(value: str) -> str:
    """A URL of object storage whose key holds no control character (NUL included) and no '.' or '..' folder, which
    object storage keeps as names while a download of them would climb out of its local folder."""
    found = next((c for c in value if unicodedata.category(c) == "Cc"), None)
    if found is not None:
        raise ValueError(f"contains the control character {found!r}: a key in object storage here is printable text")
    if any(part in (".", "..") for part in value.split("://", 1)[1].split("/")):
        raise ValueError("has a '.' or '..' folder in its key: object storage keeps it as a name, and the local "
                         "copy of a checkpoint under it would leave the run directory")
    return value


# --------------------------------------------------------------------------- run
class RunSpec(Section):
    name: str = Field(
        default="clip", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=128,
        description="Run name; the run directory is <output_dir>/<name>.")
    output_dir: OneLine = Field(
        default="runs", description="Directory that holds run directories (created if missing).")
    seed: int = Field(
        default=0, ge=0, lt=2 ** 63, description="Seed for initialisation, data order and dropout (below 2^63, as "
                                                 "torch's generators take it with the rank added).")


# ------------------------------------------------------------------------- model
class TowerSpec(Section):
    """A tower's options; each registered tower family of the tower adds its block as one optional field
    (`tower_families`), which replaces the model config's tower when given."""

    tower: ClassVar[str]

    @property
    def family(self) -> Optional[tuple[TowerFamily, Section]]:
        """The tower family given for this tower and its block; None: the model config's own tower."""
        return next(iter(self._families()), None)

    def _families(self) -> list[tuple[TowerFamily, Section]]:
        return [(family, block) for family in TOWER_FAMILIES if family.tower == self.tower
                for block in [getattr(self, family.name, None)] if block is not None]

    @model_validator(mode="after")
    def _one_family(self) -> "TowerSpec":
        given = [family.name for family, _ in self._families()]
        if len(given) > 1:
            raise ValueError(f"give one tower family for the {self.tower} tower, not {' and '.join(given)}")
        return self


def tower_families(tower: str) -> type[TowerSpec]:
    """The base of a tower's spec: an optional field per registered tower family of `tower` (its block)."""
    fields: dict[str, Any] = {family.name: (Optional[family.spec], Field(default=None, description=family.description))
                              for family in TOWER_FAMILIES if family.tower == tower}
    return create_model(f"{tower.title()}TowerFamilies", __base__=TowerSpec, __module__=__name__, **fields)


class ImageTowerSpec(tower_families("image")):
    tower: ClassVar[str] = "image"
    image_size: Optional[int] = Field(default=None, gt=0, description="Override the image size of the model config.")
    patch_dropout: Optional[float] = Field(
        default=None, ge=0.0, lt=1.0, description="Fraction of patches dropped during training (ViT towers).")
    pretrained: Optional[str] = Field(
        default=None, description="Local weights file for the image tower only (OpenCLIP keys relative to the tower).")
    block_classes: Optional[list[str]] = Field(
        default=None, description="Class names of this tower's repeated blocks (freeze ranges index them); default: "
                                  "the known block classes found in the tower.")


class TextTowerSpec(tower_families("text")):
    tower: ClassVar[str] = "text"
    context_length: Optional[int] = Field(default=None, gt=0, description="Override the text context length.")
    pretrained: Optional[str] = Field(
        default=None, description="Local weights file for the text tower only (OpenCLIP keys relative to the tower).")
    block_classes: Optional[list[str]] = Field(
        default=None, description="Class names of this tower's repeated blocks (freeze ranges index them); default: "
                                  "the known block classes found in the tower.")


WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")  # a model.pretrained value with one is a file


class ModelSpec(Section):
    name: Optional[str] = Field(
        default=None, description="OpenCLIP architecture name, e.g. 'ViT-B-32' (open_clip.list_models()); towers given "
                                  "in `image.timm` or `text.hf` replace its towers.")
    config: Optional[str] = Field(
        default=None, description="Path to a local OpenCLIP model-config JSON (embed_dim, vision_cfg, "
                                  "text_cfg); instead of `name`.")
    embed_dim: Optional[int] = Field(
        default=None, gt=0, description="Width of the joint embedding, over the config's; needed where `image.timm` "
                                        "and `text.hf` replace both towers without `name` or `config`.")
    pretrained: Optional[str] = Field(
        default=None, description="Whole-model weights: a local OpenCLIP checkpoint (a directory or a .pt, .pth, .bin "
                                  "or .safetensors file), or a tag OpenCLIP publishes for `name` (e.g. "
                                  "'laion2b_s34b_b79k'), fetched into the Hugging Face cache before training.")
    quick_gelu: bool = Field(default=False, description="Use QuickGELU activations (OpenAI-trained weights need it).")
    init: Literal["auto", "openclip", "parallel"] = Field(
        default="auto", description="How the run's seed draws the initial weights: 'openclip' as OpenCLIP "
                                    "does, on one core; 'parallel' the same distributions in chunks over every "
                                    "core (the same numbers on any machine). 'auto': 'openclip' up to 1B "
                                    "parameters, 'parallel' above.")
    image: ImageTowerSpec = Field(default_factory=ImageTowerSpec, description="Image tower options.")
    text: TextTowerSpec = Field(default_factory=TextTowerSpec, description="Text tower options.")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        if self.name is not None and self.config is not None:
            raise ValueError("give exactly one of `name` (an OpenCLIP architecture) or `config` (a model-config file)")
        if self.name is None and self.config is None and not self.composed:
            raise ValueError("give `name` (an OpenCLIP architecture), `config` (a model-config file), or both "
                             "`image.timm` and `text.hf` with `embed_dim`")
        if self.composed and self.embed_dim is None:
            raise ValueError("`embed_dim` is needed when `image.timm` and `text.hf` make the whole model")
        return self

    @property
    def published_tag(self) -> Optional[str]:
        """`pretrained` when it names published weights rather than a file: no directory part, no weights suffix."""
        value = self.pretrained
        if value is None or "/" in value or "\\" in value or value.lower().endswith(WEIGHT_SUFFIXES):
            return None
        return value

    @property
    def composed(self) -> bool:
        """Both towers come from tower families (timm, Hugging Face), with no OpenCLIP config underneath."""
        return self.name is None and self.config is None and self.image.family is not None and \
            self.text.family is not None

    @property
    def label(self) -> str:
        """A short name for logs and eval output."""
        base = self.name or (Path(self.config).stem if self.config else None)
        towers = [family.label(block) for family, block in filter(None, (self.image.family, self.text.family))]
        return "+".join(p for p in [base] + towers if p)

    @property
    def block_classes(self) -> dict[str, Optional[list[str]]]:
        return {"image": self.image.block_classes, "text": self.text.block_classes}


# -------------------------------------------------------------------------- fsdp
class WrapSpec(Section):
    image: Optional[list[str]] = Field(
        default=None, description="Module classes of the image tower sharded as their own "
                                  "FSDP units; default: its blocks.")
    text: Optional[list[str]] = Field(
        default=None, description="Module classes of the text tower sharded as their own "
                                  "FSDP units; default: its blocks.")


class ActivationCheckpointSpec(Section):
    image: Union[bool, list[str]] = Field(
        default=False, description="Image-tower module classes to activation-checkpoint; true: its block classes.")
    text: Union[bool, list[str]] = Field(
        default=False, description="Text-tower module classes to activation-checkpoint; true: its block classes.")


class GradScalerSpec(Section):
    enabled: Union[Literal["auto"], bool] = Field(
        default="auto", description="Dynamic loss scaling for fp16 ('auto': on exactly when param_dtype is fp16).")
    init_scale: float = Field(default=2.0 ** 16, gt=0, description="Initial loss scale.")
    growth_interval: int = Field(default=2000, gt=0, description="Steps without overflow before the scale doubles.")


class FsdpSpec(Section):
    wrap: WrapSpec = Field(default_factory=WrapSpec, description="Which modules become FSDP units, per tower.")
    unit_size: AutoOrCount = Field(
        default="auto", description="Consecutive blocks of a tower sharded together as one FSDP unit. 'auto': about "
                                    "400M parameters per unit (docs/performance.md).")
    shard_degree: AutoOrCount = Field(
        default="auto", description="Ranks per shard group (HSDP): parameters are sharded inside a group and "
                                    "replicated across groups; 1 replicates everywhere, the world size shards fully. "
                                    "'auto': shard inside a node, over several nodes only where the model would not "
                                    "fit a GPU (full sharding on the CPU).")
    reshard_after_forward: Union[bool, Literal["auto"]] = Field(
        default="auto", description="Free unsharded parameters after forward (less memory, one more all-gather in "
                                    "backward). 'auto': true, except in towers that compile 'auto' compiles whole.")
    param_dtype: Dtype = Field(default="bf16", description="Dtype of parameters in forward/backward (mixed precision).")
    reduce_dtype: Dtype = Field(default="fp32", description="Dtype of the gradient reduce-scatter.")
    cpu_offload: bool = Field(
        default=False, description="Keep sharded parameters, gradients and optimizer state in CPU memory.")
    activation_checkpointing: ActivationCheckpointSpec = Field(
        default_factory=ActivationCheckpointSpec, description="Module classes whose activations are recomputed in "
                                                              "backward.")
    compile: Union[bool, Literal["auto"]] = Field(
        default="auto", description="torch.compile the modules of the FSDP units before sharding; "
                                    "evaluation stays eager. 'auto': on CUDA for OpenCLIP's blocks, whole "
                                    "towers up to 1B parameters, larger ones block by block where a block's "
                                    "work is worth it (docs/performance.md).")
    compile_options: InductorOptions = Field(
        default_factory=dict,
        description="Inductor options of the compiled modules (torch.compile's `options`, nested ones dotted), e.g. "
                    "{\"coordinate_descent_tuning\": true}; checked against the installed torch.")
    cuda_graph: Union[bool, Literal["auto"]] = Field(
        default="auto", description="Capture each step's forward and backward as one CUDA graph and replay it, with no "
                                    "host work per kernel; needs CUDA, no fp16 loss scaling, CPU offload or patch "
                                    "dropout. 'auto': on for one GPU with OpenCLIP's blocks and no activation "
                                    "checkpointing (docs/performance.md).")
    direct_attention: bool = Field(
        default=True, description="Run nn.MultiheadAttention's common case straight through "
                                  "scaled_dot_product_attention: the same function, parameters and names.")
    direct_patch_embedding: bool = Field(
        default=True, description="Run a ViT's patch embedding (a Conv2d whose stride is its kernel) as one matmul: "
                                  "the same function, parameters and names, faster on the GPU (docs/performance.md).")
    grad_scaler: GradScalerSpec = Field(default_factory=GradScalerSpec, description="Loss scaling (fp16).")
    float8: Union[bool, Literal["auto"]] = Field(
        default="auto", description="Run the linear layers of OpenCLIP's transformer blocks (their MLPs) in float8 "
                                    "through torchao (`pip install 'fsdpclip[float8]'`; CUDA GPUs of compute "
                                    "capability 8.9 or later), where their shapes are large enough to gain; the other "
                                    "layers, frozen ones included, stay in param_dtype, and MFU stays counted against "
                                    "the bf16 peak. 'auto' leaves it off until it is measured faster on GPUs.")
    float8_recipe: Literal["tensorwise", "rowwise"] = Field(
        default="tensorwise", description="torchao's float8 scaling: 'tensorwise' (one scale per tensor; sharded "
                                          "weights are all-gathered in float8) or 'rowwise' (a scale per row, more "
                                          "accurate; weights gathered in param_dtype).")

    @property
    def scales_loss(self) -> bool:
        """Whether the job scales its loss (fp16, unless `grad_scaler.enabled` says otherwise)."""
        return self.param_dtype == "fp16" if self.grad_scaler.enabled == "auto" else self.grad_scaler.enabled


# ------------------------------------------------------------------------ freeze
class TowerFreezeSpec(Section):
    blocks: Optional[str] = Field(
        default=None, description="Python slice of the tower's blocks to freeze, e.g. '0:-1' "
                                  "(all but the last), ':' (all).")
    embeddings: bool = Field(
        default=False, description="Freeze the parts before the blocks (patch/token and position embeddings).")
    head: bool = Field(
        default=False, description="Freeze the parts after the blocks (final norms, pooling, projection).")

    @field_validator("blocks")
    @classmethod
    def _slice(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not SLICE_RE.match(value):
            raise ValueError("must be a Python slice 'start:stop[:step]', e.g. '0:-1'")
        if value is not None and value.count(":") == 2 and int(value.split(":")[2]) == 0:
            raise ValueError("slice step cannot be zero")
        return value


class FreezeSpec(Section):
    image: TowerFreezeSpec = Field(default_factory=TowerFreezeSpec, description="Frozen parts of the image tower.")
    text: TowerFreezeSpec = Field(default_factory=TowerFreezeSpec, description="Frozen parts of the text tower.")
    logit_scale: bool = Field(default=False, description="Freeze the learned temperature (and bias, if any).")


# --------------------------------------------------------------------- optimizer
class DecayRule(Section):
    pattern: Optional[str] = Field(
        default=None, description="Regex searched in the original (unwrapped) parameter name, e.g. 'visual\\.proj$'.")
    max_ndim: Optional[int] = Field(
        default=None, ge=0, description="Only tensors with at most this many dims (1: biases, norms).")
    weight_decay: float = Field(description="Weight decay for the parameters this rule matches first.", ge=0.0)

    @model_validator(mode="after")
    def _selective(self) -> "DecayRule":
        if self.pattern is None and self.max_ndim is None:
            raise ValueError("a decay rule needs `pattern`, `max_ndim` or both")
        return self

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


# open_clip_train's own rule: no decay where `p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or
# 'logit_scale' in n` (embeddings are decayed, as there).
NO_DECAY_PATTERN = r"bn|ln|bias|logit_scale"
DEFAULT_DECAY_RULES = [
    DecayRule(max_ndim=1, weight_decay=0.0),
    DecayRule(pattern=NO_DECAY_PATTERN, weight_decay=0.0),
]


class LayerDecaySpec(Section):
    image: Optional[float] = Field(
        default=None, gt=0, le=1, description="Layer-wise LR decay of the image tower (open_clip_train's "
                                              "--image-layer-decay): each layer's LR is the schedule's × "
                                              "decay^(its depth below the head).")
    text: Optional[float] = Field(
        default=None, gt=0, le=1, description="Layer-wise LR decay of the text tower "
                                              "(open_clip_train's --text-layer-decay).")


class OptimizerSpec(Section):
    lr: float = Field(default=5e-4, gt=0, description="Peak learning rate (AdamW).")
    betas: tuple[float, float] = Field(default=(0.9, 0.98), description="AdamW betas.")
    eps: float = Field(default=1e-6, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(default=0.2, ge=0, description="Weight decay of parameters that no decay rule matches.")
    grad_clip_norm: Optional[float] = Field(
        default=None, gt=0, description="Clip the global gradient norm to this value.")
    on_nonfinite: Literal["skip", "stop"] = Field(
        default="skip", description="A step whose gradient norm is not finite: 'skip' it (weights untouched, "
                                    "counted in metrics) or 'stop' the run at its last good checkpoint (fp16: "
                                    "the grad scaler handles it).")
    decay_rules: list[DecayRule] = Field(
        default_factory=lambda: [r.model_copy() for r in DEFAULT_DECAY_RULES],
        description="Ordered weight-decay rules over the original parameter names; the first match wins, unmatched "
                    "parameters get `weight_decay`. Default: open_clip_train's (no decay for tensors under 2 dims and "
                    "names with 'bn', 'ln', 'bias' or 'logit_scale').")
    layer_decay: LayerDecaySpec = Field(
        default_factory=LayerDecaySpec,
        description="Layer-wise LR decay per tower by OpenCLIP main's layer_groups, the top group at the schedule's "
                    "LR (docs/options.md lists each tower's groups).")

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError("both betas must lie in [0, 1)")
        return value


# ---------------------------------------------------------------------- schedule
FINAL_DECAY = ("const-cooldown", "wsd")  # the kinds that hold the peak LR, then decay over the run's last steps
DECAY_LENGTHS = ("decay_steps", "decay_epochs", "decay_fraction")
DECAY_SHAPES: dict[str, Callable[[float], float]] = {  # the LR's share left above `min_lr` at a decay's progress
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "sqrt": lambda progress: 1.0 - math.sqrt(progress),
}


class ScheduleSpec(Section):
    kind: Literal["cosine", "constant", "const-cooldown", "wsd"] = Field(
        default="cosine",
        description="LR shape after warmup: cosine, constant, or constant then a final decay (`const-cooldown`: "
                    "open_clip_train's; `wsd`: warmup-stable-decay of `decay_shape`).")
    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup steps from 0 to the peak LR.")
    steps: Optional[int] = Field(default=None, gt=0, description="Total optimizer steps (instead of `epochs`).")
    epochs: Optional[int] = Field(
        default=None, gt=0,
        description="Epochs of `data.samples` samples, rounded down to whole micro batches on every rank (instead of "
                    "`steps`; default 1 when neither is set).")
    min_lr: float = Field(
        default=0.0, ge=0,
        description="Floor of the cosine schedule and end of the final decay (at most optimizer.lr).")
    decay_steps: Optional[int] = Field(
        default=None, gt=0,
        description="Steps of the final decay of `const-cooldown` and `wsd`, the last of the run (or `decay_epochs`, "
                    "`decay_fraction`).")
    decay_epochs: Optional[int] = Field(
        default=None, gt=0,
        description="The final decay over the last epochs of `schedule.epochs` (open_clip_train's --epochs-cooldown).")
    decay_fraction: Optional[float] = Field(
        default=None, gt=0, le=1,
        description="The final decay over this share of the run's steps (torchtitan's decay_ratio).")
    decay_shape: Literal["linear", "cosine", "sqrt"] = Field(
        default="linear", description="Shape of `wsd`'s final decay.")
    decay_power: float = Field(
        default=1.0, gt=0,
        description="`const-cooldown` decays as (1 - progress)^power (open_clip_train's --lr-cooldown-power).")

    @field_validator("epochs")
    @classmethod
    def _one_length(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        if value is not None and info.data.get("steps") is not None:
            raise ValueError("give `steps` or `epochs`, not both")
        return value

    @field_validator("decay_steps", "decay_epochs", "decay_fraction")
    @classmethod
    def _decay_length(cls, value: Optional[Union[int, float]], info: ValidationInfo) -> Optional[Union[int, float]]:
        if value is None:
            return value
        if info.data.get("kind") not in FINAL_DECAY:
            raise ValueError(f"a final decay's length, for `kind` {' or '.join(FINAL_DECAY)}")
        given = [name for name in DECAY_LENGTHS if info.data.get(name) is not None]
        if given:
            raise ValueError(f"give one of {', '.join(DECAY_LENGTHS)}, not `{given[0]}` too")
        if info.field_name == "decay_epochs":
            epochs = info.data.get("epochs")
            if epochs is None:
                raise ValueError("needs `schedule.epochs` (or give `decay_steps` or `decay_fraction`)")
            if value > epochs:
                raise ValueError(f"more than the run's {epochs} epochs")
        return value

    @model_validator(mode="after")
    def _decay_given(self) -> "ScheduleSpec":
        if self.kind in FINAL_DECAY and all(getattr(self, name) is None for name in DECAY_LENGTHS):
            raise ValueError(f"`{self.kind}` needs the length of its final decay: give one of "
                             f"{', '.join(DECAY_LENGTHS)}")
        return self

    def decay_length(self, total_steps: int) -> int:
        """Steps of the final decay in a run of `total_steps` (`const-cooldown`, `wsd`)."""
        if self.decay_steps is not None:
            return self.decay_steps
        if self.decay_epochs is not None:
            assert self.epochs is not None  # `_decay_length` requires it
            return round(total_steps * self.decay_epochs / self.epochs)
        assert self.decay_fraction is not None  # `_decay_given` requires one of the three
        return round(total_steps * self.decay_fraction)

    def lr_factor(self, peak_lr: float, total_steps: int) -> Callable[[int], float]:
        """Multiplier of the peak LR at each step: linear warmup, then cosine to `min_lr`, constant, or constant
        until the final decay to `min_lr`. That decay ends with the run (as open_clip_train's `const_lr_cooldown`
        counts its steps): a longer run lengthens the constant part before it."""
        warmup, floor = self.warmup_steps, self.min_lr / peak_lr
        if self.kind == "cosine":
            start, length, shape = warmup, total_steps - warmup, DECAY_SHAPES["cosine"]
        elif self.kind == "constant":
            start, length, shape = math.inf, 0, DECAY_SHAPES["linear"]  # no decay: never reached
        else:
            length = self.decay_length(total_steps)
            start = total_steps - length
            shape = DECAY_SHAPES[self.decay_shape] if self.kind == "wsd" else lambda p: (1.0 - p) ** self.decay_power

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if step < start:
                return 1.0
            return floor + (1.0 - floor) * shape(min(1.0, (step - start) / max(1, length)))

        return factor


# --------------------------------------------------------------------------- ema
class EmaSpec(Section):
    """An exponential moving average of the trained weights, as timm's `ModelEmaV3` keeps it (the EMA OpenCLIP main
    trains with): after the optimizer steps it averages in, average = d × average + (1 - d) × weights."""

    decay: float = Field(
        default=0.9999, gt=0, lt=1, description="d of each update once past `start_step` (and the warmup's ramp).")
    every_steps: int = Field(
        default=1, gt=0, description="Update after every N-th optimizer step (steps that are multiples of N; the decay "
                                     "is not rescaled).")
    start_step: int = Field(
        default=0, ge=0, description="The updates up to optimizer step start_step + 1 copy the weights (d = 0), as "
                                     "timm's `update_after_step`; so does the first update after start_step.")
    warmup: bool = Field(
        default=False, description="timm's `use_warmup`: d ramps as 1 - (1 + n)^(-2/3) over the n-th step after "
                                   "`start_step`, capped at `decay`.")


if TYPE_CHECKING:  # what `auto_or_block` declares, as the type checker reads it
    EmaSetting = Union[Literal["auto"], EmaSpec]
else:
    EmaSetting = auto_or_block(EmaSpec)


# -------------------------------------------------------------------------- data
def batches_per_epoch(samples: int, world_size: int, per_gpu: int) -> int:
    """Micro batches every rank draws in an epoch of `samples`: as many as fill all ranks, the rest of
    the epoch left out (as OpenCLIP's with_epoch), so that each rank is in the same epoch at each step."""
    return samples // (world_size * per_gpu)


def largest_divisor(number: int, bound: int) -> int:
    """The largest divisor of `number` that is at most `bound` (1 at least)."""
    return max(d for d in range(1, max(1, min(bound, number)) + 1) if number % d == 0)


DEFAULT_SOURCE = "webdataset"  # `data.source` when not given
if TYPE_CHECKING:  # one of the registered sources' blocks, known once they are registered
    DataSpec = Any
else:
    DataSpec = tagged_union("source", DEFAULT_SOURCE, DATA_SOURCES.specs())


# ------------------------------------------------------------------------- batch
class BatchSpec(Section):
    per_gpu: AutoOrCount = Field(
        description="Micro batch per GPU (per process) and forward. 'auto' (CUDA only): probed with real steps at "
                    "start, 90% of the largest batch that fits, recorded in the run directory for relaunches.")
    grad_accum: int = Field(
        default=1, gt=0, le=MAX_COUNT, description="Micro batches accumulated per optimizer step (with per_gpu 'auto' "
                                                   "and global_batch: set by the search).")
    global_batch: Optional[int] = Field(
        default=None, gt=0, description="Samples per optimizer step over all GPUs; if set it must equal "
                                        "per_gpu × grad_accum × world size (with per_gpu 'auto', what the "
                                        "batch leaves is accumulated).")

    @property
    def searched(self) -> bool:
        """Whether the trainer searches per_gpu at start ('auto')."""
        return self.per_gpu == "auto"

    @property
    def settled_per_gpu(self) -> int:
        """`per_gpu` as a count: asked only once 'auto' is settled (`Job.with_batch`)."""
        if self.per_gpu == "auto":
            raise ValueError("batch.per_gpu 'auto' is not settled yet")
        return self.per_gpu


# -------------------------------------------------------------------------- loss
DEFAULT_LOSS = "clip"  # `loss.kind` when not given
if TYPE_CHECKING:  # one of the registered losses' blocks, known once they are registered
    LossSpec = Any
else:
    LossSpec = tagged_union("kind", DEFAULT_LOSS, LOSSES.specs())


# -------------------------------------------------------------------------- eval
def eval_task_lists() -> type[Section]:
    """The base of the eval section: a list per registered eval task, `eval.KIND`, of the sets it evaluates."""
    fields: dict[str, Any] = {task.kind: (list[task.spec], Field(default_factory=list, description=task.description))
                              for task in EVAL_TASKS}
    return create_model("EvalTaskLists", __base__=Section, __module__=__name__, **fields)


class EvalSpec(eval_task_lists()):
    every_steps: Optional[int] = Field(default=None, gt=0, description="Evaluate every N optimizer steps (all ranks).")
    at_end: bool = Field(default=True, description="Evaluate after the last step.")
    batch_per_gpu: int = Field(default=64, gt=0, description="Images per GPU and forward during evaluation.")
    ema: bool = Field(
        default=False, description="Evaluate the averaged weights of the `ema` block instead of the trained ones "
                                   "(their records in metrics.jsonl say \"weights\": \"ema\").")

    @property
    def sets(self) -> list[Section]:
        """Every set to evaluate, by task in the registry's order (zero-shot first)."""
        return [spec for task in EVAL_TASKS for spec in getattr(self, task.kind)]


# -------------------------------------------------------------------- checkpoint
class CheckpointSpec(Section):
    every_steps: Optional[int] = Field(
        default=None, gt=0, description="Save a sharded checkpoint every N optimizer steps.")
    every_minutes: Optional[float] = Field(
        default=None, gt=0, description="Save a sharded checkpoint once N minutes of training have passed since "
                                        "the last save or the start (checked about every 10 s); with "
                                        "every_steps, whichever comes first.")
    at_end: bool = Field(default=True, description="Save after the last step.")
    keep: int = Field(default=2, gt=0, description="Complete checkpoints kept (older ones are deleted).")
    resume: Optional[str] = Field(
        default="latest", description="'latest': resume from the run's newest complete checkpoint, if any (local or "
                                      "`remote`); a path or a URL: resume from that checkpoint, or the latest in that "
                                      "folder; null: always start fresh.")
    accept_changes: bool = Field(
        default=False, description="Resume even where this spec changes the checkpoint's run: its global batch, its "
                                   "length in steps or the LR where it resumes (`--accept-changes` sets it).")
    async_save: Union[bool, Literal["auto"]] = Field(
        default="auto", description="Write periodic checkpoints in the background while training goes on. 'auto': on "
                                    "CUDA where the host copies of a node's ranks fit in a quarter of its memory.")
    remote: Optional[str] = Field(
        default=None, description="A folder URL in object storage (s3://, gs://; any fsspec URL but memory://) that "
                                  "mirrors the run's checkpoints, and that a launch resumes from where it holds a "
                                  "newer one. Needs the `remote` extra (gcsfs for gs://).")
    remote_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the fsspec filesystem of `remote` and of a URL in "
                                          "`resume`, e.g. {\"endpoint_url\": \"http://minio:9000\"}; credentials come "
                                          "from the environment, not the spec.")

    @field_validator("remote")
    @classmethod
    def _folder_url(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not is_url(value):
            raise ValueError("must be a URL with a scheme and a path, e.g. s3://bucket/runs/NAME")
        return value if value is None else object_storage_url(value).rstrip("/")

    @field_validator("resume")
    @classmethod
    def _resume_url(cls, value: Optional[str]) -> Optional[str]:
        return object_storage_url(value) if value is not None and is_url(value) else value

    @property
    def periodic(self) -> bool:
        """Whether checkpoints are saved during training, by steps or by minutes."""
        return bool(self.every_steps or self.every_minutes)


# ----------------------------------------------------------------------- logging
# What W&B refuses in a project name (wandb.sdk.wandb_settings.Settings.validate_project).
WANDB_PROJECT_REFUSES = "/\\#?%:"


class WandbSpec(Section):
    project: Optional[str] = Field(
        default=None, max_length=128, description="W&B project (default: W&B's own, or WANDB_PROJECT): at most 128 "
                                                  "characters, none of / \\ # ? % :, as W&B requires.")
    entity: Optional[str] = Field(default=None, description="W&B team or user (default: the logged-in user's).")
    name: Optional[str] = Field(default=None, description="Display name of the W&B run; default: run.name.")
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, description="Tags of the W&B run, 1 to 64 characters each (W&B's limit).")
    mode: Literal["online", "offline", "disabled"] = Field(
        default="online", description="'online' syncs as it trains; 'offline' writes the W&B run locally, never "
                                      "touching the network (`wandb sync` uploads it later); 'disabled' turns W&B off.")

    @field_validator("project")
    @classmethod
    def _project_name(cls, value: Optional[str]) -> Optional[str]:
        refused = sorted(set(WANDB_PROJECT_REFUSES) & set(value or ""))
        if refused:
            raise ValueError(f"W&B refuses project names containing {' '.join(refused)}")
        return value


class LoggingSpec(Section):
    every_steps: int = Field(
        default=10, gt=0, description="Write metrics.jsonl (and TensorBoard) every N optimizer steps.")
    tensorboard: bool = Field(default=False, description="Also write TensorBoard event files (needs `tensorboard`).")
    peak_tflops: Optional[float] = Field(
        default=None, gt=0, description="Peak dense bf16 TFLOP/s of one device for MFU (with fsdp.float8 too: its "
                                        "MFU is bf16-equivalent); default: a table of known GPUs.")
    wandb: Optional[WandbSpec] = Field(
        default=None, description="Also log to Weights & Biases (rank 0; needs `pip install 'fsdpclip[wandb]'`).")


# ------------------------------------------------------------------------ launch
class LaunchOptions(Section):
    """The launch section's own fields; `LaunchSpec` adds a block per launcher backend with settings."""

    nodes: int = Field(
        default=1, gt=0, le=MAX_WORLD_SIZE, description="Number of nodes (nodes × gpus_per_node at most 2^20).")
    gpus_per_node: int = Field(
        default=1, gt=0, le=MAX_WORLD_SIZE, description="Processes per node: one per GPU (or CPU "
                                                        "processes with device 'cpu').")
    device: Literal["cuda", "cpu"] = Field(
        default="cuda", description="'cuda' (NCCL) or 'cpu' (gloo, for tests and demos).")
    gpu_memory_gib: Optional[float] = Field(
        default=None, gt=0, description="Memory of one GPU, to check the estimate against and to settle "
                                        "fsdp.shard_degree 'auto' by (default: the GPU's own, at start).")
    host_memory_gib: Optional[float] = Field(
        default=None, gt=0, description="Host memory of one node, to check the host estimate against; default: the "
                                        "memory of the machine validating, when it checks paths.")
    master_port: int = Field(default=29500, gt=0, lt=65536, description="Rendezvous port on the first node.")
    collective_timeout_s: int = Field(
        default=1800, gt=0, description="Seconds a collective may wait for the other ranks before the job fails.")
    env: dict[str, OneLine] = Field(default_factory=dict,
                                    description="Environment variables for every rank (e.g. NCCL_*).")
    fork_ranks: bool = Field(
        default=True, description="Without Slurm, fork the ranks from `fsdpclip launch`, which has imported torch and "
                                  "OpenCLIP already, so that they start sooner. false, or env setting a variable read "
                                  "when a process loads (PYTHON*, LD_*, MALLOC_*), starts new interpreters.")
    ssh_options: list[OneLine] = Field(
        default_factory=list, description="Options of the ssh that `launch --hostfile` starts each host with, before "
                                          "the host, e.g. ['-p', '2222'].")

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return environment_names(value)

    @model_validator(mode="after")
    def _bounded_world(self) -> "LaunchOptions":
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(world_size_problem(self.world_size))
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


if TYPE_CHECKING:  # the backends' blocks are known once they are registered: each backend reads its own
    LaunchSpec = LaunchOptions
else:
    LaunchSpec = create_model("LaunchSpec", __base__=LaunchOptions, __module__=__name__,
                              **{backend.name: (backend.spec, Field(default_factory=backend.spec,
                                                                    description=backend.description))
                                 for backend in LAUNCHER_BACKENDS if backend.spec is not None})


def world_size_problem(world_size: int) -> str:
    return f"nodes × GPUs per node = {world_size:,} ranks, more than a job may have ({MAX_WORLD_SIZE:,})"


# --------------------------------------------------------------------------- job
class Job(Section):
    schema_ref: Optional[str] = Field(
        default=None, alias="$schema", description="JSON Schema reference for editors; ignored.")
    run: RunSpec = Field(default_factory=RunSpec, description="Run name, output directory and seed.")
    model: ModelSpec = Field(description="The OpenCLIP model and its towers.")
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec,
                           description="Sharding, precision, offload, checkpointing, compile.")
    freeze: FreezeSpec = Field(default_factory=FreezeSpec, description="Frozen ranges of either tower.")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec,
                                     description="AdamW, clipping and weight-decay rules.")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, description="Training length and LR schedule.")
    ema: EmaSetting = Field(
        default="auto", description="An exponential moving average of the trained weights, sharded as they are and "
                                    "saved in each checkpoint; `export --ema` writes it, `eval --ema` and `eval.ema` "
                                    "evaluate it. 'auto': none.")
    data: DataSpec = Field(description="Training data: webdataset shards or a synthetic source.")
    batch: BatchSpec = Field(description="Batch sizes and gradient accumulation.")
    loss: LossSpec = Field(default_factory=LOSSES[DEFAULT_LOSS].spec, description="Contrastive loss: CLIP or SigLIP.")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Zero-shot and retrieval evaluation during and after "
                                                                 "training.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Sharded checkpoints and resume.")
    logging: LoggingSpec = Field(default_factory=LoggingSpec, description="Metrics, TensorBoard and Weights & Biases.")
    launch: LaunchSpec = Field(default_factory=LaunchSpec, description="Nodes, processes per node and Slurm options.")

    @property
    def moving_average(self) -> Optional[EmaSpec]:
        """The `ema` block; None where it is 'auto' (no average is kept)."""
        return self.ema if isinstance(self.ema, EmaSpec) else None

    @property
    def run_dir(self) -> Path:
        """Where this run's job.json, metrics and checkpoints live: <output_dir>/<name>."""
        return Path(self.run.output_dir) / self.run.name

    def with_batch(self, per_gpu: int, grad_accum: int) -> "Job":
        """This job with its batch settled (what `batch.per_gpu: "auto"` chose)."""
        return self.model_copy(update={"batch": self.batch.model_copy(update={"per_gpu": per_gpu,
                                                                                "grad_accum": grad_accum})})

    def samples_per_step(self, world_size: int) -> int:
        """The global batch: samples of one optimizer step over all ranks."""
        return self.batch.settled_per_gpu * self.batch.grad_accum * world_size

    def epoch_samples(self, data_ranks: int) -> Optional[int]:
        """Samples one epoch draws over all data ranks (one stream each: the world size, unless a resume keeps the
        streams of another): `data.samples` rounded down to whole micro batches on every stream
        (`batches_per_epoch`); None without `data.samples`."""
        if self.data.samples is None:
            return None
        per_gpu = self.batch.settled_per_gpu
        return batches_per_epoch(self.data.samples, data_ranks, per_gpu) * data_ranks * per_gpu

    def total_steps(self, world_size: int, step: int = 0, samples_seen: int = 0,
                    data_ranks: Optional[int] = None) -> Optional[int]:
        """Optimizer steps of the whole run: `schedule.steps`, or as many whole steps as `schedule.epochs`
        epochs hold (`epoch_samples` of `data_ranks`, default the world size; None when neither gives the
        length). A run resumed at `step` with `samples_seen` (perhaps at another global batch) keeps its
        length in samples."""
        if self.schedule.steps is not None:
            return self.schedule.steps
        epoch = self.epoch_samples(data_ranks or world_size)
        if epoch is None:
            return None
        left = max(0, epoch * (self.schedule.epochs or 1) - samples_seen)
        return step + left // self.samples_per_step(world_size)

    def length(self, world_size: int, step: int = 0, samples_seen: int = 0, data_ranks: Optional[int] = None) -> int:
        """`total_steps` of a spec that gives the run a length (validate refuses one that does not)."""
        total = self.total_steps(world_size, step, samples_seen, data_ranks)
        if total is None:
            raise ValueError("the length is unknown: set schedule.steps, or data.samples with schedule.epochs")
        return total

    def lr(self, step: int, total_steps: int) -> float:
        """The learning rate of step `step` (0-based) of a run of `total_steps` (`ScheduleSpec.lr_factor`)."""
        return self.optimizer.lr * self.schedule.lr_factor(self.optimizer.lr, total_steps)(step)

    def registered_blocks(self) -> Iterator[tuple[Any, Section]]:
        """Each block of this job that a registered implementation declares, with that implementation: the data
        source's, the tower families' given, every eval set, the loss's and the launcher backends' settings."""
        yield DATA_SOURCES[self.data.source], self.data
        yield from filter(None, (self.model.image.family, self.model.text.family))
        for task in EVAL_TASKS:
            yield from ((task, spec) for spec in getattr(self.eval, task.kind))
        yield LOSSES[self.loss.kind], self.loss
        yield from ((backend, getattr(self.launch, backend.name)) for backend in LAUNCHER_BACKENDS
                    if backend.spec is not None)

    def to_json(self) -> str:
        """The resolved spec as indented JSON (every default spelled out)."""
        return self.model_dump_json(indent=2, by_alias=True, exclude={"schema_ref"}) + "\n"

    def save(self, path: Path) -> None:
        """Write the resolved spec atomically (readers never see half a file, and launches on
        several nodes sharing the run directory do not trip over each other)."""
        write_atomically(Path(path), self.to_json())


# Every registered block is declared: the registries take no more registrations.
for registry in (DATA_SOURCES, TOWER_FAMILIES, EVAL_TASKS, LAUNCHER_BACKENDS, LOSSES):
    registry.close()


def json_schema() -> dict:
    """The JSON Schema of a job spec (committed as schemas/job.schema.json)."""
    schema = Job.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "fsdpclip job spec"
    return schema
