"""CUDA-graph capture of a training step's forward and backward (`fsdp.cuda_graph`).

A small model's step is bound by host work: FSDP2's hooks, DTensor views per parameter, a thousand
kernel launches (docs/performance.md). Captured once as a CUDA graph, every later step replays the
same kernels and collectives with none of that Python. FSDP2's hooks run only while capturing; the
all-gather and reduce-scatter streams still overlap the computation inside the graph. What stays
outside: the data, the gradient clipping, the optimizer and the schedule (torchtitan's split).
"""

from __future__ import annotations

import logging
from typing import Callable, MutableMapping, Optional, Union

import torch
from torch import nn

log = logging.getLogger("fsdpclip")
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def keep_nccl_capturable(cuda_graph: Union[bool, str], environ: MutableMapping[str, str]) -> None:
    """Set NCCL_GRAPH_REGISTER=0 where a step may be graphed and the allocator uses expandable segments:
    NCCL registers the buffers of captured collectives as if each were one contiguous allocation, which
    expandable segments break (hangs: pytorch#158029; Megatron-LM refuses the combination below
    Blackwell). Called before the process group forms; a value the user set stays."""
    conf = f"{environ.get('PYTORCH_CUDA_ALLOC_CONF', '')},{environ.get('PYTORCH_ALLOC_CONF', '')}"
    if cuda_graph is not False and "expandable_segments:true" in conf.replace(" ", "").lower():
        environ.setdefault("NCCL_GRAPH_REGISTER", "0")


class GraphedForwardBackward:
    """`forward_backward(batches) -> loss` (fsdpclip.loss.backward_micro_batches bound to the model) run
    eagerly once, then captured as one CUDA graph and replayed.

    The first call runs on the side stream the capture will use (FSDP's lazy set-up, compilation, NCCL
    communicators, autograd's per-stream state); the second captures there and replays. Each call copies
    its batches into the captured ones, so their shapes may not change. The capture starts without
    gradients, as an eager step after `zero_grad(set_to_none=True)` does: the graph writes them afresh into
    its own memory at every replay, where the gradient tensors it made point, and the peak memory is the
    eager step's. So the caller leaves every `.grad` in place (no zeroing: it would only cost a kernel).
    The returned loss is a copy, safe past the next replay."""

    def __init__(self, forward_backward: Callable[[Batches], torch.Tensor], parameters: list[nn.Parameter]):
        self.forward_backward, self.parameters = forward_backward, parameters
        self.stream = torch.cuda.Stream()
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.batches: Optional[Batches] = None
        self.loss: Optional[torch.Tensor] = None
        self.calls = self.replays = 0

    def __call__(self, batches: Batches) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            return self._on_side_stream(lambda: self.forward_backward(batches))
        if self.graph is None:
            self._capture(batches)
        for captured, batch in zip(self.batches, batches):
            for into, tensor in zip(captured, batch):
                if into.shape != tensor.shape or into.dtype != tensor.dtype:
                    raise ValueError(f"a CUDA-graphed step takes fixed batches: captured {tuple(into.shape)} "
                                     f"{into.dtype}, given {tuple(tensor.shape)} {tensor.dtype}")
                into.copy_(tensor, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        return self.loss.clone()

    def _on_side_stream(self, work: Callable[[], torch.Tensor]) -> torch.Tensor:
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            result = work()
        current.wait_stream(self.stream)
        return result

    def _capture(self, batches: Batches) -> None:
        for parameter in self.parameters:
            parameter.grad = None
        self.batches = [tuple(t.clone() for t in batch) for batch in batches]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up's freed blocks go back: the graph's own pool holds the step
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="thread_local"):
                self.loss = self.forward_backward(self.batches)
        except Exception as exc:
            raise RuntimeError(f"CUDA-graph capture of the training step failed ({type(exc).__name__}: {exc}); "
                               "set fsdp.cuda_graph to false") from exc
        log.info("CUDA graph captured: forward and backward of %d micro batch(es)", len(batches))
