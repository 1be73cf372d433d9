"""The FSDP2 trainer on 2 CPU ranks against a plain single-process OpenCLIP loop."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from conftest import TINY_CONFIG, write_job
from ranks import torchrun

SEED, PER_GPU, WORLD, STEPS = 7, 8, 2, 6


def _parity_job(tmp_path, **extra) -> dict:
    job = {
        "run": {"name": "parity", "output_dir": str(tmp_path / "runs"), "seed": SEED},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32", "reduce_dtype": "fp32"},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.2, "grad_clip_norm": 1.0},
        "schedule": {"kind": "cosine", "warmup_steps": 2, "steps": STEPS},
        "data": {"source": "synthetic"},
        "batch": {"per_gpu": PER_GPU},
        "launch": {"gpus_per_node": WORLD, "device": "cpu", "collective_timeout_s": 60},
    }
    job.update(extra)
    return job


def _run_worker(tmp_path, mode: str, job: dict) -> tuple[dict, dict]:
    out = tmp_path / f"{mode}.json"
    proc = torchrun(["tests/workers/train_checks.py", mode, str(out), str(write_job(tmp_path, job))])
    assert proc.returncode == 0, proc.stdout[-5000:]
    return json.loads(out.read_text()), torch.load(str(out) + ".pt")


def _plain_model():
    """OpenCLIP's own CLIP class, seeded as the trainer seeds its initialisation."""
    import open_clip

    torch.manual_seed(SEED)
    return open_clip.CLIP(**json.loads(TINY_CONFIG.read_text()))


def _no_decay(name: str, param: torch.Tensor) -> bool:
    """The default rule, written out independently: < 2 dims, biases, norms, logit scale, embeddings."""
    return param.ndim < 2 or bool(re.search(r"bias$|logit_scale|ln_|norm|embed", name))


@pytest.mark.parametrize("fsdp", [{"unit_size": 1}, {"unit_size": "auto", "reshard_after_forward": False}],
                         ids=["per-block", "auto-units"])
def test_two_ranks_match_a_plain_loop(tmp_path, fsdp):
    from open_clip.loss import ClipLoss
    from open_clip_train.scheduler import cosine_lr

    from fsdpclip.data import SyntheticBatches

    job = _parity_job(tmp_path)
    job["fsdp"].update(fsdp)
    result, trained = _run_worker(tmp_path, "parity", job)

    model = _plain_model()
    decay = [p for n, p in model.named_parameters() if not _no_decay(n, p)]
    no_decay = [p for n, p in model.named_parameters() if _no_decay(n, p)]
    optimizer = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.2}],
                                  lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    schedule = cosine_lr(optimizer, 1e-3, 2, STEPS)
    data = SyntheticBatches((3, 32, 32), 16, 49408, PER_GPU, torch.device("cpu"), SEED, rank=0)
    loss_fn = ClipLoss()
    losses = []
    for step in range(STEPS):
        schedule(step)
        shards = [data.batch(step, rank) for rank in range(WORLD)]
        images, texts = torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards])
        loss = loss_fn(*model(images, texts))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(loss.item())

    assert len(result["losses"]) == STEPS
    assert result["losses"] == pytest.approx(losses, abs=5e-4)
    assert result["losses"][-1] < result["losses"][0]
    final = model.state_dict()
    assert trained["logit_scale"].shape == (1,)
    for name, value in final.items():
        assert torch.allclose(trained[name].reshape(value.shape), value, atol=2e-3), name


def test_frozen_decay_groups_and_encoders(tmp_path):
    freeze = {"image": {"blocks": "0:-1", "embeddings": True}, "text": {"blocks": ":", "head": True}}
    result, trained = _run_worker(tmp_path, "frozen", _parity_job(tmp_path, freeze=freeze))
    initial = _plain_model()
    image_blocks = len(initial.visual.transformer.resblocks)

    def frozen(name: str) -> bool:
        if name.startswith("visual.transformer.resblocks."):
            return int(name.split(".")[3]) < image_blocks - 1
        if name.startswith("visual."):
            return bool(re.search(r"conv1|class_embedding|positional_embedding|ln_pre", name))
        if name.startswith("transformer.resblocks."):
            return True
        return name in ("ln_final.weight", "ln_final.bias", "text_projection")

    changed = 0
    for name, value in initial.state_dict().items():
        after = trained[name].reshape(value.shape)
        if frozen(name):
            assert torch.equal(after, value), f"frozen {name} changed"
        else:
            changed += not torch.equal(after, value)
    assert changed >= 10

    trainable = {n: p for n, p in initial.named_parameters() if not frozen(n)}
    expected_no_decay = sorted(n for n, p in trainable.items() if _no_decay(n, p))
    got_no_decay = sorted(n for g in result["groups"] if g["weight_decay"] == 0 for n in g["names"])
    got_all = sorted(n for g in result["groups"] for n in g["names"])
    assert got_no_decay == expected_no_decay
    assert got_all == sorted(trainable)

    plain = _plain_model()
    plain.load_state_dict({k: v.reshape(plain.state_dict()[k].shape) for k, v in trained.items()})
    plain.eval()
    torch.manual_seed(123)
    images = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        expected_image = plain.encode_image(images)
        expected_text = plain.encode_text(torch.randint(1, 1000, (3, 16)))
    assert torch.allclose(torch.tensor(result["encode_image"]), expected_image, atol=1e-5)
    assert torch.allclose(torch.tensor(result["encode_text"]), expected_text, atol=1e-5)
