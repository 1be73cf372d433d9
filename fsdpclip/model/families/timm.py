"""The timm tower family: an image tower from a timm architecture or a local timm directory (`model.image.timm`).

Nothing is downloaded; the trunk gets OpenCLIP's pooling and projection. The spec block, its checks and
its path fields load without torch; building it goes through `fsdpclip.model.towers`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from fsdpclip.jobspec.problems import ModelError
from fsdpclip.jobspec.family import TOWER_FAMILIES, TowerFamily
from fsdpclip.jobspec.section import Section

if TYPE_CHECKING:
    from fsdpclip.jobspec.problems import Report

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class TimmTowerSpec(Section):
    name: Optional[str] = Field(
        default=None, description="timm architecture name, e.g. 'vit_base_patch16_224' "
                                  "(timm.list_models()); no hub ids.")
    path: Optional[str] = Field(
        default=None, description="Instead of `name`: a local directory in timm's format (config.json with "
                                  "'architecture', 'model_args' and 'pretrained_cfg'; its weights in "
                                  "model.safetensors or pytorch_model.bin).")
    pretrained: Union[bool, str] = Field(
        default=False, description="Initial trunk weights in timm's key layout: true loads the weights file in `path`; "
                                   "a string is a local weights file. The classifier is dropped. Default: random init.")
    pool: str = Field(
        default="avg", description="Feature pooling of the trunk ('avg', 'token', '' or "
                                   "OpenCLIP's 'abs_attn'/'rot_attn').")
    proj: Literal["linear", "mlp", "head", "none"] = Field(
        default="linear", description="Projection from the trunk's features to the joint embedding: OpenCLIP's "
                                      "'linear' or 'mlp', 'head' (the trunk's classifier, resized to embed_dim) or "
                                      "'none' (the trunk's features as they are).")
    proj_bias: bool = Field(default=False, description="Give the projection a bias.")
    drop_path: Optional[float] = Field(default=None, ge=0.0, lt=1.0, description="Stochastic depth rate of the trunk.")

    @model_validator(mode="after")
    def _one_source(self) -> "TimmTowerSpec":
        if (self.name is None) == (self.path is None):
            raise ValueError("give exactly one of `name` (a timm architecture) or `path` (a local timm directory)")
        if self.pretrained is True and self.path is None:
            raise ValueError("`pretrained: true` loads the weights in `path`; with `name`, give a local weights file")
        return self

    @field_validator("name")
    @classmethod
    def _no_hub(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and (":" in value or "/" in value):
            raise ValueError("a timm architecture name, not a hub id or a path (a local directory goes in `path`; "
                             "nothing is downloaded)")
        return value


class TimmFamily(TowerFamily):
    name, tower, spec = "timm", "image", TimmTowerSpec
    description = "Replace the image tower with a timm model (with OpenCLIP's pooling and projection)."
    block_classes = ("Block", "EvaBlock", "EvaBlockPostNorm", "ResPostBlock", "ConvNeXtBlock", "MbConvBlock",
                     "MaxxVitBlock", "SwinTransformerBlock")

    def config(self, spec: TimmTowerSpec) -> dict:
        """OpenCLIP's vision_cfg for the trunk, at the image size the trunk was built for."""
        import torch

        from fsdpclip.model.towers import check_timm_name, create_timm, timm_image_size

        location = "model.image.timm.path" if spec.path else "model.image.timm.name"
        name = check_timm_name(f"local-dir:{spec.path}" if spec.path else spec.name or "", location)  # one given
        with torch.device("meta"):
            trunk = create_timm(name, location)
        cfg = {"timm_model_name": name, "timm_model_pretrained": False, "timm_pool": spec.pool,
               "timm_proj": None if spec.proj == "head" else spec.proj, "timm_proj_bias": spec.proj_bias,
               "image_size": timm_image_size(trunk)}
        if spec.drop_path is not None:
            cfg["timm_drop_path"] = spec.drop_path
        return cfg

    def load_weights(self, spec: TimmTowerSpec, model) -> None:
        from fsdpclip.model.weights import load_weights

        if spec.pretrained:
            state, file = trunk_state(spec, model.visual.trunk)
            load_weights(model, state, file, module="visual.trunk")

    def check(self, spec: TimmTowerSpec, report: Report, check_paths: bool) -> None:
        from fsdpclip.run.files import special_file

        location = "model.image.timm.pretrained"
        if not check_paths or spec.pretrained is False:
            return
        if isinstance(spec.pretrained, str):
            if not Path(spec.pretrained).exists():
                report.missing(location, "file not found", spec.pretrained)
            elif kind := special_file(Path(spec.pretrained)):
                report.error(location, f"not a regular file but {kind}", spec.pretrained)
        elif spec.path and not any((Path(spec.path) / f).is_file() for f in WEIGHT_FILES):
            report.error(location, f"no weights in {spec.path}", True,
                         hint=f"expected one of {', '.join(WEIGHT_FILES)}")

    def paths(self, spec: TimmTowerSpec) -> tuple[str, ...]:
        return ("path", "pretrained")

    def label(self, spec: TimmTowerSpec) -> str:
        return Path(spec.path).name if spec.path else spec.name or ""  # one given (validated)


def trunk_state(spec: TimmTowerSpec, trunk: Any) -> tuple[dict, str]:  # a timm model
    """(state, file) of a timm tower's local weights, without the classifier OpenCLIP's head replaces."""
    from fsdpclip.model.weights import read_state_dict

    if isinstance(spec.pretrained, str):
        file = spec.pretrained
    else:
        assert spec.path is not None  # pretrained true: the weights in `path` (validated)
        file = next((str(Path(spec.path) / f) for f in WEIGHT_FILES if (Path(spec.path) / f).is_file()), None)
        if file is None:
            raise ModelError(f"{spec.path} holds none of {', '.join(WEIGHT_FILES)}", "model.image.timm.pretrained",
                             True)
    classifier = trunk.pretrained_cfg.get("classifier") or ()
    prefixes = tuple(f"{c}." for c in ((classifier,) if isinstance(classifier, str) else classifier))
    own = trunk.state_dict()
    return {k: v for k, v in read_state_dict(file).items() if k in own or not k.startswith(prefixes)}, file


TOWER_FAMILIES.register(TimmFamily())
