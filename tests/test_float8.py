"""fsdp.float8: the spec, where 'auto' leaves it, which layers it picks, the swap for torchao's Float8Linear (its GEMMs
emulated on the CPU) with FSDP2, and its refusals by validate, launch and the ranks."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from conftest import synthetic_job, write_job
from ranks import REPO, json_result, run_group, torchrun_command

from fsdpclip.model.build import build_model, find_towers, model_config
from fsdpclip.model.trainable import frozen_meta_model
from fsdpclip.model.float8 import float8_linears, gains_from_float8
from fsdpclip.plan.resolved import Node, plan_for_node
from fsdpclip.jobspec.job import FsdpSpec, Job, ModelSpec

# A small CLIP whose image MLPs float8 takes with the tensorwise recipe (c_fc: 2048 × 128), its text tower too small.
SMALL = {"embed_dim": 64,
         "vision_cfg": {"image_size": 32, "layers": 2, "width": 128, "head_width": 32, "patch_size": 8,
                        "mlp_ratio": 16},
         "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2}}
# One image block wide enough for both recipes (c_fc: 4160 × 1040, c_proj: 1040 × 4160), built on the meta device only.
WIDE = {**SMALL, "vision_cfg": {"image_size": 32, "layers": 1, "width": 1040, "head_width": 80, "patch_size": 8}}


def _config(tmp_path, config: dict, name: str = "model.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def _mlps(prefix: str, blocks, *layers: str) -> set[str]:
    return {f"{prefix}.resblocks.{i}.mlp.{layer}" for i in blocks for layer in layers}


def test_the_spec_takes_auto_true_false_and_a_recipe():
    assert (FsdpSpec().float8, FsdpSpec().float8_recipe) == ("auto", "tensorwise")
    assert FsdpSpec(float8=True, float8_recipe="rowwise").float8_recipe == "rowwise"
    for bad in ({"float8": "yes"}, {"float8": 1}, {"float8_recipe": "rowwise_with_gw_hp"}):
        with pytest.raises(ValueError):
            FsdpSpec(**bad)


@pytest.mark.parametrize("float8, planned", [("auto", False), (True, True), (False, False)])
def test_auto_leaves_float8_off_until_measured(float8, planned):
    """The run plan settles 'auto' to off on GPUs as on the CPU; what the spec sets stays. Evaluation's layout (the
    trained spec's units, `unit_layout`) never runs in float8."""
    from fsdpclip.plan.resolved import unit_layout

    job = Job(**{"model": {"name": "ViT-L-14"}, "data": {"source": "synthetic"}, "batch": {"per_gpu": 128},
                 "fsdp": {"float8": float8}})
    model, towers = frozen_meta_model(model_config(job.model), job)
    for device in ("cuda", "cpu"):
        assert plan_for_node(job, model, towers, Node(1, 1, device)).layout.float8 is planned
    assert unit_layout(job.fsdp, model, towers, "cuda").float8 is False


def test_the_shape_rule_is_torchaos_for_each_recipe():
    """Dims multiples of 16, and not below the sizes torchao's H100 microbenchmarks found slower in float8."""
    assert gains_from_float8(4096, 1024, "tensorwise") and not gains_from_float8(1024, 4096, "tensorwise")
    assert gains_from_float8(1024, 4112, "tensorwise") and gains_from_float8(1040, 16, "tensorwise")
    assert not gains_from_float8(4104, 1024, "tensorwise")  # 4104 is no multiple of 16
    assert gains_from_float8(4112, 1040, "rowwise") and not gains_from_float8(4096, 1040, "rowwise")
    assert not gains_from_float8(8192, 1024, "rowwise") and not gains_from_float8(2048, 8192, "rowwise")
    assert gains_from_float8(4096, 2064, "rowwise")


def test_vit_l_14_gets_its_mlp_up_projections_in_float8():
    """ViT-L-14 (image: 24 blocks of width 1024, MLP 4096; text: 12 of width 768, MLP 3072), on the meta device:
    tensorwise takes each MLP's c_fc (N 4096 or 3072 > 1024), not c_proj (K ≤ 4096, N ≤ 1024); attention's
    out-projection (a subclass of nn.Linear), the projections and the patch embedding never; rowwise takes none
    (K ≤ 1024 or N ≤ 2048 everywhere)."""
    model = build_model(ModelSpec(name="ViT-L-14"))
    towers = find_towers(model)
    chosen = float8_linears(model, towers, "tensorwise")
    assert len(chosen) == 36
    assert set(chosen) == _mlps("visual.transformer", range(24), "c_fc") | _mlps("transformer", range(12), "c_fc")
    assert float8_linears(model, towers, "rowwise") == []


def test_vit_bigg_14_gets_both_mlp_layers_in_float8_and_frozen_blocks_stay():
    """ViT-bigG-14 (image: 48 blocks, width 1664, MLP 8192; text: 32, width 1280, MLP 5120): tensorwise takes
    c_fc and c_proj of every block (160 layers), rowwise only c_fc (N > 4096, K > 1024); frozen blocks keep theirs."""
    model = build_model(ModelSpec(name="ViT-bigG-14"))
    towers = find_towers(model)
    both = _mlps("visual.transformer", range(48), "c_fc", "c_proj") | _mlps("transformer", range(32), "c_fc", "c_proj")
    assert len(both) == 160 and set(float8_linears(model, towers, "tensorwise")) == both
    assert set(float8_linears(model, towers, "rowwise")) == {n for n in both if n.endswith("c_fc")}
    job = Job(**{"model": {"name": "ViT-bigG-14"}, "data": {"source": "synthetic"}, "batch": {"per_gpu": 32},
                 "freeze": {"image": {"blocks": "0:40"}}})
    frozen, towers = frozen_meta_model(model_config(job.model), job)
    assert set(float8_linears(frozen, towers, "tensorwise")) == both - _mlps("visual.transformer", range(40),
                                                                             "c_fc", "c_proj")


def test_a_custom_blocks_attention_out_projection_is_taken_too(tmp_path):
    """OpenCLIP's CustomResidualAttentionBlock calls its attention's out-projection (a plain nn.Linear) as a module:
    it runs in float8 beside the MLP where its size gains (1040 × 1040: N > 1024); the in-projection, a bare
    parameter, never."""
    wide = {**WIDE, "vision_cfg": {**WIDE["vision_cfg"], "block_type": "custom"}}
    model = build_model(ModelSpec(config=str(_config(tmp_path, wide))))
    block = "visual.transformer.resblocks.0"
    assert type(model.get_submodule(block)).__name__ == "CustomResidualAttentionBlock"
    assert float8_linears(model, find_towers(model), "tensorwise") == [f"{block}.attn.out_proj", f"{block}.mlp.c_fc",
                                                                      f"{block}.mlp.c_proj"]


def test_a_small_model_gets_none():
    """The tiny demo model's layers (width 64) are all below the sizes where float8 gains."""
    from conftest import TINY_CONFIG

    model = build_model(ModelSpec(config=str(TINY_CONFIG)))
    assert float8_linears(model, find_towers(model), "tensorwise") == []


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_swapped_layers_train_in_float8_under_the_same_names(recipe, tmp_path):
    """torchao's Float8Linear in place of the chosen layers (GEMMs emulated on the CPU): the same state-dict names,
    outputs near bf16's but not equal (float8's rounding), gradients in every trained weight."""
    pytest.importorskip("torchao")
    from fsdpclip.model.build import model_from_config
    from fsdpclip.model.float8 import convert_to_float8

    config = model_config(ModelSpec(config=str(_config(tmp_path, SMALL))))
    torch.manual_seed(0)
    reference = model_from_config(config, device="cpu").to(torch.bfloat16)
    model = copy.deepcopy(reference)
    names = _mlps("visual.transformer", range(2), "c_fc")  # both recipes run them, whatever their size
    convert_to_float8(model, sorted(names), recipe, gather_in_float8=False, emulate=True)
    assert {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"} == names
    assert list(model.state_dict()) == list(reference.state_dict())
    images, texts = torch.randn(4, 3, 32, 32, dtype=torch.bfloat16), torch.randint(1, 1000, (4, 16))
    got, expected = model.encode_image(images), reference.encode_image(images)
    assert not torch.equal(got, expected)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0.1, atol=0.1)
    image, text, scale = model(images, texts)[:3]
    (image.float() @ text.float().T * scale).logsumexp(1).mean().backward()
    for name in names:
        grad = model.get_submodule(name).weight.grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_a_checkpoints_float8_weights_are_saved_as_plain_tensors_and_their_scales_can_be_dropped(tmp_path):
    """Weights gathered in float8 are torchao's wrappers: the state a checkpoint writes holds the plain tensors
    they wrap (the same storage), which a machine without torchao loads; the scales
    precomputed from the weights are dropped on request."""
    pytest.importorskip("torchao")
    from fsdpclip.model.float8 import convert_to_float8, forget_float8_scales, without_float8_wrappers

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    convert_to_float8(model, ["0"], "tensorwise", gather_in_float8=True, emulate=True)
    wrapped = model[0].weight
    assert type(wrapped).__name__ == "WeightWithDynamicFloat8CastTensor"
    state = without_float8_wrappers({"model": model.state_dict(), "step": 3})
    assert {type(t) for t in state["model"].values()} == {torch.Tensor} and state["step"] == 3
    assert state["model"]["0.weight"].data_ptr() == wrapped._tensor.data_ptr()
    torch.save(model.state_dict(), tmp_path / "wrapped.pt")
    torch.save(state, tmp_path / "plain.pt")
    load = ("import sys\nsys.modules['torchao'] = None  # a machine without torchao\nimport torch\n"
            "print(torch.load(sys.argv[1], weights_only=True)['model']['0.weight'].sum().item())")
    without_torchao = [subprocess.run([sys.executable, "-c", load, str(tmp_path / name)], capture_output=True,
                                      text=True, timeout=120) for name in ("wrapped.pt", "plain.pt")]
    assert "WeightWithDynamicFloat8CastTensor" in without_torchao[0].stderr
    assert without_torchao[1].returncode == 0, without_torchao[1].stderr
    assert float(without_torchao[1].stdout) == pytest.approx(wrapped._tensor.sum().item())
    wrapped._precomputed_scale = torch.tensor(2.0)
    forget_float8_scales(model)
    assert wrapped._precomputed_scale is None


@pytest.mark.slow
def test_parallelize_swaps_the_layers_and_gathers_tensorwise_weights_in_float8(tmp_path):
    """On the meta device over a fake process group of 2: tensorwise swaps c_fc and c_proj of the wide block and
    FSDP gathers their weights in float8; rowwise swaps c_fc alone, scaled per row, gathers in bf16, and its
    compiled blocks round casts as eager does (the spec's other inductor options kept)."""
    pytest.importorskip("torchao")
    result = json_result([sys.executable, str(REPO / "tests/workers/float8.py"), "parallelize",
                          str(_config(tmp_path, WIDE))], timeout=300)
    block = "visual.transformer.resblocks.0.mlp"
    assert result["tensorwise"]["float8"] == {f"{block}.c_fc": "tensorwise", f"{block}.c_proj": "tensorwise"}
    assert result["tensorwise"]["gathered"] == [f"{block}.c_fc.weight", f"{block}.c_proj.weight"]
    assert result["rowwise"]["float8"] == {f"{block}.c_fc": "axiswise"} and result["rowwise"]["gathered"] == []
    assert result["tensorwise"]["compiled"] and all(o == {"max_autotune": False}
                                                    for o in result["tensorwise"]["compiled"])
    assert result["rowwise"]["compiled"] and all(o == {"emulate_precision_casts": True, "max_autotune": False}
                                                 for o in result["rowwise"]["compiled"])


def test_the_moving_average_follows_float8_shards_that_fsdp_gives_new_storage():
    """A weight gathered in float8 and sharded unevenly gets new storage when a state dict is loaded (FSDP2 keeps
    the padded storage of plain tensors only): the average still reads the weights as they are, and an evaluation
    of it writes the averages where the forward reads them."""
    pytest.importorskip("torchao")
    result = json_result([sys.executable, str(REPO / "tests/workers/float8.py"), "ema"], timeout=300)
    assert result["storage_moved"] == ["0.weight"] and result["uneven"] == [12, 32]  # rank 2: 40 rows → 14, 14, 12
    assert result["equal_to_weights"] == [True, False]  # the first update copies, the next one averages
    assert result["swapped_in"] is True


@pytest.mark.slow
def test_a_float8_run_trains_as_bf16_does_and_its_checkpoints_resume_either_way(tmp_path):
    """2 CPU ranks, the real Trainer: float8 (tensorwise, weights gathered in float8, their scales precomputed after
    each step) follows the bf16 run's losses from the same weights and batches, within float8's rounding; its
    checkpoint resumes in float8 and then, saved again, without."""
    pytest.importorskip("torchao")
    command = torchrun_command(["tests/workers/float8.py", "train", str(tmp_path / "runs"),
                                str(_config(tmp_path, SMALL))])
    result = json_result(command, timeout=600)
    layers = _mlps("visual.transformer", range(2), "c_fc")
    assert result["layers"] == {name: {"local": "WeightWithDynamicFloat8CastTensor", "precomputed": True}
                                for name in layers}
    assert result["precomputing"] is True
    bf16, float8 = result["losses_False"], result["losses_True"]
    assert bf16 != float8
    torch.testing.assert_close(float8, bf16, rtol=0.02, atol=0)
    assert (result["resumed_True"]["at"], result["resumed_True"]["layers"]) == (4, 2)
    assert (result["resumed_False"]["at"], result["resumed_False"]["layers"]) == (6, 0)
    for resumed in (result["resumed_True"], result["resumed_False"]):
        assert len(resumed["losses"]) == 2 and all(0 < loss < 10 for loss in resumed["losses"])
    written = sorted((tmp_path / "runs" / "float8-True").rglob(".metadata"))
    assert written and not [path for path in written if b"torchao" in path.read_bytes()]  # loads without torchao


def _float8_job(tmp_path, **fsdp) -> dict:
    job = synthetic_job(tmp_path)
    job["fsdp"] = {"float8": True, **fsdp}
    return job


def _errors_at(out: dict, location: str) -> list[dict]:
    return [e for e in out["errors"] if e["location"] == location]


def test_validate_refuses_float8_on_the_cpu_and_without_bf16(cli, tmp_path):
    """A CPU job and fp32 parameters: one row each at fsdp.float8, in the same round."""
    code, out = cli.validate_json(write_job(tmp_path, _float8_job(tmp_path, param_dtype="fp32")))
    assert code == 2
    messages = [e["message"] for e in _errors_at(out, "fsdp.float8")]
    assert len(messages) == 2 and "CUDA" in messages[0] and "bf16" in messages[1], out["errors"]


def test_validate_names_the_extra_where_torchao_is_missing(cli, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "torchao" else find_spec(name, *args))
    job = _float8_job(tmp_path)
    job["launch"]["device"] = "cuda"
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert code == 2
    (error,) = _errors_at(out, "fsdp.float8")
    assert "torchao" in error["message"] and error["hint"] == "pip install 'fsdpclip[float8]'", error


def test_validate_passes_float8_auto_and_true_on_gpus_and_shows_the_plans(cli, tmp_path):
    pytest.importorskip("torchao")
    for float8 in ("auto", True):
        job = _float8_job(tmp_path, float8=float8)
        job["launch"]["device"] = "cuda"
        code, out = cli.validate_json(write_job(tmp_path, job), "--no-check-paths")
        assert code == 0, out["errors"]
        assert out["summary"]["plan"]["layout"]["float8"] is (float8 is True)
        shown = cli("validate", write_job(tmp_path, job), "--no-check-paths")
        assert f"float8 {float8 is True}," in " ".join(shown.stdout.split()), shown.stdout


@pytest.mark.parametrize("capabilities, refused", [([(8, 0)], True), ([(9, 0), (8, 6)], True), ([(9, 0)], False),
                                                   ([(8, 9)], False), (None, False)])
def test_the_node_check_refuses_float8_on_gpus_before_ada(capabilities, refused, tmp_path, monkeypatch):
    """This node's GPUs as NVML tells them (`validate.preflight`): a problem at fsdp.float8 where one of them has no
    float8 GEMMs; none where NVML cannot tell (the ranks check their device), nor for float8 'auto'."""
    from fsdpclip.validate import preflight

    monkeypatch.setattr(preflight, "visible_gpus", lambda: (1, "NVML sees 1"))
    monkeypatch.setattr(preflight, "nvml_compute_capabilities", lambda: capabilities)
    for float8 in (True, "auto"):
        job = _float8_job(tmp_path, float8=float8)
        job["launch"].update(device="cuda", gpus_per_node=1)
        problems = [p for p in preflight.preflight(Job(**job)).problems if p.location == "fsdp.float8"]
        assert len(problems) == (refused and float8 is True), problems
        if problems:
            assert "compute capability 8.9 or later" in problems[0].message, problems[0]


def test_launch_shows_the_nodes_float8_row(cli, tmp_path, monkeypatch):
    """On a node of GPUs before Ada, `launch` stops at its checks with the row, starting nothing."""
    pytest.importorskip("torchao")
    from fsdpclip.validate import preflight

    monkeypatch.setattr(preflight, "visible_gpus", lambda: (1, "NVML sees 1"))
    monkeypatch.setattr(preflight, "nvml_compute_capabilities", lambda: [(8, 0)])
    job = _float8_job(tmp_path)
    job["launch"].update(device="cuda", gpus_per_node=1)
    result = cli("launch", write_job(tmp_path, job))
    assert result.exit_code == 2, result.output
    assert "fsdp.float8" in result.output and "this node's GPU has 8.0" in " ".join(result.output.split()), \
        result.output
    assert not (tmp_path / "runs" / "t").exists()


def test_a_rank_without_float8_gemms_is_told_why():
    """What the ranks check of their own device before building (`train.building`)."""
    from fsdpclip.model.float8 import capability_problem, float8_problem

    pytest.importorskip("torchao")
    assert "CUDA GPU" in float8_problem(torch.device("cpu"))
    assert capability_problem("NVIDIA A100", (8, 0)) == \
        "float8 GEMMs need compute capability 8.9 or later (Ada, Hopper); NVIDIA A100 has 8.0"


@pytest.mark.slow
def test_a_cpu_trainer_refuses_float8_true(tmp_path):
    """Started without `fsdpclip validate` (which refuses it first), the rank stops before building anything, with
    the spec's exit code and one line."""
    from fsdpclip.run.directory import EXIT_SPEC

    job = _float8_job(tmp_path)
    result = run_group([sys.executable, "-m", "fsdpclip.launch.entry", str(write_job(tmp_path, job))], timeout=120)
    assert result.returncode == EXIT_SPEC, result.stdout[-2000:]
    assert "fsdp.float8 true: float8 GEMMs need a CUDA GPU" in result.stdout
    assert "Traceback" not in result.stdout

