"""AdamW over the weight-decay groups (and layer-wise LR scales), the LR schedule and the fp16 loss scaler."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpclip.model.trainable import DecayGroup
from fsdpclip.parallel.distributed import shard_coordinate, shard_group
from fsdpclip.jobspec.job import FsdpSpec, OptimizerSpec, ScheduleSpec


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view, no copy); a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ShardedAdamW(torch.optim.AdamW):
    """AdamW that steps each rank's local shards with the fused kernel.

    Kept instead of torch's AdamW on DTensors for a measured reason: DTensor dispatch per parameter
    made the optimizer a large part of a host-bound step (docs/performance.md). Its state
    is AdamW's own (DTensors), so checkpoints and resharding are unchanged.

    A step is skipped on the device, without a host sync, when `found_inf` is non-zero: given by
    the trainer for a non-finite gradient norm, or by `GradScaler.step` on fp16 overflow (the
    scaler hands it over as the `found_inf`/`grad_scale` attributes, since AdamW's fused kernel
    declares `_step_supports_amp_scaling`). Skipped, the weights, moments and step counts are untouched;
    `skipped` keeps the last step's flag (None: it had none), for what follows the weights (`optim.ema`).
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, fused=True, **kwargs)  # fused: `step` state lives on the device
        self.skipped: Optional[torch.Tensor] = None

    @torch.no_grad()
    def step(self, closure=None, found_inf: Optional[torch.Tensor] = None):
        if closure is not None:
            raise ValueError("ShardedAdamW does not take a closure")
        found_inf = found_inf if found_inf is not None else getattr(self, "found_inf", None)
        self.skipped = found_inf
        grad_scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            by_device: dict[torch.device, tuple[list, list, list, list, list]] = {}  # several with CPU offload
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                state = self._state(param)
                shard = local(param)
                lists = by_device.get(shard.device)
                if lists is None:
                    lists = by_device[shard.device] = ([], [], [], [], [])
                lists[0].append(shard)
                lists[1].append(local(grad))
                lists[2].append(local(state["exp_avg"]))
                lists[3].append(local(state["exp_avg_sq"]))
                lists[4].append(state["step"])
            for device, (params, grads, exp_avgs, exp_avg_sqs, steps) in by_device.items():
                self._fused_step(group, device, params, grads, exp_avgs, exp_avg_sqs, steps, found_inf, grad_scale)

    def allocate_state(self) -> None:
        """Every parameter's moments, as its first step allocates them (zeros): memory the steps after the first
        hold through forward and backward."""
        for group in self.param_groups:
            for param in group["params"]:
                self._state(param)

    def _state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=local(param).device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def _fused_step(group: dict, device: torch.device, params, grads, exp_avgs, exp_avg_sqs, steps,
                    found_inf: Optional[torch.Tensor], grad_scale: Optional[torch.Tensor]) -> None:
        """One fused AdamW kernel over the tensors of one group on one device."""
        # 0 or 1 exactly: the kernel skips only on 1, and ShardedGradScaler's flag is summed over ranks
        found_inf = (found_inf.to(device).reshape(()) > 0).float() if found_inf is not None else None
        grad_scale = grad_scale.to(device, torch.float32) if grad_scale is not None else None
        torch._foreach_add_(steps, 1)  # pyright: ignore[reportPrivateImportUsage]  (torch's private kernels)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=group["lr"],  # pyright: ignore[reportPrivateImportUsage]
                            beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                            maximize=False, grad_scale=grad_scale, found_inf=found_inf)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))  # pyright: ignore[reportPrivateImportUsage]  (torch's private kernels)


def build_optimizer(model: nn.Module, groups: list[DecayGroup], spec: OptimizerSpec) -> ShardedAdamW:
    """AdamW whose groups are the decay groups computed on the original names (before wrapping).

    fully_shard keeps parameter names, so the names find the sharded parameters.
    """
    params = dict(model.named_parameters())
    param_groups = [{"params": [params[n] for n in g.names], "weight_decay": g.weight_decay, "lr_scale": g.lr_scale}
                    for g in groups]
    return ShardedAdamW(param_groups, lr=spec.lr, betas=spec.betas, eps=spec.eps)


class Schedule:
    """The learning rate of each step, `lr` = peak × `ScheduleSpec.lr_factor` of the step, set on every group times
    its `lr_scale` (layer-wise decay; open_clip_train's `assign_learning_rate` on OpenCLIP main). A function of
    the spec and the step alone, so a resumed run follows the spec it is resumed with (nothing to save)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: ScheduleSpec, peak_lr: float, total_steps: int):
        self.optimizer, self.peak, self.factor = optimizer, peak_lr, schedule.lr_factor(peak_lr, total_steps)
        self.set_step(0)

    def set_step(self, step: int) -> None:
        self.current, self.lr = step, self.lr_of(step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * group.get("lr_scale", 1.0)

    def lr_of(self, step: int) -> float:
        """The learning rate of step `step` (from 0), before the groups' `lr_scale`."""
        return self.peak * self.factor(step)

    def step(self) -> None:
        self.set_step(self.current + 1)


def build_grad_scaler(fsdp: FsdpSpec, device: torch.device):
    """A dynamic loss scaler that agrees across ranks on sharded (and CPU-offloaded) gradients (`fsdp.grad_scaler`'s
    settings), for a run whose plan scales its loss."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    class LocalShardGradScaler(ShardedGradScaler):
        """torch's ShardedGradScaler (overflow found on any rank skips the step on every rank, the scale
        agrees), unscaling each rank's local shards and the replicated gradients as plain tensors: the
        same check and division without DTensor dispatch, which fails on a mix of the two."""

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            grouped: dict[tuple, list[torch.Tensor]] = {}
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        grad = local(param.grad)
                        grouped.setdefault((grad.device, grad.dtype), []).append(grad)
            found = {}
            for (grad_device, _), grads in grouped.items():
                found.setdefault(grad_device, found_inf.to(grad_device))
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found[grad_device], inv_scale.to(grad_device))  # pyright: ignore[reportPrivateImportUsage]
            return found or {found_inf.device: found_inf}

    return LocalShardGradScaler(device=device.type, init_scale=fsdp.grad_scaler.init_scale,
                                growth_interval=fsdp.grad_scaler.growth_interval)


@torch.no_grad()  # also keeps DTensor.to_local off autograd: per gradient, that is host time in every step
def clip_gradients(parameters: list[nn.Parameter], max_norm: Optional[float]) -> torch.Tensor:
    """The global gradient norm, clipping to `max_norm` when set; no host sync.

    FSDP's gradients are DTensor shards: the norm is the root of the squares of each rank's local shards
    (`squared_norm`), summed over the shard group (one all-reduce; HSDP replicas hold the same
    shards, each counted once), plus the replicated gradients (the temperature and bias, the same on
    every rank: counted once). Clipping scales the local shards
    with one foreach kernel, as `clip_grads_with_norm_` would scale the DTensors through per-tensor
    dispatch (the cost that motivates this optimizer).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    shards = [local(g) for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    device = (shards or whole)[0].device if grads else local(parameters[0]).device
    squares = squared_norm(shards, device)
    if shards:
        mesh = next(g for g in grads if isinstance(g, DTensor)).device_mesh
        if shard_coordinate(mesh)[1] > 1:
            dist.all_reduce(squares, group=shard_group(mesh))
    norm = (squares + squared_norm(whole, device)).sqrt()
    if max_norm is not None and grads:
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for group in (shards, whole):  # the same coefficient torch's clip_grads_with_norm_ takes
            if group:
                torch._foreach_mul_(group, coefficient.to(group[0].device, group[0].dtype))  # pyright: ignore[reportPrivateImportUsage]  (torch's private kernels)
    return norm


@torch.no_grad()
def squared_norm(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of every element of `tensors`, as a 0-d fp32 tensor on `device`.

    Tensors on the host (CPU offload's gradients) take one BLAS dot each, which uses the host's threads;
    ATen's CPU vector norm, which torch's `get_total_norm` calls per tensor there, hardly does (ViT-bigG-14's
    2.54B gradients on 16 cores: 0.11 s against 0.90 s, benchmarks/host_step.py). Others take `get_total_norm`.
    """
    squares = torch.zeros((), dtype=torch.float32, device=device)
    host = [t.reshape(-1).float() for t in tensors if t.device.type == "cpu"]
    other = [t for t in tensors if t.device.type != "cpu"]
    if host:
        squares += torch.stack([torch.dot(t, t) for t in host]).sum().to(device)
    if other:
        from torch.nn.utils import get_total_norm

        squares += get_total_norm(other).to(device, torch.float32).square()
    return squares
