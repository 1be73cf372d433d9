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


def uncapturable_modules(model: nn.Module) -> list[str]:
    """Names of the modules whose training forward needs the host mid-step, which a CUDA graph cannot
    capture: OpenCLIP's patch dropout (its kept patches are drawn on the host, then indexed on the device)."""
    return [name for name, module in model.named_modules()
            if type(module).__name__ == "PatchDropout" and getattr(module, "prob", 0) > 0]


def keep_nccl_capturable(cuda_graph: Union[bool, str], environ: MutableMapping[str, str]) -> None:
    """Set NCCL_GRAPH_REGISTER=0 where a step may be graphed and the allocator uses expandable segments:
    NCCL registers the buffers of captured collectives as if each were one contiguous allocation, which
    expandable segments break (hangs: pytorch#158029; Megatron-LM refuses the combination below
    Blackwell). 'auto' graphs only a world of one (plan.resolved.plan_for_node). Called before the process
    group forms; a value the user set stays."""
    conf = f"{environ.get('PYTORCH_CUDA_ALLOC_CONF', '')},{environ.get('PYTORCH_ALLOC_CONF', '')}"
    graphed = cuda_graph is True or (cuda_graph == "auto" and environ.get("WORLD_SIZE", "1") == "1")
    if graphed and "expandable_segments:true" in conf.replace(" ", "").lower():
        environ.setdefault("NCCL_GRAPH_REGISTER", "0")


class GraphedForwardBackward:
    """`forward_backward(batches) -> loss` (fsdpclip.train.loss.backward_micro_batches over the model) run
    eagerly once, then captured as one CUDA graph and replayed.

    The first call runs on the side stream the capture will use (FSDP's lazy set-up, compilation, NCCL
    communicators, autograd's per-stream state); the second captures there and replays. Later calls copy
    their batches into the captured ones, so their shapes may not change. The capture starts without
    gradients, as an eager step after `zero_grad(set_to_none=True)` does: at every replay the graph writes
    them afresh into its own memory, where the gradient tensors made during the capture point, and those
    are put back on their parameters before each replay should anything have replaced them. The graph's
    memory stays held between steps (evaluation's comes on top). The returned loss is a copy, safe past the
    next replay. `release` drops the graph: before the process group is destroyed, NCCL waits for every
    graph holding its collectives."""

    def __init__(self, forward_backward: Callable[[Batches], torch.Tensor], parameters: list[nn.Parameter]):
        self.forward_backward, self.parameters = forward_backward, parameters
        self.stream = torch.cuda.Stream()
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.batches: Optional[Batches] = None
        self.loss: Optional[torch.Tensor] = None
        self.gradients: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.calls = self.replays = 0

    def __call__(self, batches: Batches) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            return self._on_side_stream(lambda: self.forward_backward(batches))
        if self.graph is None:
            self._capture(batches)
        else:
            self._copy_in(batches)
        for parameter, gradient in self.gradients:
            if parameter.grad is not gradient:
                parameter.grad = gradient
        assert self.graph is not None and self.loss is not None  # captured
        self.graph.replay()
        self.replays += 1
        return self.loss.clone()

    def release(self) -> None:
        """Drop the graph and what it holds, its gradients too (after the device has finished its last replay)."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
        for parameter, _ in self.gradients:
            parameter.grad = None
        self.graph, self.batches, self.loss, self.gradients = None, None, None, []

    def _copy_in(self, batches: Batches) -> None:
        assert self.batches is not None  # captured
        for captured, batch in zip(self.batches, batches, strict=True):
            for into, tensor in zip(captured, batch, strict=True):
                if into.shape != tensor.shape or into.dtype != tensor.dtype:
                    raise ValueError(f"a CUDA-graphed step takes fixed batches: captured {tuple(into.shape)} "
                                     f"{into.dtype}, given {tuple(tensor.shape)} {tensor.dtype}")
                into.copy_(tensor, non_blocking=True)

    def _on_side_stream(self, work: Callable[[], torch.Tensor]) -> torch.Tensor:
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            result = work()
        current.wait_stream(self.stream)
        return result

    def _capture(self, batches: Batches) -> None:
        for parameter in self.parameters:
            parameter.grad = None  # freed before the capture (torch.cuda.graph empties the cache first)
        self.batches = captured = [(images.clone(), texts.clone()) for images, texts in batches]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self.loss = self.forward_backward(captured)
        except Exception as exc:
            raise RuntimeError(f"CUDA-graph capture of the training step failed ({type(exc).__name__}: {exc}); "
                               "set fsdp.cuda_graph to false") from exc
        self.graph = graph
        self.gradients = [(p, p.grad) for p in self.parameters if p.grad is not None]
        log.info("CUDA graph captured: forward and backward of %d micro batch(es)", len(batches))
