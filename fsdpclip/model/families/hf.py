"""The Hugging Face tower family: a text tower from a local transformers encoder directory (`model.text.hf`).

T5/mT5 encoders, BERT, RoBERTa, XLM-R through OpenCLIP's HFTextEncoder; hub ids are never downloaded. The
spec block, its checks and its path fields load without torch; building it goes through
`fsdpclip.model.towers`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fsdpclip.spec.registry import TOWER_FAMILIES, TowerFamily
from fsdpclip.spec.section import Section

if TYPE_CHECKING:
    from fsdpclip.problems import Report


class HfTowerSpec(Section):
    path: str = Field(
        description="Local directory of a Hugging Face text model (T5/mT5 encoder, BERT, RoBERTa, XLM-R): its "
                    "config.json and tokenizer files (and weights when `pretrained`). Hub ids are never downloaded.")
    pretrained: bool = Field(
        False, description="Load the weights in `path` (save_pretrained's files); false: random init.")
    pooler: Literal["mean_pooler", "max_pooler", "cls_pooler", "cls_last_hidden_state_pooler"] = Field(
        "mean_pooler", description="How token features become one text feature (OpenCLIP's poolers).")
    proj: Literal["mlp", "linear"] = Field(
        "mlp", description="Projection from the model's width to the joint embedding.")


class HfFamily(TowerFamily):
    name, tower, spec = "hf", "text", HfTowerSpec
    description = ("Replace the text tower with a Hugging Face encoder from a local directory "
                   "(needs `pip install 'fsdpclip[hf]'`).")
    block_classes = ("T5Block", "MT5Block", "BertLayer", "RobertaLayer", "XLMRobertaLayer", "CLIPEncoderLayer")
    imports = ("transformers",)

    def config(self, spec: HfTowerSpec) -> dict:
        from fsdpclip.model.towers import check_hf_dir, hf_text_cfg

        cfg = hf_text_cfg(spec)
        check_hf_dir(spec.path, "model.text.hf.path", from_spec=True)
        return cfg

    def load_weights(self, spec: HfTowerSpec, model) -> None:
        from fsdpclip.model.towers import hf_encoder_state
        from fsdpclip.model.weights import load_weights

        if spec.pretrained:
            load_weights(model, hf_encoder_state(spec), spec.path, module="text.transformer")

    def check(self, spec: HfTowerSpec, report: Report, check_paths: bool) -> None:
        from fsdpclip.model.towers import HF_WEIGHT_FILES

        if check_paths and spec.pretrained and not any((Path(spec.path) / f).is_file() for f in HF_WEIGHT_FILES):
            report.error("model.text.hf.pretrained", f"no weights in {spec.path}", True,
                         hint=f"expected one of {', '.join(HF_WEIGHT_FILES)}")

    def paths(self, spec: HfTowerSpec) -> tuple[str, ...]:
        return ("path",)

    def label(self, spec: HfTowerSpec) -> str:
        return Path(spec.path).name


TOWER_FAMILIES.register(HfFamily())
