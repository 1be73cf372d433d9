"""fsdp.cuda_graph: where 'auto' turns it on, and (on CUDA only) that a graphed step trains as the eager one."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from ranks import json_result, REPO, run_group

from fsdpclip.jobspec.job import ModelSpec


def test_auto_graphs_one_gpu_steps_of_open_clip_blocks_that_need_no_host():
    """cuda_graph 'auto': on for OpenCLIP's blocks on one CUDA device, whatever the units; off on CPU, on
    several GPUs (no captured collective measured yet), with CPU offload, fp16 loss scaling, activation
    checkpointing or patch dropout, and for other libraries' blocks; what the spec sets stays. A graphed
    step compiles the blocks of towers too large to compile whole, whatever their work."""
    from fsdpclip.model.build import build_model, find_towers
    from fsdpclip.parallel.parallelize import COMPILE_MIN_BLOCK_TFLOP

    b32 = build_model(ModelSpec(name="ViT-B-32"))
    towers = find_towers(b32)

    def graphed(device="cuda", towers=towers, world_size=1, model=b32, **fsdp) -> bool:
        return planned(fsdp, model, towers, device, world_size).cuda_graph

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
    small = COMPILE_MIN_BLOCK_TFLOP * 1e12 / 2 * 3 * len(big_g_towers["image"].blocks + big_g_towers["text"].blocks)
    assert planned({}, big_g, big_g_towers, "cuda", 1, small).layout.compile is True
    assert planned({"cuda_graph": False}, big_g, big_g_towers, "cuda", 1, small).layout.compile is False
    assert planned({}, big_g, big_g_towers, "cuda", 2, small).layout.compile is False
    # Without the FLOPs (counted on the ranks), compile waits for them where a graphed step does not decide it.
    assert planned({}, big_g, big_g_towers, "cuda", 1).layout.compile is True
    assert "compile" in planned({}, big_g, big_g_towers, "cuda", 2).pending


def planned(fsdp: dict, model, towers, device: str, world_size: int, flops=None):
    """The run plan of a job of `model`'s towers with `fsdp` on `world_size` ranks of `device` (one per node:
    its shard degree is the world's), 1 sample per GPU, FLOPs per sample `flops`."""
    from fsdpclip.plan.resolved import Node, plan_for_node
    from fsdpclip.jobspec.job import Job

    job = Job(**{"model": {"name": "ViT-B-32"}, "data": {"source": "synthetic"}, "batch": {"per_gpu": 1},
                 "fsdp": {"shard_degree": world_size, **fsdp}, "launch": {"device": device}})
    return plan_for_node(job, model, towers, Node(world_size, world_size, device), flops)


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
    result = run_group([sys.executable, "-m", "fsdpclip.launch.entry", str(path)], timeout=120)
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
