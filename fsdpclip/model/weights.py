"""Weights: the initial model of a run (OpenCLIP's init for a seed, then local weights) and loading
OpenCLIP-style checkpoints into a model or into one of its towers."""

from __future__ import annotations

import functools
import pickle
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
from torch import nn

from fsdpclip.model.pickles import NEEDS_CODE_HINT, PickleRefused, load_weights_only, refusal, unadmitted_global
from fsdpclip.model.build import OpenClip, build_model, tower_of
from fsdpclip.model.published import weights_file
from fsdpclip.run.node import usable_cores
from fsdpclip.jobspec.problems import ModelError
from fsdpclip.jobspec.job import ModelSpec

WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """An OpenCLIP-style checkpoint as a flat state dict, memory-mapped where the format allows (safetensors,
    torch.save's zip format; not its legacy one)."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        try:
            state = load_weights_only(path, str(path), map_location="cpu", mmap=zipfile.is_zipfile(path))
        except PickleRefused as exc:
            raise ModelError(f"{exc} ({NEEDS_CODE_HINT})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelError(f"{path} holds no state dict of tensors")
    return unwrapped(state)


def check_weights_file(path: str) -> None:
    """A local weights file's format, read without loading its tensors: a safetensors header, torch.save's zip
    format (its pickle weights-only, the tensors memory-mapped) or a pickle that names nothing a weights-only load
    refuses (torch.save's legacy format, its first pickle); ModelError saying what is wrong."""
    if str(path).endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as file:
                file.keys()
        except Exception as exc:  # safetensors' own SafetensorError, or an OSError
            raise ModelError(f"{path} is not a safetensors file: {exc}") from None
    elif zipfile.is_zipfile(path):
        read_state_dict(path)
    else:
        with open(path, "rb") as file:
            if file.read(1) != pickle.PROTO:  # how every pickle torch.save writes begins
                raise ModelError(f"{path} is no weights file: neither torch.save's format nor safetensors")
        if refused := unadmitted_global(path):
            raise ModelError(f"{PickleRefused(path, refused)} ({NEEDS_CODE_HINT})")


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
    prefix = f"{module}." if module is not None else {"image": "visual.", "text": "text."}.get(tower or "", "")
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


def load_model_weights(model: OpenClip, path: str, label: str = "the model") -> None:
    """A whole-model OpenCLIP checkpoint, loaded strictly by OpenCLIP's own `load_checkpoint` (its key
    conversions, position-embedding resizes, 0-d/1-element logit scale and a missing logit bias)."""
    import pickle

    import open_clip

    try:
        open_clip.load_checkpoint(model, path, strict=True, weights_only=True)
    except (RuntimeError, AssertionError) as exc:  # missing, unexpected or mis-shaped keys; resizes that cannot be
        detail = " ".join(str(exc).split())
        raise ModelError(another_model(model, path, label) or
                         f"{path} does not match the model: {detail[:400]}{'...' if len(detail) > 400 else ''}") \
            from None
    except (OSError, ValueError, KeyError, StopIteration, pickle.UnpicklingError) as exc:
        refused = refusal(exc, path, path)
        raise ModelError(f"{refused} ({NEEDS_CODE_HINT})" if refused else
                         f"cannot read {path} as an OpenCLIP checkpoint: {type(exc).__name__}: {exc}") from None


def another_model(model: nn.Module, path: str, label: str) -> Optional[str]:
    """The line saying that a weights file holds another model than `label` (the first tensor of another
    shape, how many differ or are missing), or None where every tensor has the model's size."""
    state, own = read_state_dict(path), model.state_dict()
    resized = [k for k in state if k in own and state[k].numel() != own[k].numel()]
    missing, unexpected = set(own) - set(state), set(state) - set(own)
    if not resized and not (missing and unexpected):
        return None
    first = (f"{resized[0]} is {list(state[resized[0]].shape)} there, {list(own[resized[0]].shape)} in {label}; "
             if resized else "")
    return (f"{path} holds the weights of another model than {label}: {first}{len(resized)} tensors of another "
            f"size, {len(missing)} missing, {len(unexpected)} unexpected; name the model it was trained with")


# 'auto' init draws OpenCLIP's own weights (one serial random stream) up to this size, in parallel above.
OPENCLIP_INIT_MAX_PARAMETERS = 1_000_000_000


def initial_model(spec: ModelSpec, seed: int, init: str) -> nn.Module:
    """The full model with its starting weights, on the CPU: `init` ('openclip' or 'parallel': `spec.init`
    settled, `init_kind`) with `seed`, then local weights.

    Always the CPU's generators, so a seed gives the same weights on every machine (a GPU's
    generator draws other numbers, and whether a model fits a GPU must not change it); with
    every core this process may use (torchrun leaves each rank one thread, and the other ranks
    wait for this one).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, usable_cores()))
    try:
        torch.manual_seed(seed)
        if init == "parallel":
            with ParallelDraws(seed, usable_cores()):
                model = build_model(spec, device="cpu")
        else:
            model = build_model(spec, device="cpu")
    finally:
        torch.set_num_threads(threads)
    if spec.pretrained:
        load_model_weights(model, weights_file(spec), spec.label)
    if spec.image.pretrained:
        load_weights(model, read_state_dict(spec.image.pretrained), spec.image.pretrained, tower="image")
    if spec.text.pretrained:
        load_weights(model, read_state_dict(spec.text.pretrained), spec.text.pretrained, tower="text")
    for family, block in filter(None, (spec.image.family, spec.text.family)):
        family.load_weights(block, model)
    return model


def init_kind(spec: ModelSpec, parameters: int) -> str:
    """spec.init with 'auto' decided by the model's size (its `parameters`)."""
    if spec.init != "auto":
        return spec.init
    return "openclip" if parameters <= OPENCLIP_INIT_MAX_PARAMETERS else "parallel"


class ParallelDraws:
    """While active, the random draws of a model's constructors are parallel and still deterministic.

    The CPU generator draws serially (single-threaded ~0.3G values/s: a 10B-parameter model draws
    minutes). Inside, every random fill or creation called without a generator (`Tensor.normal_`,
    `uniform_`, ... as nn.init, timm and Hugging Face call them; `torch.randn`, ...) gets its own,
    seeded from (seed, call number); a fill of a large contiguous tensor is split into chunks of
    CHUNK values with a generator each, drawn on `workers` threads. The numbers depend on the seed,
    the model's calls and CHUNK only, not on the core count, thread timing or machine. The methods are
    swapped on torch.Tensor and torch for the duration (one thread builds the model meanwhile).
    """

    CHUNK = 1 << 20  # values: ~3 ms of one core's drawing, so even a 4M-value weight spreads over 4 cores
    IN_PLACE = ("normal_", "uniform_", "random_", "bernoulli_", "exponential_", "log_normal_", "cauchy_",
                "geometric_")
    CREATING = ("randn", "rand", "randint", "randperm", "normal", "bernoulli", "multinomial")

    def __init__(self, seed: int, workers: int):
        self.seed, self.calls, self.workers = seed, 0, max(1, workers)
        self.saved: list[tuple[object, str, object]] = []
        self.pool: Optional[ThreadPoolExecutor] = None

    def __enter__(self) -> "ParallelDraws":
        self.pool = ThreadPoolExecutor(self.workers)
        for owner, names, wrap in ((torch.Tensor, self.IN_PLACE, self._fill), (torch, self.CREATING, self._create)):
            for name in names:
                self.saved.append((owner, name, owner.__dict__.get(name)))
                setattr(owner, name, self._through(wrap, getattr(owner, name)))
        return self

    @staticmethod
    def _through(wrap, original):
        """A plain function (a method once set on torch.Tensor) that calls wrap(original, ...)."""
        @functools.wraps(original)
        def call(*args, **kwargs):
            return wrap(original, *args, **kwargs)
        return call

    def __exit__(self, *exc) -> None:
        for owner, name, own in reversed(self.saved):
            if own is None:
                delattr(owner, name)  # inherited (torch.Tensor's come from the C base class)
            else:
                setattr(owner, name, own)
        self.saved.clear()
        if self.pool is not None:
            self.pool.shutdown()
        self.pool = None

    def _generator(self, *key: int) -> torch.Generator:
        mixed = self.seed
        for part in key:
            mixed = (mixed * 6364136223846793005 + part + 1442695040888963407) % (1 << 63)
        return torch.Generator().manual_seed(mixed)

    def _create(self, original, *args, **kwargs):
        if kwargs.get("generator") is not None:
            return original(*args, **kwargs)
        self.calls += 1
        return original(*args, **{**kwargs, "generator": self._generator(self.calls)})

    def _fill(self, original, tensor, *args, **kwargs):
        if kwargs.get("generator") is not None:
            return original(tensor, *args, **kwargs)
        self.calls += 1
        kwargs.pop("generator", None)
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() <= self.CHUNK:
            return original(tensor, *args, **kwargs, generator=self._generator(self.calls))
        chunks = tensor.view(-1).split(self.CHUNK)
        draw, grad = self.calls, torch.is_grad_enabled()  # grad mode is per thread

        def fill(index: int) -> None:
            with torch.set_grad_enabled(grad):
                original(chunks[index], *args, **kwargs, generator=self._generator(draw, index))

        assert self.pool is not None  # inside the draws
        list(self.pool.map(fill, range(len(chunks))))
        return tensor
