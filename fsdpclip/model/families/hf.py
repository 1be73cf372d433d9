"""The Hugging Face tower family: a text tower from a local transformers encoder directory (`model.text.hf`).

T5/mT5 encoders, BERT, RoBERTa, XLM-R through OpenCLIP's HFTextEncoder; hub ids are never downloaded. The
spec block, its checks and its path fields load without torch; building it goes through
`fsdpclip.model.towers`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fsdpclip.jobspec.family import TOWER_FAMILIES, TowerFamily
from fsdpclip.jobspec.section import Section

if TYPE_CHECKING:
    import torch

    from fsdpclip.jobspec.problems import Report

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class HfTowerSpec(Section):
    path: str = Field(
        description="Local directory of a Hugging Face text model (T5/mT5 encoder, BERT, RoBERTa, XLM-R): its "
                    "config.json and tokenizer files (and weights when `pretrained`). Hub ids are never downloaded.")
    pretrained: bool = Field(
        default=False, description="Load the weights in `path` (save_pretrained's files); false: random init.")
    pooler: Literal["mean_pooler", "max_pooler", "cls_pooler", "cls_last_hidden_state_pooler"] = Field(
        default="mean_pooler", description="How token features become one text feature (OpenCLIP's poolers).")
    proj: Literal["mlp", "linear"] = Field(
        default="mlp", description="Projection from the model's width to the joint embedding.")


class HfFamily(TowerFamily):
    name, tower, spec = "hf", "text", HfTowerSpec
    description = ("Replace the text tower with a Hugging Face encoder from a local directory "
                   "(needs `pip install 'fsdpclip[hf]'`).")
    block_classes = ("T5Block", "MT5Block", "BertLayer", "RobertaLayer", "XLMRobertaLayer", "CLIPEncoderLayer")
    imports = ("transformers",)

    def config(self, spec: HfTowerSpec) -> dict:
        """OpenCLIP's text_cfg for the encoder in the local directory (model and tokenizer)."""
        from fsdpclip.model.towers import check_hf_dir

        cfg = {"hf_model_name": spec.path, "hf_tokenizer_name": spec.path, "hf_model_pretrained": False,
               "hf_proj_type": spec.proj, "hf_pooler_type": spec.pooler}
        check_hf_dir(spec.path, "model.text.hf.path", from_spec=True)
        return cfg

    def load_weights(self, spec: HfTowerSpec, model) -> None:
        from fsdpclip.model.weights import load_weights

        if spec.pretrained:
            load_weights(model, encoder_state(spec), spec.path, module="text.transformer")

    def check(self, spec: HfTowerSpec, report: Report, check_paths: bool) -> None:
        if check_paths and spec.pretrained and not any((Path(spec.path) / f).is_file() for f in WEIGHT_FILES):
            report.error("model.text.hf.pretrained", f"no weights in {spec.path}", True,
                         hint=f"expected one of {', '.join(WEIGHT_FILES)}")

    def paths(self, spec: HfTowerSpec) -> tuple[str, ...]:
        return ("path",)

    def label(self, spec: HfTowerSpec) -> str:
        return Path(spec.path).name


def encoder_state(spec: HfTowerSpec) -> dict[str, torch.Tensor]:
    """The encoder weights in the local directory, laid out as OpenCLIP's HFTextEncoder holds them (the encoder
    of an encoder-decoder; a pooling layer only for 'cls_pooler')."""
    from transformers import AutoConfig, AutoModel

    if getattr(AutoConfig.from_pretrained(spec.path), "is_encoder_decoder", False):
        return AutoModel.from_pretrained(spec.path).encoder.state_dict()
    return AutoModel.from_pretrained(spec.path, add_pooling_layer=spec.pooler == "cls_pooler").state_dict()


TOWER_FAMILIES.register(HfFamily())
