"""Weights: the initial model of a run (OpenCLIP's init for a seed, then local weights) and loading
OpenCLIP-style checkpoints into a model or into one of its towers."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from fsdpclip.model import build_model, tower_of
from fsdpclip.problems import ModelError
from fsdpclip.spec import ModelSpec
from fsdpclip.towers import hf_encoder_state, timm_trunk_state

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """An OpenCLIP-style checkpoint as a flat state dict, memory-mapped where the format allows."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelError(f"{path} holds no state dict of tensors")
    return unwrapped(state)


def unwrapped(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict without the prefixes that wrappers put on every key: `module.` (DDP) and `_orig_mod.`
    (torch.compile), in any nesting."""
    while state and (prefix := next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None)):
        state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], where: str, tower: Optional[str] = None,
                 module: Optional[str] = None) -> None:
    """Load a state dict strictly (every key, no other, the same shapes): one tower's (keys relative to
    the tower), one submodule's (keys relative to `module`, e.g. 'visual.trunk') or, given neither, the
    whole model's. OpenCLIP has no loader for parts of a model, and its whole-model loader resizes."""
    prefix = f"{module}." if module is not None else {"image": "visual.", "text": "text."}.get(tower, "")
    if tower == "text" and not hasattr(model, "text"):  # OpenCLIP's own text tower sits on the root
        prefix = ""
    state = {prefix + k: v for k, v in state.items()}
    own = model.state_dict()
    expected = {k for k in own if k.startswith(prefix)} if module is not None else \
        {k for k in own if tower_of(k) == tower} if tower is not None else set(own)
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelError(f"{where} does not match the model: {len(missing)} missing keys "
                         f"({', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}), {len(unexpected)} unexpected "
                         f"({', '.join(unexpected[:3])}{'...' if len(unexpected) > 3 else ''})")
    wrong = [k for k, v in state.items() if v.shape != own[k].shape]
    if wrong:
        raise ModelError(f"{where} does not match the model: {wrong[0]} has shape {tuple(state[wrong[0]].shape)}, "
                         f"the model {tuple(own[wrong[0]].shape)}")
    model.load_state_dict(state, strict=False)


def load_model_weights(model: nn.Module, path: str) -> None:
    """A whole-model OpenCLIP checkpoint, loaded strictly by OpenCLIP's own `load_checkpoint` (its key
    conversions, position-embedding resizes, 0-d/1-element logit scale and a missing logit bias)."""
    import pickle

    import open_clip

    try:
        open_clip.load_checkpoint(model, path, strict=True)
    except (RuntimeError, AssertionError) as exc:  # missing, unexpected or mis-shaped keys; resizes that cannot be
        detail = " ".join(str(exc).split())
        raise ModelError(f"{path} does not match the model: {detail[:400]}{'...' if len(detail) > 400 else ''}") \
            from None
    except (OSError, ValueError, KeyError, StopIteration, pickle.UnpicklingError) as exc:
        raise ModelError(f"cannot read {path} as an OpenCLIP checkpoint: {type(exc).__name__}: {exc}") from None


def initial_model(spec: ModelSpec, seed: int) -> nn.Module:
    """The full model with its starting weights, on the CPU: OpenCLIP's init for `seed`, then local weights.

    Always the CPU's generator, so a seed gives the same weights on every machine (a GPU's
    generator draws other numbers, and whether a model fits a GPU must not change it); with
    every core this process may use, which gives the same numbers as one thread, only faster
    (torchrun leaves each rank one thread, and the other ranks wait for this one).
    """
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(threads, cores))
    try:
        torch.manual_seed(seed)
        model = build_model(spec, device="cpu")
    finally:
        torch.set_num_threads(threads)
    if spec.pretrained:
        load_model_weights(model, spec.pretrained)
    if spec.image.pretrained:
        load_weights(model, read_state_dict(spec.image.pretrained), spec.image.pretrained, tower="image")
    if spec.text.pretrained:
        load_weights(model, read_state_dict(spec.text.pretrained), spec.text.pretrained, tower="text")
    if spec.image.timm is not None and spec.image.timm.pretrained:
        state, file = timm_trunk_state(spec.image.timm, model.visual.trunk, read_state_dict)
        load_weights(model, state, file, module="visual.trunk")
    if spec.text.hf is not None and spec.text.hf.pretrained:
        load_weights(model, hf_encoder_state(spec.text.hf), spec.text.hf.path, module="text.transformer")
    return model
