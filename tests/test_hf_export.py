"""`fsdpclip export RUN OUT --format hf`: a transformers `CLIPModel` directory that gives OpenCLIP's embeddings, its
image processor and tokenizer, and the architectures refused (one line naming the config key)."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import torch

from conftest import TINY_CONFIG, squeezed, synthetic_job, write_job
from ranks import run_group

pytestmark = pytest.mark.slow  # each test builds models and imports transformers
TINY = json.loads(TINY_CONFIG.read_text())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny model trained 4 steps on one CPU rank, keeping a moving average of its weights: its run directory."""
    tmp = tmp_path_factory.mktemp("hf")
    job = {**synthetic_job(tmp, "tiny", gpus_per_node=1), "ema": {"decay": 0.5}}
    proc = run_group([sys.executable, "-m", "fsdpclip", "launch", str(write_job(tmp, job))], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return tmp / "runs" / "tiny"


def _same_embeddings(open_clip_model, hf_model, image_size: int, context_length: int, tokens=None) -> None:
    """Image and text embeddings (projected, not normalised) of both models within 1e-4 on the same inputs."""
    torch.manual_seed(0)
    images = torch.randn(3, 3, image_size, image_size)
    if tokens is None:
        tokens = torch.randint(1, 49406, (4, context_length))
        tokens[:, 0], tokens[torch.arange(4), torch.tensor([3, 7, context_length - 1, 1])] = 49406, 49407
    open_clip_model.eval()
    with torch.no_grad():
        image, text = open_clip_model.encode_image(images), open_clip_model.encode_text(tokens)
        assert image.abs().max() > 1e-2 and text.abs().max() > 1e-2
        assert (hf_model.get_image_features(pixel_values=images).pooler_output - image).abs().max() < 1e-4
        assert (hf_model.get_text_features(input_ids=tokens).pooler_output - text).abs().max() < 1e-4


def test_a_trained_run_loads_as_clip_model(tiny_run, tmp_path, cli):
    """The run's export loads strictly by the Python line it prints (CLIPModel and CLIPProcessor): its embeddings are
    those of OpenCLIP's model from the run's open_clip export, its tokenizer gives OpenCLIP's token ids, its image
    processor resizes, crops and normalises as OpenCLIP's preprocessing (within one 8-bit level). Exporting again
    keeps the files unless given --force."""
    import open_clip
    from PIL import Image

    out = tmp_path / "hf"
    result = cli("export", tiny_run, out, "--format", "hf")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "merges.txt", "model.safetensors", "preprocessor_config.json", "special_tokens_map.json",
        "tokenizer_config.json", "vocab.json"]
    [line] = [line.removeprefix("in Python: ") for line in result.output.splitlines() if line.startswith("in Python: ")]
    loaded = {}
    exec(line, loaded)
    hf_model, processor = loaded["model"], loaded["processor"]
    from transformers import CLIPModel

    _, info = CLIPModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info

    assert cli("export", tiny_run, tmp_path / "model.safetensors").exit_code == 0
    open_clip.add_model_config(TINY_CONFIG)
    model, _, preprocess = open_clip.create_model_and_transforms(
        TINY_CONFIG.stem, pretrained=str(tmp_path / "model.safetensors"))
    tokenizer = open_clip.get_tokenizer(TINY_CONFIG.stem)
    texts = ["a photo of the number 7.", "Two DOGS,  playing in the park!", "naïve café 123"]
    ids = tokenizer(texts)
    theirs = processor.tokenizer(texts, padding="max_length", max_length=16, return_tensors="pt").input_ids
    ends = (ids == 49407).int().argmax(dim=1)
    assert all(torch.equal(ids[i, :end + 1], theirs[i, :end + 1]) for i, end in enumerate(ends))
    _same_embeddings(model, hf_model, 32, 16, ids)
    _same_embeddings(model, hf_model, 32, 16)

    image = Image.fromarray((np.random.RandomState(0).rand(40, 52, 3) * 255).astype("uint8"))
    pixels = processor(images=image, return_tensors="pt").pixel_values
    std = torch.tensor(preprocess.transforms[-1].std).reshape(3, 1, 1)
    assert ((pixels[0] - preprocess(image)) * std).abs().max() <= 1.5 / 255

    again = cli("export", tiny_run, out, "--format", "hf")
    assert again.exit_code == 2 and "exists" in again.output and "--force" in again.output
    assert cli("export", tiny_run, out, "--format", "hf", "--force").exit_code == 0


def test_the_moving_average_exports_as_clip_model(tiny_run, tmp_path, cli):
    """`export --format hf --ema`: a CLIPModel of the run's moving average, which gives the embeddings of OpenCLIP's
    model from `export --ema`, and another model than the weights trained."""
    import open_clip
    from safetensors.torch import load_file
    from transformers import CLIPModel

    result = cli("export", tiny_run, tmp_path / "hf", "--format", "hf", "--ema")
    assert result.exit_code == 0, result.output
    assert squeezed("(step 4, its moving average) →") in squeezed(result.output)
    assert cli("export", tiny_run, tmp_path / "trained", "--format", "hf").exit_code == 0
    assert cli("export", tiny_run, tmp_path / "ema.safetensors", "--ema").exit_code == 0
    open_clip.add_model_config(TINY_CONFIG)
    model = open_clip.create_model(TINY_CONFIG.stem, pretrained=str(tmp_path / "ema.safetensors"))
    _same_embeddings(model, CLIPModel.from_pretrained(tmp_path / "hf"), 32, 16)
    averaged, trained = (load_file(tmp_path / name / "model.safetensors") for name in ("hf", "trained"))
    assert averaged.keys() == trained.keys()
    assert not torch.equal(averaged["vision_model.embeddings.patch_embedding.weight"],
                           trained["vision_model.embeddings.patch_embedding.weight"])


@pytest.mark.parametrize("mode", ["squash", "longest"])
def test_the_image_processor_resizes_as_open_clip(mode):
    """OpenCLIP's 'squash' (both sides resized, bilinear here) as CLIPImageProcessor's height and width without a crop,
    within one 8-bit level; 'longest' pads, which CLIPImageProcessor cannot: no config."""
    from dataclasses import asdict

    from open_clip.transform import PreprocessCfg, image_transform_v2
    from PIL import Image
    from transformers import CLIPImageProcessor

    from fsdpclip.interop.hf_clip import image_processor_config, preprocess_refusal

    preprocess = PreprocessCfg(size=32, resize_mode=mode, interpolation="bilinear")
    if mode == "longest":
        assert preprocess_refusal(asdict(preprocess)) == "OpenCLIP's resize_mode 'longest' (which pads to a square)"
        return
    config = image_processor_config(asdict(preprocess))
    image = Image.fromarray((np.random.RandomState(1).rand(40, 52, 3) * 255).astype("uint8"))
    pixels = CLIPImageProcessor.from_dict(config)(images=image, return_tensors="pt").pixel_values[0]
    std = torch.tensor(preprocess.std).reshape(3, 1, 1)
    assert ((pixels - image_transform_v2(preprocess, is_train=False)(image)) * std).abs().max() <= 1.5 / 255


@pytest.mark.parametrize("variant", [
    {"quick_gelu": True}, {"custom_text": True},
    {"vision_cfg": {**TINY["vision_cfg"], "mlp_ratio": 2.0, "head_width": 16, "norm_kwargs": {"eps": 1e-6},
                    "final_ln_after_pool": True},
     "text_cfg": {**TINY["text_cfg"], "mlp_ratio": 3.0, "norm_kwargs": {"eps": 1e-6}}}],
    ids=["quick-gelu", "custom-text", "widths-and-eps"])
def test_layouts_that_map(variant, tmp_path):
    """OpenCLIP's options that CLIPModel holds: QuickGELU, the text tower under `text.` (CustomTextCLIP), MLP
    widths, head widths, LayerNorm eps."""
    from transformers import CLIPModel

    from fsdpclip.interop.hf_clip import hf_files, hf_refusal, write_hf
    from fsdpclip.model.build import model_from_config

    config = TINY | variant
    assert hf_refusal(config) is None
    torch.manual_seed(1)
    model = model_from_config(config, device="cpu")
    write_hf(tmp_path, model.state_dict(), config, hf_files(config, model.visual.preprocess_cfg)[0])
    hf_model = CLIPModel.from_pretrained(tmp_path)
    assert hf_model.config.text_config.hidden_act == ("quick_gelu" if config.get("quick_gelu") else "gelu")
    _same_embeddings(model, hf_model, 32, 16)


def test_vit_b_32_maps(tmp_path):
    """ViT-B-32's architecture with random weights (built here, nothing downloaded), written with its own
    preprocessing and tokenizer: CLIPModel gives its embeddings."""
    import open_clip
    from transformers import CLIPModel, CLIPProcessor

    from fsdpclip.interop.hf_clip import hf_files, write_hf

    torch.manual_seed(2)
    model = open_clip.create_model("ViT-B-32")
    config = open_clip.get_model_config("ViT-B-32")
    files, notes = hf_files(config, model.visual.preprocess_cfg)
    assert not notes
    write_hf(tmp_path, model.state_dict(), config, files)
    _same_embeddings(model, CLIPModel.from_pretrained(tmp_path), 224, 77)
    processor = CLIPProcessor.from_pretrained(tmp_path)
    assert processor.image_processor.crop_size == {"height": 224, "width": 224}
    assert processor.tokenizer.model_max_length == 77


@pytest.mark.parametrize("variant, refusal", [
    ({"init_logit_bias": -10.0}, "init_logit_bias (a logit bias (SigLIP's)"),
    ({"multimodal_cfg": {"width": 64}}, "multimodal_cfg (CoCa's captioning decoder)"),
    ({"vision_cfg": {"timm_model_name": "vit_base_patch16_224"}}, "vision_cfg.timm_model_name (a timm image tower)"),
    ({"text_cfg": {"hf_model_name": "bert-base-uncased"}}, "text_cfg.hf_model_name (a Hugging Face text tower)"),
    ({"vision_cfg": {**TINY["vision_cfg"], "attentional_pool": True}},
     "vision_cfg.attentional_pool (attentional pooling)"),
    ({"vision_cfg": {**TINY["vision_cfg"], "ls_init_value": 1e-5}}, "vision_cfg.ls_init_value (layer scale)"),
    ({"text_cfg": {**TINY["text_cfg"], "proj_bias": True}}, "text_cfg.proj_bias (a bias in the text projection"),
    ({"text_cfg": {**TINY["text_cfg"], "pool_type": "last"}}, "text_cfg.pool_type (pooling other than CLIP's"),
    ({"vision_cfg": {"layers": [3, 4, 6, 3], "width": 64}}, "vision_cfg.layers (a ResNet image tower)"),
    ({"vision_cfg": {**TINY["vision_cfg"], "image_size": [32, 64]}}, "vision_cfg.image_size (not square"),
], ids=["siglip", "coca", "timm", "hf-text", "attentional-pool", "layer-scale", "proj-bias", "pool-last", "resnet",
        "not-square"])
def test_layouts_that_do_not_map_are_named(variant, refusal):
    from fsdpclip.interop.hf_clip import hf_refusal

    assert hf_refusal(TINY | variant).startswith(refusal)


def _edited(run_dir, tmp_path, edit):
    """A copy of the run whose checkpoints' saved model config is edited by `edit`."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for meta_file in copy.glob("checkpoints/step-*/meta.json"):
        meta = json.loads(meta_file.read_text())
        edit(meta["model"]["open_clip_config"])
        meta_file.write_text(json.dumps(meta))
    return copy


def test_a_refused_export_is_one_line_and_writes_nothing(tiny_run, tmp_path, cli):
    """A checkpoint of a model CLIPModel cannot hold (its saved config given SigLIP's logit bias here): exit 2, one
    line naming the checkpoint and the config key, nothing written; a weights file as OUT is refused too."""
    run = _edited(tiny_run, tmp_path, lambda config: config.update(init_logit_bias=-10.0))
    result = cli("export", run, tmp_path / "hf", "--format", "hf")
    assert result.exit_code == 2 and "Traceback" not in result.output
    [line] = result.output.strip().splitlines()
    assert "as a transformers CLIPModel: model config init_logit_bias (a logit bias (SigLIP's)" in line
    assert "step-00000004" in line and not (tmp_path / "hf").exists()
    weights_file = cli("export", tiny_run, tmp_path / "model.pt", "--format", "hf")
    assert weights_file.exit_code == 2 and "--format hf writes a directory" in weights_file.output


def test_what_the_export_cannot_write_is_said(tiny_run, tmp_path, cli):
    """A model of another tokenizer (OpenCLIP's SimpleTokenizer with other options here) and preprocessing that pads:
    the CLIPModel is written, without tokenizer files and the image processor's config, a line saying why each."""
    def edit(config):
        config["text_cfg"]["tokenizer_kwargs"] = {"clean": "canonicalize"}
        config["preprocess_cfg"]["resize_mode"] = "longest"

    result = cli("export", _edited(tiny_run, tmp_path, edit), tmp_path / "hf", "--format", "hf")
    assert result.exit_code == 0, result.output
    assert "no tokenizer files: text_cfg.tokenizer_kwargs makes a tokenizer other than OpenCLIP's default" in \
        result.output
    assert "no preprocessor_config.json: CLIPImageProcessor cannot do OpenCLIP's resize_mode 'longest'" in result.output
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
