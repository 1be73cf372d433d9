"""`batch.per_gpu: "auto"`: the search over fake probes, the batch it keeps, the record a relaunch reuses, what
`validate` shows and refuses, and the benchmark's refusal on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, TINY_CONFIG
from fsdpclip.plan.batch import (
    PEAK_MARGIN, BatchRecord, BatchSearchFailed, Probe, kept_batch, largest_fitting, recorded_batch, search_basis,
    settled_batch,
)
from fsdpclip.jobspec.job import EmaSpec, Job
from fsdpclip.validate.checks import check_job

TINY = str(TINY_CONFIG)


def auto_job(tmp_path, **batch) -> Job:
    return Job.model_validate({
        "run": {"name": "auto", "output_dir": str(tmp_path)}, "model": {"config": TINY},
        "data": {"source": "synthetic", "samples": 1 << 20}, "schedule": {"steps": 10},
        "batch": {"per_gpu": "auto"} | batch,
        "launch": {"gpus_per_node": 2, "device": "cuda", "gpu_memory_gib": 1}})


class Fits:
    """A monotone probe: batches up to `largest` fit; the batches asked, in order."""

    def __init__(self, largest: int):
        self.largest, self.asked = largest, []

    def __call__(self, per_gpu: int) -> bool:
        self.asked.append(per_gpu)
        return per_gpu <= self.largest


@pytest.mark.parametrize("largest,start", [(1000, 64), (1000, 4096), (37, 37), (5, 300), (1, 8)])
def test_the_search_finds_the_largest_fit_within_a_sixteenth(largest, start):
    fits = Fits(largest)
    found = largest_fitting(fits, start, limit=1 << 15)
    assert largest * 15 / 16 <= found <= largest
    assert len(fits.asked) <= 16 and len(set(fits.asked)) == len(fits.asked)


def test_the_search_stops_at_its_limit_and_at_nothing_fitting():
    assert largest_fitting(Fits(1 << 20), 64, limit=512) == 512
    assert largest_fitting(Fits(0), 64, limit=512) == 0


def test_every_rank_must_fit():
    """The trainer's probe agrees over ranks with MIN: the search keeps what the smallest GPU fits."""
    ranks = [Fits(900), Fits(700), Fits(1200)]
    found = largest_fitting(lambda b: min(rank(b) for rank in ranks), 256, limit=1 << 15)
    assert 700 * 15 / 16 <= found <= 700


GIB = 2 ** 30


class Memory:
    """A probe of a GPU of `capacity` bytes whose step peaks at `fixed + per_sample × batch` (no less than
    `plateau`, an optimizer step's peak flat in the batch); batches in `fails` run out of memory regardless."""

    def __init__(self, fixed: float, per_sample: float, capacity: float = 140 * GIB, plateau: float = 0.0,
                 fails: frozenset = frozenset()):
        self.fixed, self.per_sample, self.capacity = fixed, per_sample, capacity
        self.plateau, self.fails = plateau, fails
        self.asked = []

    def peak(self, per_gpu: int) -> float:
        return max(self.plateau, self.fixed + self.per_sample * per_gpu)

    def __call__(self, per_gpu: int) -> tuple[bool, float]:
        self.asked.append(per_gpu)
        return self.peak(per_gpu) <= self.capacity and per_gpu not in self.fails, self.peak(per_gpu)


@pytest.mark.parametrize("fixed_gib,per_sample_mib,plateau_gib,start", [
    (2, 40, 0, 3500),      # the estimate about right: probes from half of it
    (2, 40, 0, 5000),      # the estimate too large (more than the device fits)
    (2, 40, 0, 8),         # far too small: doubling while the line predicts it
    (40, 500, 0, 150),     # mostly fixed memory (a large model on one GPU)
    (20, 60, 40, 16),      # small batches peak in the optimizer step, flat
])
def test_the_predicted_search_never_probes_above_its_budget(tmp_path, fixed_gib, per_sample_mib, plateau_gib, start):
    """Without FSDP's recovery from running out of memory: every batch probed is predicted (and here found) under
    the margin of the device's memory, and the batch kept is SAFETY of the largest under it."""
    memory = Memory(fixed_gib * GIB, per_sample_mib * 2 ** 20, plateau=plateau_gib * GIB)
    budget = PEAK_MARGIN * memory.capacity
    per_gpu, accum = settled_batch(memory, auto_job(tmp_path), 2, start, budget)
    assert all(memory.peak(asked) <= budget for asked in memory.asked), memory.asked
    under_budget = int((budget - memory.fixed) // memory.per_sample)
    assert (per_gpu, accum) == kept_batch(under_budget, 2, None, 1)
    assert len(set(memory.asked)) == len(memory.asked) <= 12 and memory.asked[-1] == per_gpu  # kept, confirmed last


def test_a_failed_probe_ends_the_predicted_search_with_one_line(tmp_path):
    """The batch that ran out of memory, the largest that fit and what to do: where the kept batch's confirmation
    fails, and where the first probe does."""
    job, budget = auto_job(tmp_path), PEAK_MARGIN * 140 * GIB
    kept, _ = settled_batch(Memory(2 * GIB, 40 * 2 ** 20), job, 2, 3500, budget)
    failing = Memory(2 * GIB, 40 * 2 ** 20, fails=frozenset({kept}))
    with pytest.raises(BatchSearchFailed) as failed:
        settled_batch(failing, job, 2, 3500, budget)
    largest_fit = max(b for b in failing.asked[:-1])
    assert str(failed.value) == (f"batch.per_gpu 'auto': a step of {kept} per GPU ran out of memory (the largest "
                                 f"that fit: {largest_fit}), and this torch's FSDP cannot recover from that to probe "
                                 "again: set batch.per_gpu")
    with pytest.raises(BatchSearchFailed, match=r"a step of 4000 per GPU ran out of memory \(none fit\)"):
        settled_batch(Memory(2 * GIB, 40 * 2 ** 20), job, 2, 8000, budget)


def test_the_recovering_search_keeps_a_share_of_the_largest_fit(tmp_path):
    """With FSDP's recovery (no budget) the search probes past failures, as `largest_fitting` does; nothing
    fitting is one line too."""
    memory = Memory(2 * GIB, 40 * 2 ** 20)
    largest = largest_fitting(lambda b: memory(b)[0], 3500, 1 << 15)
    assert settled_batch(memory, auto_job(tmp_path), 2, 3500, None) == kept_batch(largest, 2, None, 1)
    with pytest.raises(BatchSearchFailed, match="not even one sample per GPU fits a step"):
        settled_batch(Memory(200 * GIB, 1), auto_job(tmp_path), 2, 64, None)


def test_the_kept_batch_leaves_a_margin_and_holds_the_global_batch():
    assert kept_batch(1000, world=2, global_batch=None, grad_accum=3) == (896, 3)  # 90%, a multiple of 8
    assert kept_batch(5, world=1, global_batch=None, grad_accum=1) == (4, 1)
    per_gpu, accum = kept_batch(1000, world=4, global_batch=4 * 1536, grad_accum=1)
    assert (per_gpu, accum) == (768, 2) and per_gpu * accum * 4 == 4 * 1536  # the largest divisor under 900
    assert kept_batch(50, world=2, global_batch=2 * 97, grad_accum=1) == (1, 97)  # a prime share


def test_a_record_is_reused_only_for_the_same_spec_world_and_gpu(tmp_path):
    job = auto_job(tmp_path)
    basis = search_basis(job, 2, "H200, 150000000000 bytes")
    assert recorded_batch(tmp_path, basis) is None
    BatchRecord(96, 1, 12.5, 128, basis, [Probe(128, False, 70.1, 3.0), Probe(107, True, 60.2, 2.5)]).save(tmp_path)
    reused = recorded_batch(tmp_path, basis)
    assert (reused.per_gpu, reused.grad_accum, reused.probes[1].fits) == (96, 1, True)
    other_model = job.model_copy(update={"freeze": job.freeze.model_copy(update={"logit_scale": True})})
    averaged = job.model_copy(update={"ema": EmaSpec()})  # its float32 shards take memory every step
    capped = job.model_copy(update={"launch": job.launch.model_copy(update={"gpu_memory_gib": 40})})
    for changed in (search_basis(job, 4, "H200, 150000000000 bytes"), search_basis(job, 2, "H100, 80 bytes"),
                    search_basis(other_model, 2, "H200, 150000000000 bytes"),
                    search_basis(averaged, 2, "H200, 150000000000 bytes"),
                    search_basis(capped, 2, "H200, 150000000000 bytes"), {**basis, "torch": "2.99.0"}):
        assert recorded_batch(tmp_path, changed) is None
    (tmp_path / "auto_batch.json").write_text("{not json")
    assert recorded_batch(tmp_path, basis) is None


@pytest.mark.slow  # two validations of a model's memory, ~4-6 s on 2 cores
def test_validate_shows_the_estimate_the_search_starts_from(tmp_path):
    report = check_job(auto_job(tmp_path, global_batch=1024), check_paths=False)
    assert not report.errors, report.errors
    batch = report.summary["batch"]
    assert batch["auto"]["capacity_gib"] == 1 and 1 <= batch["auto"]["start"] <= 512
    assert batch["per_gpu"] * batch["grad_accum"] * 2 == batch["global"] == 1024
    bigger = check_job(auto_job(tmp_path, global_batch=1 << 16).model_copy(
        update={"launch": auto_job(tmp_path).launch.model_copy(update={"gpu_memory_gib": 8})}), check_paths=False)
    assert bigger.summary["batch"]["auto"]["start"] > batch["auto"]["start"]


def test_validate_refuses_what_auto_cannot_do(tmp_path):
    job = auto_job(tmp_path, global_batch=1001, grad_accum=2)
    job = job.model_copy(update={"launch": job.launch.model_copy(update={"device": "cpu"})})
    report = check_job(job, check_paths=False)
    assert {p.location for p in report.errors} == {"batch.per_gpu", "batch.global_batch", "batch.grad_accum"}
    several_nodes = check_job(auto_job(tmp_path), world_size=4, gpus_per_node=2, check_paths=False)
    assert [p.location for p in several_nodes.errors] == ["fsdp.shard_degree"]


@pytest.mark.slow  # starts the benchmark and its launch
def test_the_benchmark_reports_the_cpu_refusal(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "auto_batch.py"), "--out", str(tmp_path),
                           "--model", TINY, "--device", "cpu", "--steps", "2"], capture_output=True, text=True,
                          timeout=300)
    row = json.loads(done.stdout.splitlines()[-1])
    assert done.returncode == row["exit"] == 2 and "per_gpu" not in row
    assert "batch.per_gpu" in row["output_tail"] and "launch.device is 'cpu'" in row["output_tail"]


def test_a_relaunch_does_not_report_the_settled_batch_as_a_change(tmp_path):
    """The checkpoint records the batch the search settled; the spec still says 'auto' (the trainer compares what
    it settles, reusing the record)."""
    from fsdpclip.jobspec.resume import spec_changes

    job = auto_job(tmp_path)
    saved = json.loads(job.with_batch(96, 1).to_json())
    assert spec_changes(saved, job) == []
    assert [c.field for c in spec_changes(saved, job.with_batch(64, 1))] == ["batch.per_gpu"]


def test_a_probe_leaves_the_batch_norms_running_statistics(tmp_path, monkeypatch):
    """A probe's forward runs in train mode on random inputs: a ModifiedResNet's BatchNorm running statistics (and
    its weights) are as they were after it, where the random batch had moved them (one probe step of a tiny RN
    tower on the CPU; the GPU's synchronisation stubbed)."""
    from types import SimpleNamespace

    import torch

    from fsdpclip.model.build import model_from_config
    from fsdpclip.model.trainable import trainable_decay_groups
    from fsdpclip.train.sizing import BatchSizing

    config = json.loads(TINY_CONFIG.read_text())
    config["vision_cfg"] = {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 16}
    model = model_from_config(config, device="cpu")
    job = auto_job(tmp_path)
    before = {name: t.clone() for name, t in [*model.named_buffers(), *model.named_parameters()]}
    moved = []
    model.visual.bn1.register_forward_hook(lambda *_: moved.append(model.visual.bn1.running_mean.clone()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    sizing = BatchSizing(job, SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1))
    assert sizing.probe_step(model, trainable_decay_groups(model, job.optimizer), 4)
    assert moved and not torch.equal(moved[0], before["visual.bn1.running_mean"])
    assert before["visual.bn1.num_batches_tracked"] == 0
    after = {name: t for name, t in [*model.named_buffers(), *model.named_parameters()]}
    assert [name for name in before if not torch.equal(before[name], after[name])] == []
