"""fsdp.cuda_graph: where 'auto' turns it on, and (on CUDA only) that a graphed step trains as the eager one."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from ranks import json_result, REPO, run_group


def test_auto_graphs_one_gpu_steps_of_open_clip_blocks_that_need_no_host():
    """cuda_graph 'auto': on for OpenCLIP's blocks on one CUDA device, whatever the units; off on CPU, on
    several GPUs (no captured collective measured yet), with CPU offload, fp16 loss scaling, activation
    checkpointing or patch dropout, and for other libraries' blocks; what the spec sets stays. A graphed
    step compiles the blocks of towers too large to compile whole, whatever their work."""
    from fsdpclip.model.build import build_model, find_towers
    from fsdpclip.parallel.parallelize import COMPILE_MIN_BLOCK_TFLOP, resolve_auto
    from fsdpclip.spec.job import FsdpSpec, ModelSpec

    b32 = build_model(ModelSpec(name="ViT-B-32"))
    towers = find_towers(b32)

    def graphed(device="cuda", towers=towers, world_size=1, model=b32, **fsdp) -> bool:
        return resolve_auto(FsdpSpec(**fsdp), model, towers, device, world_size=world_size).cuda_graph

    assert graphed() is True
    assert graphed(compile=False, reshard_after_forward=True, unit_size=1) is True
    assert graphed("cpu") is False
    assert graphed(world_size=2) is False
    for off in ({"cpu_offload": True}, {"param_dtype": "fp16", "reduce_dtype": "fp32"},
                {"activation_checkpointing": {"image": True}}):
        assert graphed(**off) is False, off
    dropping = build_model(ModelSpec(name="ViT-B-32", image={"patch_dropout": 0.5}))
    assert graphed(model=dropping, towers=find_towers(dropping)) is False
    timm = {name: dataclasses.replace(tower, block_classes=("Block",)) for name, tower in towers.items()}
    assert graphed(towers=timm) is False
    for chosen in (True, False):
        assert graphed("cpu", world_size=2, cuda_graph=chosen) is chosen

    big_g = build_model(ModelSpec(name="ViT-bigG-14"))  # too large to compile whole
    big_g_towers = find_towers(big_g)
    small = COMPILE_MIN_BLOCK_TFLOP * 1e12 / 2
    assert resolve_auto(FsdpSpec(), big_g, big_g_towers, "cuda", small, world_size=1).compile is True
    assert resolve_auto(FsdpSpec(cuda_graph=False), big_g, big_g_towers, "cuda", small, world_size=1).compile is False
    assert resolve_auto(FsdpSpec(), big_g, big_g_towers, "cuda", small, world_size=2).compile is False
    # Without the world (validate's memory estimate), cuda_graph stays undecided and compiles nothing.
    undecided = resolve_auto(FsdpSpec(), big_g, big_g_towers, "cuda", small)
    assert (undecided.cuda_graph, undecided.compile) == ("auto", False)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("accum", [1, 2])
def test_a_graphed_step_trains_as_the_eager_step(accum, tmp_path):
    """Same weights, same batches: the losses of 8 steps and the trained parameters agree, and every step
    after the eager warm-up was a replay (the capture's step too); gradients gone wrong would show. With
    two GPUs the graph holds the collectives, and the process group is destroyed after the trainer closed."""
    gpus = min(2, torch.cuda.device_count())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               str(REPO / "tests/workers/cuda_graph.py"), str(tmp_path), str(accum)]
    result = json_result(command, timeout=600)
    assert result["replays"] == len(result["graphed"]) - 1
    torch.testing.assert_close(result["graphed"], result["eager"], rtol=1e-4, atol=1e-5)
    assert result["parameter_difference"] < 1e-4


@pytest.mark.slow
def test_a_trainer_without_cuda_refuses_cuda_graph_true(tiny_job, tmp_path):
    """Started without `fsdpclip validate` (which refuses it first), the rank stops before building anything,
    with the spec's exit code and one line, not a failure inside CUDA."""
    import json

    from fsdpclip.run.directory import EXIT_SPEC

    job = {**tiny_job, "fsdp": {**tiny_job.get("fsdp", {}), "cuda_graph": True}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    result = run_group([sys.executable, "-m", "fsdpclip.train.entry", str(path)], timeout=120)
    assert result.returncode == EXIT_SPEC, result.stdout[-2000:]
    assert "fsdp.cuda_graph true needs CUDA devices" in result.stdout
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize("cuda_graph, conf, given, expected", [
    ("auto", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, None, "0"),
    ("auto", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "WORLD_SIZE": "2"}, None, None),  # not graphed
    (True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "WORLD_SIZE": "2"}, None, "0"),
    (True, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512, expandable_segments:true"}, None, "0"),
    ("auto", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "1", "1"),  # the user's value stays
    (False, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, None, None),
    ("auto", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None, None),
    ("auto", {}, None, None),
])
def test_nccl_registration_is_off_for_graphs_on_expandable_segments(cuda_graph, conf, given, expected):
    from fsdpclip.parallel.cuda_graphs import keep_nccl_capturable

    environ = {**conf, **({"NCCL_GRAPH_REGISTER": given} if given else {})}
    keep_nccl_capturable(cuda_graph, environ)
    assert environ.get("NCCL_GRAPH_REGISTER") == expected
