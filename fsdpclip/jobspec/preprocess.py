"""OpenCLIP's preprocessing and training augmentation as the spec sets them (`data.preprocess`): read by the data
path, the model's config (`fsdpclip.model.build`), export and resume. No torch."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from fsdpclip.jobspec.section import Section

# The keys of a model config (fsdpclip.model.build.model_config) that hold its preprocessing, not the model.
PREPROCESSING_KEYS = ("preprocess_cfg", "augmentation_cfg")
Rgb = tuple[float, float, float]


class ColorJitterSpec(Section):
    prob: float = Field(
        default=0.8, gt=0, le=1, description="Chance that an image is jittered (OpenCLIP's color_jitter_prob).")
    brightness: float = Field(default=0.0, ge=0, description="Brightness factor drawn from [1 - b, 1 + b] (0: none).")
    contrast: float = Field(default=0.0, ge=0, description="Contrast factor drawn from [1 - c, 1 + c] (0: none).")
    saturation: float = Field(default=0.0, ge=0, description="Saturation factor drawn from [1 - s, 1 + s] (0: none).")
    hue: float = Field(
        default=0.0, ge=0, le=0.5, description="Hue shift drawn from [-h, h] of the colour circle (0: none).")


class PreprocessSpec(Section):
    """OpenCLIP's preprocessing (PreprocessCfg) and training augmentation (AugmentationCfg); an unset field is
    the model's own (its config's, its published tag's, OpenCLIP's defaults)."""

    mean: Optional[Rgb] = Field(
        default=None, description="Per-channel mean Normalize subtracts (RGB, of pixels in [0, 1]); default: the "
                                  "model's (e.g. 0.5 for SigLIP's published weights).")
    std: Optional[Rgb] = Field(
        default=None, description="Per-channel standard deviation Normalize divides by; default: the model's.")
    interpolation: Optional[Literal["bicubic", "bilinear"]] = Field(
        default=None, description="The evaluation resize's interpolation; default: the model's ('bicubic'). Training's "
                                  "random resized crop is bicubic whatever this says, as OpenCLIP's is.")
    resize_mode: Optional[Literal["shortest", "longest", "squash"]] = Field(
        default=None, description="How evaluation fits an image to the model's size: 'shortest' (resize the shorter "
                                  "side, centre crop), 'longest' (resize the longer side, pad), 'squash' (resize both, "
                                  "ignoring the aspect ratio); default: the model's ('shortest').")
    crop_scale: Optional[tuple[float, float]] = Field(
        default=None, description="Training's random resized crop: the range of the crop's area as a share of the "
                                  "image (OpenCLIP's default (0.9, 1.0)).")
    color_jitter: Optional[ColorJitterSpec] = Field(
        default=None, description="Random colour jitter in training (torchvision's ColorJitter); default none.")
    grayscale_prob: Optional[float] = Field(
        default=None, ge=0, le=1, description="Chance that a training image is made grayscale "
                                              "(after the jitter); default 0.")

    @model_validator(mode="after")
    def _ranges(self) -> "PreprocessSpec":
        if self.std is not None and min(self.std) <= 0:
            raise ValueError("std: every channel's standard deviation must be > 0")
        if self.crop_scale is not None and not 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1:
            raise ValueError("crop_scale: [low, high] with 0 < low ≤ high ≤ 1")
        return self

    def overrides(self) -> dict:
        """What the spec sets over the model's own: OpenCLIP's PreprocessCfg keys under 'preprocess_cfg', its
        AugmentationCfg keys under 'augmentation_cfg'."""
        jitter = self.color_jitter
        preprocess = {"mean": self.mean, "std": self.std, "interpolation": self.interpolation,
                      "resize_mode": self.resize_mode}
        augmentation = {"scale": self.crop_scale, "gray_scale_prob": self.grayscale_prob or None,
                        "color_jitter": None if jitter is None else
                        (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue),
                        "color_jitter_prob": None if jitter is None else jitter.prob}
        return {"preprocess_cfg": {k: list(v) if isinstance(v, tuple) else v for k, v in preprocess.items()
                                   if v is not None},
                "augmentation_cfg": {k: list(v) if isinstance(v, tuple) else v for k, v in augmentation.items()
                                     if v is not None}}
