"""Continue an open_clip_train run: its checkpoint (`epoch_N.pt`, `epoch_latest.pt`) written into a
run directory as an fsdpclip checkpoint, which `fsdpclip launch` then resumes like one of its own.

What open_clip_train saves and where each part goes:

- `state_dict` (every key perhaps prefixed `module.` by DDP or `_orig_mod.` by torch.compile): the
  weights, loaded strictly into the spec's model; another architecture is an error.
- `optimizer`: torch's AdamW state, whose parameters are integer indices in open_clip_train's
  order: its group without weight decay (tensors of < 2 dims, names containing bn, ln, bias or
  logit_scale: fsdpclip's default decay rules), then the rest, each in `named_parameters()` order,
  trainable parameters only. The indices are turned back into names by that rule and each
  parameter's moments and step count are saved under its name, so the trainer's load reshards
  them onto its FSDP units at any world size, as it does its own checkpoints.
- the step: AdamW's step count, which drives its bias correction and is open_clip_train's schedule
  position (`num_batches_per_epoch * epoch`) unless fp16 steps were skipped; `epoch`: the data
  stream starts that epoch (synthetic data without `data.samples` continues from the step).
- `scaler`: the fp16 loss scale.

What does not correspond is an error before anything is written (`CheckpointError`, or
`ModelError` for the weights): the architecture, the trained parameters (their number and shapes in
each group), the decay groups, missing or non-AdamW optimizer state, a schedule that has ended.
What the spec may change applies from the imported step and is noted (printed, and kept in
RUN_DIR/imported.json): the schedule (the learning rate open_clip_train last used against this
spec's at that step), betas, eps, weight-decay values, the loss scale, the length of an epoch.
"""

from __future__ import annotations

import json
import math
import pickle
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from fsdpclip.model.pickles import NEEDS_CODE_HINT, refusal
from fsdpclip.checkpoint.layout import CheckpointError, complete_checkpoints
from fsdpclip.checkpoint.whole import save_whole
from fsdpclip.model.build import SHARED_PARAMETERS, model_config, original_shapes, training_config
from fsdpclip.model.trainable import DecayGroup, frozen_meta_model, rule_matches, trainable_decay_groups
from fsdpclip.model.weights import load_weights, unwrapped
from fsdpclip.run.directory import IMPORT_FILE
from fsdpclip.run.files import write_atomically
from fsdpclip.run.lock import HeldLock, lock_token
from fsdpclip.jobspec.job import DEFAULT_DECAY_RULES, Job
from fsdpclip.optim.adamw import build_optimizer

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Imported:
    """What an import wrote: from where, the checkpoint, where the run continues, what the spec changes."""

    source: str
    name: Optional[str]
    epoch: int
    notes: list[str]
    step: int
    total_steps: int
    checkpoint: str


def import_open_clip_train(source: Path, job: Job) -> Imported:
    """Write the open_clip_train checkpoint `source` into the run directory of `job` (a job `check_job`
    passed, its paths resolved) as the checkpoint its launch resumes, holding the run directory's lock."""
    source = Path(source)
    if job.checkpoint.resume != "latest":
        raise CheckpointError(f"checkpoint.resume is {job.checkpoint.resume!r}: the launch would not resume the "
                              "imported checkpoint; leave it 'latest'")
    job.run_dir.mkdir(parents=True, exist_ok=True)
    with HeldLock(job.run_dir, lock_token()):
        existing = complete_checkpoints(job.run_dir)
        if existing:
            raise CheckpointError(f"{job.run_dir} already holds checkpoints (newest {existing[-1].name}): import into "
                                  "a new run directory (another run.name)")
        saved = read_checkpoint(source)
        model, groups, notes = _model_with_weights(saved["state_dict"], source, job)
        optimizer, step = _optimizer_with_moments(saved["optimizer"], model, groups, source, job, notes)
        world = job.launch.nodes * job.launch.gpus_per_node
        if saved["epoch"] > step:
            raise CheckpointError(f"{source} counts {saved['epoch']} epochs in {step} optimizer steps: an epoch takes "
                                  "at least one")
        samples_seen = _samples_seen(job, world, saved["epoch"], step, notes)
        total = job.total_steps(world, step, samples_seen)
        if total is None:
            raise CheckpointError("this spec's schedule has no length: give schedule.steps, or data.samples for "
                                  "schedule.epochs")
        if total <= step:
            raise CheckpointError(f"{source} is at step {step} and this spec's schedule ends at step {total}: "
                                  "lengthen schedule.steps or schedule.epochs")
        notes += _schedule_notes(saved["optimizer"]["param_groups"][0], job, step, total)
        scaler, note = _scaler(saved.get("scaler"), job)
        notes += note
        imported = {"source": str(source), "name": saved.get("name"), "epoch": saved["epoch"], "notes": notes}
        meta = {"samples_seen": samples_seen, "skipped_steps": 0, "scaler": scaler,
                "model": {"label": job.model.label, "open_clip_config": training_config(job)},
                "job": json.loads(job.to_json()), "imported": imported}
        checkpoint = save_whole(job.run_dir, step, model, optimizer, meta)
        result = Imported(**imported, step=step, total_steps=total, checkpoint=str(checkpoint))
        record = {"time": time.time(), **asdict(result)}
        write_atomically(job.run_dir / IMPORT_FILE, json.dumps(record, indent=2) + "\n")
    return result


def read_checkpoint(path: Path) -> dict:
    """An open_clip_train checkpoint, memory-mapped, with its `state_dict`, `optimizer` and `epoch` checked."""
    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        refused = refusal(exc, str(path))
        raise CheckpointError(f"{refused} ({NEEDS_CODE_HINT})" if refused else
                              f"cannot read {path} as a torch checkpoint: {' '.join(str(exc).split())[:300]}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("state_dict"), dict):
        raise CheckpointError(f"{path} is not an open_clip_train checkpoint (a dict with state_dict, optimizer and "
                              "epoch): to start from its weights alone, use model.pretrained")
    optimizer = saved.get("optimizer")
    if not isinstance(optimizer, dict) or not optimizer.get("state") or not optimizer.get("param_groups"):
        raise CheckpointError(f"{path} holds no optimizer state to continue from: to start from its weights alone, "
                              "use model.pretrained")
    if not isinstance(saved.get("epoch"), int) or saved["epoch"] < 0:
        raise CheckpointError(f"{path} has no epoch count (open_clip_train saves 'epoch', the epochs completed)")
    odd = next((k for k, v in saved["state_dict"].items() if not isinstance(v, torch.Tensor)), None)
    if odd is not None:
        raise CheckpointError(f"{path}: state_dict[{odd!r}] is {type(saved['state_dict'][odd]).__name__}, not a tensor")
    for index, group in enumerate(optimizer["param_groups"]):
        problem = _group_problem(group)
        if problem:
            raise CheckpointError(f"{path}: the optimizer's param_groups[{index}] {problem}")
    return saved


def _group_problem(group) -> Optional[str]:
    """What is wrong with a parameter group of torch's AdamW state as the import reads it, else None."""
    if not isinstance(group, dict):
        return f"is {type(group).__name__}, not a dict"
    params = group.get("params")
    if not isinstance(params, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in params):
        return "has no list of parameter indices ('params')"
    for key in ("lr", "eps", "weight_decay"):
        if not _finite(group.get(key)):
            return f"has {key} {group.get(key)!r}, not a finite number"
    betas = group.get("betas")
    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(map(_finite, betas)):
        return f"has betas {betas!r}, not two finite numbers"
    return None


def _finite(value) -> bool:
    """A finite real number, or a tensor of one (AdamW may keep its hyperparameters and step counts as tensors)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            return False
        value = value.item()
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _model_with_weights(state: dict, source: Path, job: Job) -> tuple[nn.Module, list[DecayGroup], list[str]]:
    """The spec's model (its freeze applied) on the CPU with the checkpoint's weights, its decay groups, notes."""
    model, _ = frozen_meta_model(model_config(job.model), job)
    groups = trainable_decay_groups(model, job.optimizer)
    model.to_empty(device="cpu")
    own = model.state_dict()
    state = {k: v.reshape(own[k].shape) if k in SHARED_PARAMETERS and k in own else v  # OpenCLIP's are 0-d
             for k, v in unwrapped(state).items()}
    load_weights(model, state, str(source))
    notes = []
    dtypes = {str(v.dtype).removeprefix("torch.") for v in state.values() if v.is_floating_point()}
    if dtypes != {"float32"}:
        notes.append(f"the weights are {', '.join(sorted(dtypes))}: converted to fp32")
    frozen = sum(not p.requires_grad for p in model.parameters())
    if frozen:
        notes.append(f"this spec freezes {frozen} parameter tensors: the checkpoint does not record which ones "
                     "open_clip_train trained, so they are taken to be those its --lock-image/--lock-text froze")
    return model, groups, notes


def _optimizer_with_moments(saved: dict, model: nn.Module, groups: list[DecayGroup], source: Path, job: Job,
                            notes: list[str]) -> tuple[torch.optim.Optimizer, int]:
    """The trainer's AdamW for `model` holding the checkpoint's moments and step counts by name, and the
    step to continue from; adds notes."""
    shapes = original_shapes(model)
    names = _open_clip_train_order(model, shapes)
    decay = {n: g.weight_decay for g in groups for n in g.names}
    notes += _compare_decay(saved["param_groups"], names, decay, source)
    moments = _moments(saved, names, shapes, source)
    missing = [n for n in decay if n not in moments]
    if missing:
        notes.append(f"{len(missing)} trained parameter tensor(s) have no AdamW state in the checkpoint (never "
                     f"stepped): their moments start at zero ({_first(missing)})")
    optimizer = build_optimizer(model, groups, job.optimizer)
    for name, param in model.named_parameters():
        if name in decay:
            entry = moments.get(name)
            optimizer.state[param] = {
                "step": torch.tensor(float(entry["step"]) if entry else 0.0, dtype=torch.float32),
                **{k: entry[k].reshape(param.shape).float() if entry else torch.zeros_like(param) for k in MOMENTS}}
    steps = sorted({int(float(entry["step"])) for entry in moments.values()})
    if not steps or steps[-1] == 0:
        raise CheckpointError(f"{source}: its AdamW has taken no step")
    if len(steps) > 1:
        notes.append(f"AdamW's step counts differ between parameters ({steps[0]} to {steps[-1]}): each keeps its own "
                     f"for bias correction; the schedule continues from step {steps[-1]}")
    return optimizer, steps[-1]


def _open_clip_train_order(model: nn.Module, shapes: dict[str, torch.Size]) -> list[list[str]]:
    """The names behind open_clip_train's optimizer indices, by group: trained parameters without weight
    decay by its rule (fsdpclip's default decay rules), then the others, each in `named_parameters()` order."""
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    no_decay = [n for n in trained if any(rule_matches(r, n, len(shapes[n])) for r in DEFAULT_DECAY_RULES)]
    return [no_decay, [n for n in trained if n not in set(no_decay)]]


def _moments(optimizer: dict, names: list[list[str]], shapes: dict[str, torch.Size], source: Path) -> dict[str, dict]:
    """The checkpoint's AdamW state by parameter name (parameters it holds none for are left out)."""
    groups, state = optimizer["param_groups"], optimizer["state"]
    if any(g.get("amsgrad") for g in groups):
        raise CheckpointError(f"{source}: its AdamW uses amsgrad, which fsdpclip's AdamW does not")
    found = {}
    for group, group_names in zip(groups, names):
        for index, name in zip(group["params"], group_names):
            entry = state.get(index)
            if entry is None:
                continue
            if not isinstance(entry, dict) or not {*MOMENTS, "step"} <= set(entry):
                held = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
                raise CheckpointError(f"{source}: the optimizer state of parameter {index} is not AdamW's "
                                      f"(exp_avg, exp_avg_sq, step): {held}")
            odd = next((k for k in MOMENTS if not isinstance(entry[k], torch.Tensor)), None)
            if odd is not None:
                raise CheckpointError(f"{source}: the optimizer state of parameter {index} holds {odd} "
                                      f"{type(entry[odd]).__name__}, not a tensor")
            step = entry["step"]
            if not _finite(step) or float(step) < 0:
                shown = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
                raise CheckpointError(f"{source}: the optimizer state of parameter {index} has step {shown!r}, not a "
                                      "count of steps")
            if not entry["exp_avg"].shape == entry["exp_avg_sq"].shape == shapes[name]:
                raise CheckpointError(f"{source}: the optimizer state of parameter {index} has shape "
                                      f"{tuple(entry['exp_avg'].shape)}, but {name}, which open_clip_train lists "
                                      f"there, has {tuple(shapes[name])}: the model or what it freezes differs")
            found[name] = entry
    return found


def _compare_decay(groups: list[dict], names: list[list[str]], decay: dict[str, float], source: Path) -> list[str]:
    """CheckpointError unless the checkpoint's groups are open_clip_train's two, with as many parameters as this
    spec trains in each, and this spec decays exactly the parameters they decayed; a note for each weight-decay
    value that changes."""
    counts = [len(g.get("params", [])) for g in groups]
    if len(groups) != 2:
        raise CheckpointError(f"{source}: its optimizer has {len(groups)} parameter group(s), not the 2 of "
                              "open_clip_train's AdamW (without and with weight decay): another optimizer (--opt "
                              "timm/...) cannot be continued")
    if counts != [len(n) for n in names]:
        raise CheckpointError(f"{source}: its optimizer trains {counts[0]} + {counts[1]} parameter tensors (without + "
                              f"with weight decay), this spec {len(names[0])} + {len(names[1])}: the model or what it "
                              "freezes differs (open_clip_train's --lock-image/--lock-text against freeze)")
    saved = {n: float(g["weight_decay"]) for g, group_names in zip(groups, names) for n in group_names}
    gained = [n for n in saved if saved[n] == 0 and decay[n] > 0]
    lost = [n for n in saved if saved[n] > 0 and decay[n] == 0]
    if gained or lost:
        raise CheckpointError(f"{source}: the weight-decay groups do not correspond: this spec decays {len(gained)} "
                              f"parameter tensors that open_clip_train did not ({_first(gained)}) and not {len(lost)} "
                              f"that it did ({_first(lost)}); give optimizer.decay_rules that split them as "
                              "open_clip_train did (the default rules do)")
    changed = sorted({(saved[n], decay[n]) for n in saved if saved[n] != decay[n]})
    return [f"weight decay {before:g} → {after:g} (this spec's)" for before, after in changed]


def _samples_seen(job: Job, world: int, epoch: int, step: int, notes: list[str]) -> int:
    """The samples a run of this spec has seen at the import: `epoch` of its epochs where it knows their
    size (its data stream then starts epoch `epoch`), else `step` of its global batches; adds a note
    when `epoch` epochs of this spec are not `step` steps."""
    epoch_samples = job.epoch_samples(world)
    if epoch_samples is None:
        return step * job.samples_per_step(world)
    per_epoch = epoch_samples // job.samples_per_step(world)
    if per_epoch * epoch != step:
        notes.append(f"open_clip_train took {step} optimizer steps in {epoch} epoch(s), an epoch of this spec is "
                     f"{per_epoch} steps: the schedule continues from step {step}, the data from epoch {epoch}")
    return epoch * epoch_samples


def _schedule_notes(group: dict, job: Job, step: int, total: int) -> list[str]:
    """Where this spec's optimizer settings differ from the checkpoint's: the learning rate open_clip_train
    set for its last step against this spec's schedule there, betas, eps."""
    spec, notes = job.optimizer, []
    saved_lr, lr = float(group["lr"]), job.lr(step - 1, total)
    if not math.isclose(saved_lr, lr, rel_tol=1e-6, abs_tol=1e-12):
        notes.append(f"the learning rate of step {step} was {saved_lr:.6g} in open_clip_train and is {lr:.6g} in this "
                     f"spec's schedule ({job.schedule.kind}, peak {spec.lr:g}, {job.schedule.warmup_steps} warmup "
                     f"steps, {total} steps): a different schedule, this spec's from step {step + 1}")
    betas = tuple(float(b) for b in group["betas"])
    if betas != tuple(spec.betas):
        notes.append(f"AdamW betas {betas} → {tuple(spec.betas)} (this spec's)")
    if float(group["eps"]) != spec.eps:
        notes.append(f"AdamW eps {float(group['eps']):g} → {spec.eps:g} (this spec's)")
    return notes


def _scaler(saved: Optional[dict], job: Job) -> tuple[Optional[dict], list[str]]:
    """The loss scaler's state for the trainer (the checkpoint's, where this spec scales its loss), notes."""
    if not job.fsdp.scales_loss:
        return None, [f"the fp16 loss scale of the checkpoint ({saved.get('scale')}) is not used: this spec trains "
                      f"in {job.fsdp.param_dtype} without loss scaling"] if saved else []
    if not saved:
        return None, [f"the checkpoint has no loss scale: loss scaling starts at {job.fsdp.grad_scaler.init_scale:g}"]
    return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}, []


def _first(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + ("..." if len(names) > shown else "")
