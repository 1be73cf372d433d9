"""Continuing an open_clip_train run (`fsdpclip import`, then `fsdpclip launch`).

open_clip_train's own `train_one_epoch` trains the tiny model for an epoch of a few steps on the digits
and the checkpoint is saved as its main.py saves it (under DDP: keys prefixed `module.`). Then open_clip_train
continues itself as its main.py resumes, and fsdpclip continues from the imported checkpoint on 2 ranks;
both see the same batches: those of fsdpclip's synthetic source, which a resumed run draws from its step
on (batch `index` of a rank depends only on the seed, the index and the rank), concatenated over the ranks
for open_clip_train's one process. No hook into the trainer: the real launch resumes the real checkpoint.
"""

from __future__ import annotations

import copy
import itertools
import json
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_CONFIG, logged_losses, squeezed, write_job
from ranks import run_group
from reference import open_clip_model, open_clip_train_optimizer
from test_parity import FP32, _merge, batch_source

pytestmark = pytest.mark.slow  # an open_clip_train run and launches

SEED, BATCH, STEPS, WARMUP = 3, 16, 3, 1  # open_clip_train's batch (fsdpclip: 8 on each of 2 ranks), steps per epoch
LR, BETAS, EPS, WD, CLIP = 2e-3, (0.9, 0.95), 1e-6, 0.2, 1.0


class RecordedLoss(torch.nn.Module):
    """open_clip's ClipLoss, as open_clip_train makes it, keeping the total of every step."""

    def __init__(self):
        from open_clip.loss import ClipLoss

        super().__init__()
        self.loss, self.values = ClipLoss(), []

    def forward(self, *args, **kwargs):
        losses = self.loss(*args, **kwargs)
        self.values.append(sum(losses.values()).item())
        return losses


def train_epoch(model, images: torch.Tensor, texts: torch.Tensor, epoch: int, optimizer) -> list[float]:
    """One epoch of open_clip_train's `train_one_epoch` over these samples (fp32, CPU, one process, its cosine
    schedule over 2 epochs); its losses."""
    from open_clip_train.scheduler import cosine_lr
    from open_clip_train.train import train_one_epoch

    args = SimpleNamespace(device="cpu", precision="fp32", accum_freq=1, distill=False, skip_scheduler=False,
                           grad_clip_norm=CLIP, horovod=False, log_every_n_steps=STEPS, world_size=1, rank=0,
                           local_rank=0, batch_size=BATCH, wandb=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, texts), batch_size=BATCH)
    loader.num_batches, loader.num_samples = len(loader), len(images)
    data = SimpleNamespace(dataloader=loader, set_epoch=lambda epoch: None)  # its DataInfo (whose module needs pandas)
    loss = RecordedLoss()
    train_one_epoch(model, {"train": data}, loss, epoch, optimizer, None,
                    cosine_lr(optimizer, LR, WARMUP, 2 * STEPS), None, args)
    return loss.values


def train_model(seed: int) -> torch.nn.Module:
    model = open_clip_model(TINY_CONFIG, seed)
    model.output_dict = True  # as open_clip_train creates it
    return model


def digits_samples(digits_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """The first epoch's samples: digits through open_clip's train transform and tokenizer."""
    import open_clip
    import webdataset as wds
    from open_clip.transform import PreprocessCfg, image_transform_v2

    transform = image_transform_v2(PreprocessCfg(size=32), is_train=True)
    shard = wds.WebDataset(str(digits_dir / "train-000000.tar"), shardshuffle=False).decode("pil")
    images, captions = zip(*itertools.islice(shard.to_tuple("jpg", "txt"), STEPS * BATCH))
    torch.manual_seed(SEED)
    return torch.stack([transform(image) for image in images]), open_clip.SimpleTokenizer(context_length=16)(captions)


def continuation(output_dir) -> dict:
    """The fsdpclip job that continues the run: open_clip_train's settings, the rest of its schedule, 2 ranks."""
    return {
        "run": {"name": "continued", "output_dir": str(output_dir), "seed": SEED},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32", "reduce_dtype": "fp32"},
        "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "grad_clip_norm": CLIP},
        "schedule": {"kind": "cosine", "warmup_steps": WARMUP, "steps": 2 * STEPS},
        "data": {"source": "synthetic"},
        "batch": {"per_gpu": BATCH // 2},
        "checkpoint": {"at_end": False},
        "logging": {"every_steps": 1},
        "launch": {"gpus_per_node": 2, "device": "cpu", "collective_timeout_s": 60},
    }


def continued_samples(job: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The second epoch's samples: the micro batches fsdpclip's 2 ranks draw from step STEPS on, rank by rank."""
    from fsdpclip.jobspec.jobfile import parse_job

    batch = batch_source(parse_job(job), 2)
    parts = [batch(rank, STEPS + i) for i in range(STEPS) for rank in range(2)]
    return torch.cat([images for images, _ in parts]), torch.cat([texts for _, texts in parts])


@pytest.fixture(scope="module")
def open_clip_train_run(tmp_path_factory, digits_dir):
    """open_clip_train's epoch 1 on the digits, saved as its main.py saves it; its epoch 2 continued by itself
    as its main.py resumes, and with a new optimizer (what losing the moments and step costs):
    (checkpoint, losses continued, losses with a new optimizer)."""
    tmp = tmp_path_factory.mktemp("open_clip_train")
    model = train_model(SEED)
    optimizer = open_clip_train_optimizer(model, LR, BETAS, EPS, WD)
    train_epoch(model, *digits_samples(digits_dir), 0, optimizer)
    path = tmp / "epoch_1.pt"
    torch.save({"epoch": 1, "name": "digits", "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()},
                "optimizer": optimizer.state_dict()}, path)
    samples = continued_samples(continuation(tmp))
    continued = {}
    for case in ("resumed", "new optimizer"):
        saved = torch.load(path, weights_only=True)
        model = train_model(SEED + 1)
        model.load_state_dict({k.removeprefix("module."): v for k, v in saved["state_dict"].items()})
        optimizer = open_clip_train_optimizer(model, LR, BETAS, EPS, WD)
        if case == "resumed":
            optimizer.load_state_dict(saved["optimizer"])
        continued[case] = train_epoch(model, *samples, saved["epoch"], optimizer)
    return path, continued["resumed"], continued["new optimizer"]


def test_fsdpclip_continues_an_open_clip_train_run(open_clip_train_run, tmp_path, cli):
    """Imported and launched on 2 ranks, fsdpclip's next losses are open_clip_train's own continuation's
    (fp32), which a continuation without the moments and step count misses by far more."""
    path, expected, without_moments = open_clip_train_run
    job_file = write_job(tmp_path, continuation(tmp_path / "runs"))
    run_dir = tmp_path / "runs" / "continued"
    imported = cli("import", path, job_file)
    assert imported.exit_code == 0, imported.output
    assert squeezed("→") in squeezed(imported.output) and "step-00000003" in imported.output
    record = json.loads((run_dir / "imported.json").read_text())
    assert (record["epoch"], record["step"], record["total_steps"], record["notes"]) == (1, STEPS, 2 * STEPS, [])
    proc = run_group([sys.executable, "-m", "fsdpclip", "launch", str(job_file)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "resumed from" in proc.stdout and f"imported from {path}" in proc.stdout
    losses = logged_losses(run_dir)
    assert sorted(losses) == list(range(STEPS + 1, 2 * STEPS + 1))
    assert [losses[step] for step in sorted(losses)] == pytest.approx(expected, abs=FP32["loss"])
    assert max(abs(a - b) for a, b in zip(expected, without_moments)) > 10 * FP32["loss"]


def test_what_does_not_correspond_is_refused_or_noted(open_clip_train_run, tmp_path, cli):
    """Another architecture, other frozen parts, other decay groups, no optimizer state, a schedule already
    over, a run directory with checkpoints: exit 2 with the reason, nothing written. A longer schedule, other
    weight decay and betas, a checkpoint of a compiled model (`_orig_mod.`): imported, each change printed
    and kept in imported.json."""
    path, _, _ = open_clip_train_run
    job = continuation(tmp_path / "runs")
    run_dir = tmp_path / "runs" / "continued"
    saved = torch.load(path, weights_only=True)
    torch.save({k: v for k, v in saved.items() if k != "optimizer"}, tmp_path / "no-optimizer.pt")
    other_model = tmp_path / "other-model.json"
    other_model.write_text(json.dumps(json.loads(TINY_CONFIG.read_text()) | {"embed_dim": 32}))
    refused = {
        "does not match the model": (path, _merge(job, {"model": {"config": str(other_model)}})),
        "what it freezes differs": (path, _merge(job, {"freeze": {"image": {"blocks": "0:1"}}})),
        "weight-decay groups do not correspond": (path, _merge(job, {"optimizer": {"decay_rules": []}})),
        "holds no optimizer state": (tmp_path / "no-optimizer.pt", job),
        "schedule ends at step 3": (path, _merge(job, {"schedule": {"steps": STEPS}})),
    }
    for reason, (source, spec) in refused.items():
        result = cli("import", source, write_job(tmp_path, spec))
        assert result.exit_code == 2 and "Traceback" not in result.output, (reason, result.output)
        assert squeezed(reason) in squeezed(result.output), (reason, result.output)
        assert not list(run_dir.glob("checkpoints/step-*")), reason

    compiled = tmp_path / "compiled.pt"
    torch.save({**saved, "state_dict": {k.replace("module.", "_orig_mod."): v for k, v in saved["state_dict"].items()}},
               compiled)
    spec = write_job(tmp_path, _merge(job, {"schedule": {"steps": 4 * STEPS},
                                            "optimizer": {"weight_decay": 0.1, "betas": [0.9, 0.98]}}))
    result = cli("import", compiled, spec)
    assert result.exit_code == 0, result.output
    notes = json.loads((run_dir / "imported.json").read_text())["notes"]
    assert len(notes) == 3 and all(squeezed(note) in squeezed(result.output) for note in notes)
    for change in ("a different schedule", "weight decay 0.2 → 0.1", "betas (0.9, 0.95) → (0.9, 0.98)"):
        assert any(change in note for note in notes), (change, notes)
    again = cli("import", compiled, spec)
    assert again.exit_code == 2
    assert squeezed("already holds checkpoints (newest step-00000003)") in squeezed(again.output)


def test_resume_from_the_file_points_at_import(open_clip_train_run, tmp_path, cli):
    """`checkpoint.resume: epoch_N.pt`, as open_clip_train's --resume takes it: validate names `fsdpclip import`."""
    path, _, _ = open_clip_train_run
    spec = write_job(tmp_path, _merge(continuation(tmp_path / "runs"), {"checkpoint": {"resume": str(path)}}))
    code, out = cli.validate_json(spec)
    assert code == 2 and [e["location"] for e in out["errors"]] == ["checkpoint.resume"]
    assert f"fsdpclip import {path} JOB_FILE" in out["errors"][0]["message"]


def _malformed(checkpoint: dict, case: str) -> dict:
    """`checkpoint` with one thing a hand-edited or foreign file might hold."""
    state, groups = checkpoint["optimizer"]["state"], checkpoint["optimizer"]["param_groups"]
    if case == "a string for a tensor":
        checkpoint["state_dict"][next(iter(checkpoint["state_dict"]))] = "weights"
    elif case == "a string for the learning rate":
        groups[0]["lr"] = "high"
    elif case == "a NaN step count":
        for entry in state.values():
            entry["step"] = torch.tensor(float("nan"))
    elif case == "more epochs than steps":
        checkpoint["epoch"] = 10 ** 30
    elif case == "a string for a moment":
        next(iter(state.values()))["exp_avg"] = "moment"
    return checkpoint


@pytest.mark.parametrize("case, message", [
    ("a string for a tensor", "state_dict['module.positional_embedding'] is str, not a tensor"),
    ("a string for the learning rate", "the optimizer's param_groups[0] has lr 'high', not a finite number"),
    ("a NaN step count", "the optimizer state of parameter 0 has step nan, not a count of steps"),
    ("more epochs than steps", "counts 1000000000000000000000000000000 epochs in 1 optimizer steps"),
    ("a string for a moment", "the optimizer state of parameter 0 holds exp_avg str, not a tensor"),
])
def test_a_malformed_checkpoint_is_refused_in_one_line(tmp_path, cli, case, message):
    """What a malformed open_clip_train checkpoint holds ended in a traceback (exit 1): one line naming it, exit 2,
    nothing written. A good one's next command keeps the --set overrides (without them it named the file's run)."""
    model = train_model(SEED)
    optimizer = open_clip_train_optimizer(model, LR, BETAS, EPS, WD)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    checkpoint = {"epoch": 1, "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()},
                  "optimizer": optimizer.state_dict()}
    job_file = write_job(tmp_path, continuation(tmp_path / "runs"))
    override = ["--set", 'run.name="renamed"']
    torch.save(_malformed(copy.deepcopy(checkpoint), case), tmp_path / "bad.pt")
    result = cli("import", tmp_path / "bad.pt", job_file, *override)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert squeezed(message) in squeezed(result.output)
    assert not list((tmp_path / "runs").glob("*/checkpoints/step-*"))
    torch.save(checkpoint, tmp_path / "good.pt")
    result = cli("import", tmp_path / "good.pt", job_file, *override)
    assert result.exit_code == 0, result.output
    assert f"continue with `fsdpclip launch {job_file} --set 'run.name=\"renamed\"'`" in result.output
    assert (tmp_path / "runs" / "renamed" / "checkpoints" / "step-00000001").is_dir()
