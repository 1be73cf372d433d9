"""fsdp.cuda_graph: where 'auto' turns it on, and (on CUDA only) that a graphed step trains as the eager one."""

from __future__ import annotations

import sys

import pytest
import torch

from ranks import json_result, REPO


def test_auto_captures_only_whole_compiled_towers_kept_gathered_on_cuda():
    from fsdpclip.graphs import resolve_cuda_graph
    from fsdpclip.spec import FsdpSpec

    whole = FsdpSpec(compile=True, reshard_after_forward=False)
    assert resolve_cuda_graph(whole, "cuda").cuda_graph is True
    assert resolve_cuda_graph(whole, "cpu").cuda_graph is False
    for other in ({"compile": False}, {"reshard_after_forward": True}, {"cpu_offload": True},
                  {"param_dtype": "fp16", "reduce_dtype": "fp32"}):
        assert resolve_cuda_graph(whole.model_copy(update=other), "cuda").cuda_graph is False, other
    for chosen in (True, False):  # what the spec sets stays
        assert resolve_cuda_graph(FsdpSpec(cuda_graph=chosen), "cuda").cuda_graph is chosen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("accum", [1, 2])
def test_a_graphed_step_trains_as_the_eager_step(accum, tmp_path):
    """Same weights, same batches: the losses of 8 steps and the trained parameters agree, and every step
    after the warm-up and the capture was a replay (zeroing or accumulation gone wrong would show)."""
    gpus = min(2, torch.cuda.device_count())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", str(REPO / "tests/workers/cuda_graph.py"),
               str(tmp_path), str(accum)]
    result = json_result(command, timeout=600)
    assert result["replays"] == len(result["graphed"]) - 1
    torch.testing.assert_close(result["graphed"], result["eager"], rtol=1e-4, atol=1e-5)
    assert result["parameter_difference"] < 1e-4
