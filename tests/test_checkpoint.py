"""Sharded checkpoints: exact resume, other world sizes, preemption, bad steps, crashes, export."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import PREEMPTIBLE_STEPS, TINY_CONFIG, assert_same_losses, preemptible_job, squeezed, write_job
from ranks import run_group, torchrun
from fsdpclip.checkpoint.layout import complete_checkpoints, latest_checkpoint
from fsdpclip.jobspec.resume import Change

STEPS = 12


def _plain_job(tmp_path, name: str = "plain", **extra) -> dict:
    """A tiny 2-rank fp32 job on synthetic data: STEPS steps, a checkpoint every 4 (2 kept); `extra`
    blocks are merged into it."""
    job = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 7},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32", "reduce_dtype": "fp32"},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.2, "grad_clip_norm": 1.0},
        "schedule": {"kind": "cosine", "warmup_steps": 2, "steps": STEPS},
        "data": {"source": "synthetic"},
        "batch": {"per_gpu": 8},
        "checkpoint": {"every_steps": 4, "keep": 2},
        "logging": {"every_steps": 1},
        "launch": {"gpus_per_node": 2, "device": "cpu", "collective_timeout_s": 60},
    }
    for key, value in extra.items():
        job[key] = {**job.get(key, {}), **value}
    return job


def _launch(path, *extra: str):
    return run_group([sys.executable, "-m", "fsdpclip", "launch", str(path), *extra], timeout=300)


def _with_fault(path, fault: str, nproc: int = 2):
    return torchrun(["tests/workers/faults.py", str(path), fault], nproc=nproc, timeout=300)


def _losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
def test_slow_steps_are_checked_for_a_stop_more_often(tmp_path, digits_dir):
    """Where steps are slow (1.5 s more each here), the ranks agree on a stop every few steps (paced after
    the first step) instead of every 10: SIGUSR1 on rank 1 after step 3 stops the run after step 5 at the
    latest (10 steps apart, after step 10), with its checkpoint and exit 75, and before the evaluation
    due at that step."""
    job = preemptible_job(tmp_path / "runs", digits_dir, "slow")
    job["eval"] = {"zeroshot": [{"dataset": "digits", "path": str(digits_dir / "test"), "max_samples": 8}],
                   "every_steps": 5, "batch_per_gpu": 8}
    run = _with_fault(write_job(tmp_path, job), "slow:1.5+signal:1:3")
    run_dir = tmp_path / "runs" / "slow"
    report = json.loads((run_dir / "exit.json").read_text())
    assert report["code"] == 75 and "SIGUSR1 received" in report["message"], run.stdout[-4000:]
    assert latest_checkpoint(run_dir).name in ("step-00000004", "step-00000005"), report["message"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if "zeroshot/digits" in r]  # the stop came first


def test_stop_check_interval():
    """Divisors of 10 steps, as many as fit in 10 s; every step once a step takes longer than 5 s."""
    from fsdpclip.train.stops import stop_check_interval

    assert [stop_check_interval(s) for s in (0.01, 1.0, 1.5, 2.0, 3.0, 5.0, 6.0, 60.0)] == [10, 10, 5, 5, 2, 2, 1, 1]


@pytest.mark.slow
def test_preempted_run_resumes_exactly(tmp_path, digits_dir, straight_losses):
    """SIGUSR1 on rank 1 alone at step 5: the ranks agree at their next stop check (step 10; step 5 where a
    loaded machine makes steps take over a second), checkpoint and exit 75. Resumed in the same run directory
    while rank 1 sees an older checkpoint as `latest` (rank 0 chooses for all), the run ends with the losses of
    one never stopped; the same checkpoint also resumes on one rank (resharded)."""
    job = preemptible_job(tmp_path / "runs", digits_dir, "split")
    job["checkpoint"] = {"every_steps": 4, "keep": 3}
    path = write_job(tmp_path, job)
    first = _with_fault(path, "signal:1:5")  # SIGUSR1 on rank 1 only
    run_dir = tmp_path / "runs" / "split"
    report = json.loads((run_dir / "exit.json").read_text())
    assert report["code"] == 75, first.stdout[-4000:]
    stopped = report["step"]
    assert stopped in (5, 10), report  # the stop checks' multiples (`stop_check_interval`)
    assert "SIGUSR1 received" in report["message"] and f"step-{stopped:08d}" in report["message"]
    assert latest_checkpoint(run_dir).name == f"step-{stopped:08d}"
    shutil.copytree(run_dir, tmp_path / "copy")
    second = _with_fault(path, f"stale-latest:1:{(stopped - 1) // 4 * 4}")  # the periodic save before the stop
    assert second.returncode == 0, second.stdout[-4000:]
    assert "resumed from" in second.stdout and f"step-{stopped:08d}" in second.stdout
    assert_same_losses(run_dir, straight_losses)

    one = json.loads(path.read_text())  # the same checkpoint on one rank (global batch kept)
    one["run"]["output_dir"] = str(tmp_path / "one")
    (tmp_path / "one").mkdir()
    shutil.copytree(tmp_path / "copy", tmp_path / "one" / "split")
    third = _launch(write_job(tmp_path, one, "one.json"), "--nproc-per-node", "1", "--set", "batch.per_gpu=32")
    assert third.returncode == 0, third.stdout[-4000:]
    assert "saved by 2 ranks, this run has 1" in third.stdout
    resumed = _losses(tmp_path / "one" / "split")
    assert max(resumed) == PREEMPTIBLE_STEPS and all(torch.isfinite(torch.tensor(v)) for v in resumed.values())


@pytest.mark.slow
def test_resume_across_mesh_shapes(tmp_path, cli):
    """A checkpoint of 4 ranks as HSDP 2 × 2 resumes as full FSDP over 4 with the losses of the run that
    went straight on (fp32), and both runs' last checkpoints load on one process (export) to the same
    weights, and to the same moving average of them (`export --ema`: resharded as the weights)."""
    def job(name: str, degree, resume: str = "latest") -> Path:
        spec = _plain_job(tmp_path, name, fsdp={"shard_degree": degree}, launch={"gpus_per_node": 4},
                          checkpoint={"every_steps": 4, "keep": 3, "resume": resume}, ema={"decay": 0.9})
        return write_job(tmp_path, spec, f"{name}.json")

    straight = _launch(job("hsdp", 2))
    assert straight.returncode == 0, straight.stdout[-4000:]
    assert squeezed("2 replica(s) × shard groups of 2") in squeezed(straight.stdout)
    as_fsdp = _launch(job("fsdp", 4, str(tmp_path / "runs" / "hsdp" / "checkpoints" / "step-00000004")))
    assert as_fsdp.returncode == 0, as_fsdp.stdout[-4000:]
    assert "resumed from" in as_fsdp.stdout and "fsdp.shard_degree: 2 → 4" in as_fsdp.stdout
    expected, resumed = _losses(tmp_path / "runs" / "hsdp"), _losses(tmp_path / "runs" / "fsdp")
    assert sorted(resumed) == list(range(5, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(expected[step], abs=1e-5), step
    for flags in ([], ["--ema"]):
        weights = {}
        for name in ("hsdp", "fsdp"):
            result = cli("export", tmp_path / "runs" / name, tmp_path / f"{name}.pt", "--force", *flags)
            assert result.exit_code == 0, result.stdout
            weights[name] = torch.load(tmp_path / f"{name}.pt", map_location="cpu")
        assert weights["hsdp"].keys() == weights["fsdp"].keys()
        for key, tensor in weights["hsdp"].items():
            torch.testing.assert_close(weights["fsdp"][key], tensor, rtol=0, atol=1e-5, msg=key)


def _resumed_copy(run_dir: Path, at: int, copy: Path) -> Path:
    """`run_dir` copied to `copy` as a run stopped at step `at`: later checkpoints and metrics removed."""
    shutil.copytree(run_dir, copy)
    for checkpoint in (copy / "checkpoints").glob("step-*"):
        if int(checkpoint.name.split("-")[1]) > at:
            shutil.rmtree(checkpoint)
    (copy / "checkpoints" / "latest").write_text(f"step-{at:08d}")
    records = (json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines())
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r.get("step", 0) <= at))
    return copy


def _data_positions(checkpoint: Path) -> dict[str, dict]:
    """Each data stream's position saved in `checkpoint`, by stream."""
    found = {}
    world, streams = (json.loads((checkpoint / "meta.json").read_text())[k] for k in ("world_size", "data_ranks"))
    for rank in range(world):
        data = torch.load(checkpoint / f"rank-{rank:05d}.pt", weights_only=True)["data"]
        found.update(data["streams"] if streams > world else {str(rank): data})
    return found


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.fixture(scope="module")
def finished_two_rank_run(tmp_path_factory) -> tuple[Path, Path]:
    """The plain job as 2 epochs of 96 samples (STEPS steps) run to its end on 2 ranks, checkpoints at steps 4, 8 and
    12: (its spec, its run directory)."""
    tmp_path = tmp_path_factory.mktemp("straight")
    path = write_job(tmp_path, _plain_job(tmp_path, "straight", checkpoint={"every_steps": 4, "keep": 3},
                                          schedule={"steps": None, "epochs": 2}, data={"samples": 96}))
    straight = _launch(path)
    assert straight.returncode == 0, straight.stdout[-4000:]
    return path, tmp_path / "runs" / "straight"


@pytest.mark.slow
def test_a_run_resumed_on_one_rank_and_again_on_two_keeps_its_meaning(tmp_path, finished_two_rank_run):
    """A 2-rank run of 8 per GPU (global batch 16) resumed at step 4 on one rank: launch keeps the global batch
    (grad_accum 2) and the schedule, the one rank reads both ranks' data streams in turn; resumed again at step
    8 on two ranks, each goes on with its own stream. Every step's LR is the uninterrupted run's, each
    resumed first step's loss too (the same weights and samples), the later ones within the accumulation's
    rounding; the data positions saved at step 8 and 12 are the uninterrupted run's."""
    path, straight = finished_two_rank_run
    expected = _records(straight)

    one = _resumed_copy(straight, 4, tmp_path / "one" / "straight")
    on_one = _launch(path, "--nproc-per-node", "1", "--set", f"run.output_dir={tmp_path / 'one'}")
    assert on_one.returncode == 0, on_one.stdout[-4000:]
    assert squeezed("the global batch of 16 kept on 1 rank(s)") in squeezed(on_one.stdout)
    assert "the 2 data streams go on where they stopped" in on_one.stdout
    assert json.loads((one / "job.json").read_text())["batch"]["grad_accum"] == 2
    assert _data_positions(one / "checkpoints" / "step-00000008") == _data_positions(
        straight / "checkpoints" / "step-00000008")

    two = _resumed_copy(one, 8, tmp_path / "two" / "straight")
    on_two = _launch(path, "--set", f"run.output_dir={tmp_path / 'two'}")
    assert on_two.returncode == 0, on_two.stdout[-4000:]
    assert json.loads((two / "job.json").read_text())["batch"]["grad_accum"] == 1
    assert _data_positions(two / "checkpoints" / "step-00000012") == _data_positions(
        straight / "checkpoints" / "step-00000012")

    resumed = _records(two)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step, record in resumed.items():
        assert record["total_steps"] == STEPS and record["lr"] == pytest.approx(expected[step]["lr"], rel=1e-9)
        close = 1e-6 if step <= 5 else 5e-4  # measured: 4e-8 at step 5, at most 6e-5 after
        assert record["loss"] == pytest.approx(expected[step]["loss"], rel=close), step


@pytest.mark.slow
def test_relaunches_that_change_the_run_are_refused_unless_accepted(tmp_path, cli, finished_two_rank_run):
    """Before any step, validate and launch name each consequence of a relaunch that changes the run, and refuse
    it without --accept-changes (exit 2, no rank started): from step 4 on 3 ranks, which do not divide the global
    batch of 16 (the global batch, the length, the LR at the resume step); the finished cosine run lengthened
    (its LR jumps from 0). The rank entry started by hand on one process refuses the 2-rank run too."""
    path, straight = finished_two_rank_run
    at_four = _resumed_copy(straight, 4, tmp_path / "runs" / "straight")
    here = ("--set", f"run.output_dir={tmp_path / 'runs'}")
    code, out = cli.validate_json(path, *here, "--set", "launch.gpus_per_node=3")
    assert code == 2, out
    assert [(e["location"], e["message"].split(": ", 1)[1]) for e in out["errors"]] == [
        ("batch", "the global batch 16 → 24 samples a step (per_gpu × grad_accum × ranks: 8 × 1 × 3; the "
                  "checkpoint's 8 × 1 × 2)"),
        ("schedule", "the run's length 12 → 9 steps"),
        ("schedule", "the LR of step 5, where it resumes: 0.000905 → 0.000812 (its schedule recomputed over the new "
                     "length)")]
    refused = cli("launch", path, *here, "--nproc-per-node", "3")
    assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output[-3000:]
    assert squeezed("the global batch 16 → 24") in squeezed(refused.output)
    assert not (at_four / "launches").exists() or len(list((at_four / "launches").glob("*.json"))) == 1
    code, out = cli.validate_json(path, *here, "--set", "launch.gpus_per_node=3", "--accept-changes")
    assert code == 0 and {"batch", "schedule"} <= {w["location"] for w in out["warnings"]}, out

    longer = ("--set", f"run.output_dir={straight.parent}", "--set", "schedule.epochs=4")
    code, out = cli.validate_json(path, *longer)
    assert code == 2 and [e["message"].split(": ", 1)[1] for e in out["errors"]] == [
        "the LR of step 13, where it resumes: 0 → 0.000571 (its schedule recomputed over the new length)"], out
    assert "the run's length 12 → 24 steps" in {w["message"].split(" (", 1)[1].split("):")[0].split(": ", 1)[1]
                                                 for w in out["warnings"] if w["location"] == "schedule"}
    assert cli.validate_json(path, *longer, "--accept-changes")[0] == 0

    by_hand = json.loads((at_four / "job.json").read_text())
    by_hand["run"]["output_dir"] = str(tmp_path / "runs")
    rank = run_group([sys.executable, "-m", "fsdpclip", "train", str(write_job(tmp_path, by_hand))], timeout=240)
    assert rank.returncode == 2 and "Traceback" not in rank.stdout, rank.stdout[-3000:]
    assert squeezed("the global batch 16 → 8") in squeezed(rank.stdout) and "fsdpclip launch" in rank.stdout
    assert max(_records(at_four)) == 4


def test_what_a_relaunch_on_other_ranks_keeps_and_what_it_changes(tmp_path):
    """The global batch a relaunch keeps: grad_accum where per_gpu divides the ranks' share (2 × 32 on 1 rank:
    32 × 2; 1 × 32 × 2 on 2 ranks: 32 × 1), else the largest per_gpu that does (3 ranks × 8 → 2 ranks: 12 → 6 ×
    2); 'auto' gets global_batch; a global_batch asked for, or ranks that do not divide it, are left to be
    refused. A finished constant schedule lengthened goes on at its LR (no consequence); a cosine's jumps."""
    from fsdpclip.jobspec.jobfile import parse_job
    from fsdpclip.jobspec.resume import consequences, kept_batch

    def job(ranks: int, per_gpu, accum: int = 1, **blocks):
        spec = _plain_job(tmp_path, batch={"per_gpu": per_gpu, "grad_accum": accum}, launch={"gpus_per_node": ranks})
        return parse_job({**spec, **{k: {**spec.get(k, {}), **v} for k, v in blocks.items()}})

    def meta(saved, step: int = 4) -> dict:
        world = saved.launch.world_size
        return {"job": json.loads(saved.to_json()), "world_size": world, "step": step,
                "samples_seen": step * saved.samples_per_step(world)}

    def batch(kept) -> tuple:
        return kept.batch.per_gpu, kept.batch.grad_accum, kept.batch.global_batch

    assert batch(kept_batch(job(1, 32), meta(job(2, 32)), 1)) == (32, 2, None)
    assert batch(kept_batch(job(2, 32, 2), meta(job(1, 32, 2)), 2)) == (32, 1, None)
    assert batch(kept_batch(job(2, 8), meta(job(3, 8)), 2)) == (6, 2, None)
    assert batch(kept_batch(job(1, 32), meta(job(1, 32, 2)), 1)) == (32, 2, None)  # the spec as written, after 2 → 1
    assert batch(kept_batch(job(2, 8, batch={"global_batch": 16}), meta(job(1, 8, 2, batch={"global_batch": 16})),
                            2)) == (8, 1, 16)
    assert batch(kept_batch(job(1, "auto"), meta(job(2, 32)), 1)) == ("auto", 1, 64)
    for spec, world in ((job(3, 32), 3), (job(1, 32, batch={"global_batch": 32}), 1)):
        assert kept_batch(spec, meta(job(2, 32)), world) is spec
    assert [c.field for c in consequences(meta(job(2, 32)), job(3, 32), 3, []) if c.consequence] == ["batch"]

    constant = {"schedule": {"kind": "constant"}}
    finished = meta(job(2, 8, **constant), STEPS)
    longer = job(2, 8, schedule={"kind": "constant", "steps": 20})
    changes = [Change("schedule.steps", STEPS, 20)]
    assert [(str(c), c.consequence) for c in consequences(finished, longer, 2, changes)] == [
        (f"schedule: the run's length {STEPS} → 20 steps", False)]
    cosine = consequences(meta(job(2, 8), STEPS), job(2, 8, schedule={"steps": 20}), 2, changes)
    assert [c.consequence for c in cosine] == [False, True] and cosine[1].before == 0


@pytest.mark.slow
def test_a_wsd_run_stopped_and_lengthened_goes_on_at_its_peak(tmp_path):
    """A wsd run of 16 steps (its decay the last quarter) stopped in its stable phase (at step 5 or 10, SIGUSR1) and
    relaunched with 24 steps resumes without `accept_changes`: the LR where it resumes is the same, the decay moves
    to the new end, and every step ran at the LR of a run of 24 steps from the start."""
    from fsdpclip.jobspec.jobfile import parse_job

    job = _plain_job(tmp_path, "wsd", schedule={"kind": "wsd", "steps": 16, "decay_fraction": 0.25},
                     launch={"gpus_per_node": 1})
    path = write_job(tmp_path, job)
    first = _with_fault(path, "signal:0:3", nproc=1)
    run_dir = tmp_path / "runs" / "wsd"
    report = json.loads((run_dir / "exit.json").read_text())
    stopped = report["step"]
    assert report["code"] == 75 and stopped in (5, 10), first.stdout[-4000:]
    relaunched = _launch(path, "--set", "schedule.steps=24")
    assert relaunched.returncode == 0, relaunched.stdout[-4000:]
    assert f"at step {stopped}" in relaunched.stdout and "schedule.steps: 16 → 24" in relaunched.stdout
    assert "the LR of step" not in relaunched.stdout
    longer = parse_job({**job, "schedule": {**job["schedule"], "steps": 24}})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in records if "loss" in r}
    assert sorted(logged) == list(range(1, 25))
    assert [logged[step] for step in sorted(logged)] == pytest.approx([longer.lr(i, 24) for i in range(24)], rel=1e-9)
    assert logged[stopped + 1] == logged[18] == 1e-3 > logged[20]


@pytest.mark.slow
def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    path = write_job(tmp_path, _plain_job(tmp_path, "crash"))
    crashed = _with_fault(path, "crash-save:1:2")  # dies in its second save (step 8)
    assert crashed.returncode != 0
    run_dir = tmp_path / "runs" / "crash"
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-00000004"]
    assert latest_checkpoint(run_dir).name == "step-00000004"
    assert (run_dir / "checkpoints" / "step-00000008.partial").is_dir()
    resumed = _launch(path)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "resumed from" in resumed.stdout and "step-00000004" in resumed.stdout
    assert not list((run_dir / "checkpoints").glob("*.partial"))
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-00000008", "step-00000012"]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> Path:
    """The plain job launched to its end, its checkpoints (steps 4, 8, 12) saved in the background: its run
    directory, which the tests only read or copy."""
    tmp = tmp_path_factory.mktemp("plain")
    result = _launch(write_job(tmp, _plain_job(tmp, checkpoint={"async_save": True})))
    assert result.returncode == 0, result.stdout[-3000:]
    return tmp / "runs" / "plain"


@pytest.mark.slow
def test_rank_state_damaged_after_the_check_falls_back_on_every_rank(tmp_path, plain_run):
    """Rank 1's state file in the newest checkpoint is damaged after rank 0 chose it (between the check and the
    load): every rank learns it before anything is loaded, and all resume from the checkpoint before it."""
    shutil.copytree(plain_run, tmp_path / "runs" / "plain")
    longer = write_job(tmp_path, _plain_job(tmp_path, schedule={"steps": STEPS + 4},
                                         checkpoint={"async_save": True, "accept_changes": True}),
                       "longer.json")
    resumed = _with_fault(longer, "damage-rank-state:1")
    checkpoints = tmp_path / "runs" / "plain" / "checkpoints"
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"{checkpoints / 'step-00000012'} cannot be read: rank-00001.pt is truncated or damaged" in resumed.stdout
    assert f"resumed from {checkpoints / 'step-00000008'} at step 8" in resumed.stdout
    assert max(_losses(tmp_path / "runs" / "plain")) == STEPS + 4


@pytest.mark.slow
def test_non_finite_step_is_skipped(tmp_path):
    path = write_job(tmp_path, _plain_job(tmp_path, "skip", schedule={"steps": 6}))
    proc = _with_fault(path, "nan:3")
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "skip" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]  # not the checkpoints' records
    assert train[-1]["skipped_steps"] == 1 and train[-1]["step"] == 6
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train if r["step"] != 3)


@pytest.mark.slow
def test_non_finite_step_stops_with_last_checkpoint(tmp_path):
    path = write_job(tmp_path, _plain_job(tmp_path, "stop", optimizer={"on_nonfinite": "stop"}))
    proc = _with_fault(path, "nan:6")
    run_dir = tmp_path / "runs" / "stop"
    report = json.loads((run_dir / "exit.json").read_text())
    assert report["code"] == 65, proc.stdout[-4000:]
    assert "step 6" in report["message"] and str(run_dir / "checkpoints" / "step-00000004") in report["message"]
    assert latest_checkpoint(run_dir).name == "step-00000004"


def _saved(checkpoint: Path, part: str) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds under `part` ("model", "ema"), by name, read straight from its DCP files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(checkpoint))
    held = {key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
            for key, item in reader.read_metadata().state_dict_metadata.items() if key.startswith(part + ".")}
    if held:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(held, storage_reader=reader, no_dist=True)
    return {key.removeprefix(part + "."): tensor for key, tensor in held.items()}


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory) -> tuple[Path, Path]:
    """The plain job with an `ema` block (decay 0.9) and its temperature frozen, launched to its end with its
    checkpoints (steps 4, 8, 12) saved in the background: (its spec, its run directory)."""
    tmp = tmp_path_factory.mktemp("ema")
    path = write_job(tmp, _plain_job(tmp, "ema", ema={"decay": 0.9}, freeze={"logit_scale": True},
                                     checkpoint={"every_steps": 4, "keep": 3, "async_save": True}))
    result = _launch(path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "reserved for its host copy" not in result.stdout  # the host copy's reservation holds the average too
    return path, tmp / "runs" / "ema"


@pytest.mark.slow
def test_a_resumed_run_goes_on_with_its_moving_average(tmp_path, ema_run, cli, digits_dir):
    """Stopped at step 4 (an asynchronous save) and resumed on its 2 ranks, the run's moving average at step 12 is
    the uninterrupted run's (within 1e-6), and not its weights. Resumed at step 8 with `ema` 'auto', a note says
    the checkpoint's average is left unused; its last checkpoint holds none, and `export --ema` and `eval --ema`
    say so in one line."""
    path, straight = ema_run
    again = _resumed_copy(straight, 4, tmp_path / "again" / "ema")
    resumed = _launch(path, "--set", f"run.output_dir={tmp_path / 'again'}")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout[-3000:]
    last = Path("checkpoints") / "step-00000012"
    expected, found = _saved(straight / last, "ema"), _saved(again / last, "ema")
    weights = _saved(straight / last, "model")
    assert "visual.conv1.weight" in expected and "logit_scale" not in expected and found.keys() == expected.keys()
    assert max((found[name] - expected[name]).abs().max().item() for name in expected) <= 1e-6
    assert max((weights[name] - expected[name]).abs().max().item() for name in expected) > 1e-4

    off = _resumed_copy(straight, 8, tmp_path / "off" / "ema")
    without = _launch(path, "--set", f"run.output_dir={tmp_path / 'off'}", "--set", "ema=auto")
    assert without.returncode == 0, without.stdout[-3000:]
    assert squeezed("step-00000008 holds a moving average of the weights, left unused") in squeezed(without.stdout)
    assert _saved(off / last, "ema") == {} and _saved(off / last, "model")
    for command in (["export", off, tmp_path / "off.pt"], ["eval", off, "--zeroshot", "digits", "--data",
                                                            digits_dir / "test"]):
        refused = cli(*command, "--ema")
        assert refused.exit_code != 0 and squeezed(f"{off / last} holds no moving average of the weights (--ema): "
                                                   "its run had no `ema` block") in squeezed(refused.output)
    assert not (tmp_path / "off.pt").exists()


@pytest.mark.slow
def test_a_run_without_a_moving_average_resumed_with_one_starts_it_from_its_weights(tmp_path, plain_run):
    """A checkpoint of a run without an `ema` block resumed with one (updated every 100 steps: not before the run's
    end): a warning says so, and the average its last checkpoint holds is the resumed weights."""
    copy = _resumed_copy(plain_run, 8, tmp_path / "on" / "plain")
    resumed = _launch(copy / "job.json", "--set", f"run.output_dir={tmp_path / 'on'}",
                      "--set", 'ema={"every_steps": 100}')
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert squeezed("step-00000008 holds no moving average of the weights: the `ema` block's starts from its "
                    "weights at step 8") in squeezed(resumed.stdout)
    averages = _saved(copy / "checkpoints" / "step-00000012", "ema")
    weights = _saved(copy / "checkpoints" / "step-00000008", "model")
    assert averages and all(torch.equal(averages[name], weights[name]) for name in averages)


@pytest.fixture(scope="module")
def trained_for_export(tmp_path_factory):
    """A checkpointed 2-rank run and the encodings of its sharded model."""
    tmp = tmp_path_factory.mktemp("export")
    out = tmp / "trained.json"
    job = _plain_job(tmp, "parity", schedule={"steps": 6}, checkpoint={"every_steps": None})
    proc = torchrun(["tests/workers/train_checks.py", "export", str(out), str(write_job(tmp, job))])
    assert proc.returncode == 0, proc.stdout[-4000:]
    return tmp / "runs" / "parity", json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("target", ["model.pt", "model.safetensors", "local-dir"])
def test_export_loads_in_open_clip(tmp_path, target, cli, trained_for_export, monkeypatch):
    """The export loads in OpenCLIP by the Python line it prints, into an OpenCLIP that does not know the tiny model
    (as a new interpreter's): a weights file by the model's name, its config registered from the file beside it."""
    from open_clip import factory

    run_dir, trained = trained_for_export
    exported = tmp_path / target
    result = cli("export", run_dir, exported)
    assert result.exit_code == 0, result.output
    [line] = [line.removeprefix("in Python: ") for line in result.output.splitlines() if line.startswith("in Python: ")]
    if target == "model.pt":
        again = cli("export", run_dir, tmp_path / "again.pt")  # the same model's config beside it: kept
        assert again.exit_code == 0, again.output
        kept = (tmp_path / "tiny-clip.json").read_text()
        (tmp_path / "tiny-clip.json").write_text("{}")  # another model's: refused, unless --force
        refused = cli("export", run_dir, tmp_path / "third.pt")
        assert refused.exit_code == 2 and "tiny-clip.json exists" in refused.output, refused.output
        assert not (tmp_path / "third.pt").exists()
        (tmp_path / "tiny-clip.json").write_text(kept)
    monkeypatch.setattr(factory, "_MODEL_CONFIG_PATHS",
                        [path for path in factory._MODEL_CONFIG_PATHS if Path(path) != TINY_CONFIG])
    monkeypatch.setattr(factory, "_MODEL_CONFIGS",
                        {name: cfg for name, cfg in factory._MODEL_CONFIGS.items() if name != TINY_CONFIG.stem})
    loaded = {}
    exec(line, loaded)
    model = loaded["model"]
    if target != "local-dir":
        assert (tmp_path / "tiny-clip.json").is_file() and f"create_model_and_transforms('tiny-clip', " in line
    assert model.logit_scale.shape == ()
    torch.manual_seed(123)
    images = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        model.eval()
        assert torch.allclose(model.encode_image(images), torch.tensor(trained["encode_image"]), atol=1e-5)
        texts = torch.randint(1, 1000, (3, 16))
        assert torch.allclose(model.encode_text(texts), torch.tensor(trained["encode_text"]), atol=1e-5)
    if target == "model.pt":
        _starts_from(exported, model.state_dict(), tmp_path)


@pytest.mark.slow
def test_export_ema_writes_the_moving_average(tmp_path, cli, ema_run):
    """`export --ema` writes the moving average the checkpoint holds where it holds one (every trained tensor), the
    weights trained elsewhere (the frozen temperature): another file than the plain export, which is the weights."""
    from safetensors.torch import load_file

    _, run = ema_run
    plain = cli("export", run, tmp_path / "plain.safetensors")
    averaged = cli("export", run, tmp_path / "ema.safetensors", "--ema")
    assert plain.exit_code == 0 and averaged.exit_code == 0, averaged.output
    assert squeezed("(step 12, its moving average) →") in squeezed(averaged.output)
    exported = {name: load_file(tmp_path / f"{name}.safetensors") for name in ("plain", "ema")}
    latest = run / "checkpoints" / "step-00000012"
    held, weights = _saved(latest, "ema"), _saved(latest, "model")
    assert exported["ema"].keys() == exported["plain"].keys() == weights.keys() and "logit_scale" not in held
    for name, tensor in exported["ema"].items():
        assert torch.equal(exported["plain"][name].reshape(weights[name].shape), weights[name]), name
        assert torch.equal(tensor.reshape(weights[name].shape), held.get(name, weights[name])), name
    assert all(not torch.equal(exported["ema"][name], exported["plain"][name]) for name in held if "weight" in name)


def _starts_from(exported, weights: dict, tmp_path) -> None:
    """A new run's initial model from `model.pretrained` (the whole exported file) is those weights; from
    `model.image.pretrained` / `model.text.pretrained` (keys relative to the tower) only that tower's."""
    from fsdpclip.model.weights import initial_model
    from fsdpclip.jobspec.job import ModelSpec

    def state(**spec) -> dict:
        return {k: v.reshape(weights[k].shape) for k, v in
                initial_model(ModelSpec(config=str(TINY_CONFIG), **spec), seed=1, init="openclip").state_dict().items()}

    assert all(torch.equal(v, weights[k]) for k, v in state(pretrained=str(exported)).items())
    fresh = state()
    image = {k.removeprefix("visual."): v for k, v in weights.items() if k.startswith("visual.")}
    text = {k: v for k, v in weights.items() if not k.startswith("visual.") and not k.startswith("logit_")}
    torch.save(image, tmp_path / "image.pt")
    torch.save(text, tmp_path / "text.pt")
    for tower, part in (("image", state(image={"pretrained": str(tmp_path / "image.pt")})),
                        ("text", state(text={"pretrained": str(tmp_path / "text.pt")}))):
        for key, value in part.items():
            loaded = key.startswith("visual.") == (tower == "image") and not key.startswith("logit_")
            assert torch.equal(value, weights[key] if loaded else fresh[key]), (tower, key)


def test_export_rejects_what_is_not_a_checkpoint(tmp_path, cli):
    result = cli("export", tmp_path, tmp_path / "out.pt")
    assert result.exit_code == 2
    assert squeezed("neither a complete checkpoint") in squeezed(result.output)


def test_export_of_a_pruned_checkpoint_lists_those_that_exist(tmp_path, cli):
    """A checkpoint removed by checkpoint.keep (or mistyped): the error names the run's complete checkpoints."""
    checkpoints = tmp_path / "run" / "checkpoints"
    for name in ("step-00000200", "step-00000300"):
        (checkpoints / name).mkdir(parents=True)
        (checkpoints / name / "meta.json").write_text("{}")
    (checkpoints / "step-00000400.partial").mkdir()
    result = cli("export", checkpoints / "step-00000100", tmp_path / "out.pt")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert squeezed(f"{checkpoints} holds step-00000200, step-00000300 (checkpoint.keep") in squeezed(result.output)
    (checkpoints / "step-00000200" / "meta.json").unlink()
    (checkpoints / "step-00000300" / "meta.json").unlink()
    result = cli("export", tmp_path / "run", tmp_path / "out.pt")
    assert squeezed(f"{checkpoints} holds no complete checkpoint") in squeezed(result.output)


def test_export_ema_of_a_checkpoint_whose_metadata_is_damaged_says_so(tmp_path, cli):
    """`--ema` reads which tensors a checkpoint averages from its DCP metadata: where that cannot be read, one line
    says so and nothing is written."""
    checkpoint = tmp_path / "runs" / "r" / "checkpoints" / "step-00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text(json.dumps({"step": 4, "world_size": 1, "model": {}}))
    (checkpoint / ".metadata").write_bytes(b"not a pickle")
    result = cli("export", checkpoint, tmp_path / "out.pt", "--ema")
    assert result.exit_code != 0
    assert squeezed(f"{checkpoint} cannot be read: its DCP metadata") in squeezed(result.output)
    assert not (tmp_path / "out.pt").exists()


def test_export_refuses_to_overwrite_without_force(tmp_path, cli):
    """An existing weights file, or a local-dir folder holding a config or weights, is kept (it was overwritten
    silently), as `init` keeps an existing spec; refused before the checkpoint is read."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text("{}")
    (tmp_path / "model.pt").write_text("kept")
    (tmp_path / "local-dir").mkdir()
    (tmp_path / "local-dir" / "open_clip_model.safetensors").write_text("kept")
    for out, flags, existing in ((tmp_path / "model.pt", [], tmp_path / "model.pt"),
                                 (tmp_path / "local-dir", ["--safetensors"],
                                  tmp_path / "local-dir" / "open_clip_model.safetensors")):
        result = cli("export", tmp_path / "run", out, *flags)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert squeezed(f"{existing} exists: give another path, or --force to overwrite it") in squeezed(result.output)
        assert existing.read_text() == "kept"
    assert not (tmp_path / "local-dir" / "open_clip_config.json").exists()


def test_a_latest_naming_another_runs_checkpoint_is_not_followed(tmp_path, cli):
    """`checkpoints/latest` holding a path (another run's checkpoint, relative or absolute) instead of a checkpoint
    name: export and eval take the run's own newest checkpoint, or say it holds none."""
    from fsdpclip.checkpoint.layout import resolve_checkpoint

    other = tmp_path / "other" / "checkpoints" / "step-00000004"
    own = tmp_path / "run" / "checkpoints" / "step-00000002"
    for checkpoint in (other, own):
        checkpoint.mkdir(parents=True)
        (checkpoint / "meta.json").write_text("{}")
    for named in ("../../other/checkpoints/step-00000004", str(other)):
        (own.parent / "latest").write_text(named + "\n")
        assert resolve_checkpoint(tmp_path / "run") == own, named
    (own / "meta.json").unlink()
    result = cli("export", tmp_path / "run", tmp_path / "out.pt")
    assert result.exit_code == 2 and not (tmp_path / "out.pt").exists(), result.output
    assert squeezed(f"{own.parent} holds no complete checkpoint") in squeezed(result.output)


@pytest.mark.slow
def test_export_to_an_impossible_destination(tmp_path, cli, trained_for_export):
    """A destination under a file, or in /proc: one line naming it, exit 2, before the model is read."""
    run_dir, _ = trained_for_export
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file" / "model.pt", Path("/proc/fsdpclip/model.pt"), tmp_path / "file" / "dir"):
        result = cli("export", run_dir, out)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert squeezed(f"cannot write {out}") in squeezed(result.output)


@pytest.mark.slow
def test_launch_exits_with_the_trainers_code_on_divergence(tmp_path):
    """A real divergence (absurd LR) stops the run; `fsdpclip launch` returns the documented 65."""
    job = _plain_job(tmp_path, optimizer={"lr": 1e12, "on_nonfinite": "stop"},
                      schedule={"kind": "constant", "steps": 20})
    proc = _launch(write_job(tmp_path, job))
    assert proc.returncode == 65, proc.stdout[-4000:]
    assert "is not finite" not in proc.stdout  # stopped, not skipped
    assert "stopped; the last good checkpoint is none" in proc.stdout


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_values_and_weights_that_would_run_code_are_refused(tmp_path):
    """A non-tensor value of a DCP checkpoint (DCP itself unpickles those with weights_only=False) and OpenCLIP
    weights files (a state dict, a whole-model checkpoint) holding a pickle that would create a file: refused,
    naming the file or value and what the pickle names; nothing runs. Plain values still load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from conftest import RunsCode
    from fsdpclip.model.pickles import SafeLoadPlanner, SafeReader
    from fsdpclip.model.build import model_from_config
    from fsdpclip.model.weights import load_model_weights, read_state_dict
    from fsdpclip.jobspec.problems import ModelError

    marker, system = tmp_path / "code-ran", f"{os.system.__module__}.system"
    saved = {"lr": 0.25, "betas": (0.9, 0.98), "step": torch.ones(2)}
    dcp.save({**saved, "planted": RunsCode(marker)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    loaded = {"lr": 0.0, "betas": None, "step": torch.zeros(2)}
    dcp.load(loaded, storage_reader=SafeReader(str(tmp_path / "dcp")), planner=SafeLoadPlanner(), no_dist=True)
    assert loaded["lr"] == 0.25 and loaded["betas"] == (0.9, 0.98) and loaded["step"].tolist() == [1.0, 1.0]
    with pytest.raises(CheckpointException, match=f"the value of planted holds a pickle that names {system}"):
        dcp.load({"planted": None}, storage_reader=SafeReader(str(tmp_path / "dcp")), planner=SafeLoadPlanner(),
                 no_dist=True)

    weights = tmp_path / "weights.pt"
    torch.save({"state_dict": {"visual.proj": RunsCode(marker)}}, weights)
    model = model_from_config(json.loads(TINY_CONFIG.read_text()), device="cpu")
    for load in (read_state_dict, lambda path: load_model_weights(model, path)):
        with pytest.raises(ModelError, match=f"{weights} holds a pickle that names {system}: refusing to load it"):
            load(str(weights))
    assert not marker.exists()


@pytest.mark.slow
def test_every_save_records_how_long_training_waited(plain_run):
    """Each checkpoint, in the background or not, writes one metrics.jsonl record of how long the step
    waited for it and where its state was copied."""
    records = [json.loads(line) for line in (plain_run / "metrics.jsonl").read_text().splitlines()]
    saves = {r["step"]: r for r in records if "checkpoint_blocked_s" in r}
    assert sorted(saves) == [4, 8, 12], records
    assert all(r["checkpoint"] == f"step-{step:08d}" and r["checkpoint_blocked_s"] >= 0 for step, r in saves.items())
    assert [saves[s]["checkpoint_staging"] for s in (4, 8, 12)] == ["host", "host", "synchronous"]  # at_end waits


@pytest.mark.slow
def test_each_record_logs_the_lr_its_step_ran_at(plain_run):
    """metrics.jsonl's `lr` is the learning rate the step it names ran at (the plain job's 2 warmup steps to 1e-3,
    then open_clip_train's cosine over the other 10), not the next step's: step 1 at half the peak, the last
    above 0."""
    records = [json.loads(line) for line in (plain_run / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in records if "loss" in r}
    ran_at = [1e-3 * (i + 1) / 2 if i < 2 else 0.5 * (1 + math.cos(math.pi * (i - 2) / (STEPS - 2))) * 1e-3
              for i in range(STEPS)]
    assert sorted(logged) == list(range(1, STEPS + 1))
    assert [logged[step] for step in sorted(logged)] == pytest.approx(ran_at, rel=1e-9)
    assert logged[1] == pytest.approx(5e-4) and logged[STEPS] > 0


def test_saves_every_few_minutes_at_the_same_step_on_every_rank(tmp_path):
    """checkpoint.every_minutes (0.025: 1.5 s) beside every_steps (12), steps of 0.3 s more each: rank 0's clock
    decides at the stop checks (after step 1, then every 10 steps; 5 where steps run slower than a second), so
    the timed saves come at steps 10 and 20 (3 s since the start, 2.4 s since the save at step 12), step 12
    and 24 save by steps, and every rank
    writes its part of each (a rank missing one would leave the save's collectives waiting)."""
    run_dir = tmp_path / "runs" / "timed"
    job = _plain_job(tmp_path, "timed", checkpoint={"every_steps": 12, "every_minutes": 0.025, "keep": 10},
                     schedule={"steps": 25})
    run = _with_fault(write_job(tmp_path, job), "slow:0.3")
    assert run.returncode == 0, run.stdout[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saved = [r["step"] for r in records if "checkpoint" in r]
    timed = sorted(set(saved) - {12, 24, 25})  # at the stop checks: 10 and 20 (5, 15, ... where steps run slow)
    assert {12, 24, 25} <= set(saved) and timed and all(step % 5 == 0 for step in timed), saved
    assert len(saved) == len(set(saved)), saved
    for checkpoint in complete_checkpoints(run_dir):
        assert sorted(p.name for p in checkpoint.glob("rank-*.pt")) == ["rank-00000.pt", "rank-00001.pt"]


def test_every_minutes_is_a_positive_number():
    """checkpoint.every_minutes takes a positive, finite number of minutes (fractions too) and makes saves
    periodic, as every_steps does."""
    from pydantic import ValidationError

    from fsdpclip.jobspec.job import CheckpointSpec

    assert CheckpointSpec(every_minutes=0.5).periodic and CheckpointSpec(every_steps=3).periodic
    assert not CheckpointSpec().periodic
    for refused in (0, -1, float("inf"), True, "often"):
        with pytest.raises(ValidationError):
            CheckpointSpec(every_minutes=refused)


def test_a_host_copy_that_cannot_be_reserved_is_said_and_saves_still_copy(caplog):
    """A reservation the host has no room for is a warning (not an error lost with its thread); the host copy is
    then made at the save, with every value of the state."""
    from fsdpclip.checkpoint.staging import HostCopy

    host = HostCopy()
    host.reserve(2 ** 62)
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optim": {"step": torch.tensor(3.0), "lr": 0.1}}
    copied = host.copy(state)
    assert "could not be reserved" in caplog.text and host.buffer is None
    assert torch.equal(copied["model"]["w"], state["model"]["w"]) and copied["optim"]["lr"] == 0.1
    assert copied["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()


def test_the_host_copy_holds_the_moving_average_in_what_it_reserves():
    """The host copy's reservation (`host_copy_bytes`, counted before AdamW has state) holds the state a save copies
    after steps, its moving average included, and would not hold it without the average counted."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fsdpclip.checkpoint.staging import HostCopy, host_copy_bytes
    from fsdpclip.optim.ema import ShardedEma
    from fsdpclip.optim.adamw import ShardedAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 500), torch.nn.BatchNorm1d(500), torch.nn.Linear(500, 7))
    model[0].requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer, ema = ShardedAdamW(trained, lr=0.1), ShardedEma(model, decay=0.5)
    margin = 2 ** 20  # what host_copy_bytes adds for the state's small tensors
    reserved, without = host_copy_bytes(model, trained, ema.state_dict()), host_copy_bytes(model, trained)
    model(torch.randn(8, 300)).square().mean().backward()
    optimizer.step()
    ema.update(1)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "ema": ema.state_dict()}
    host = HostCopy()
    host.buffer = torch.empty(reserved - margin, dtype=torch.uint8)
    assert host._carve(state) is not None
    host.buffer = torch.empty(without - margin, dtype=torch.uint8)
    assert host._carve(state) is None


def test_asynchronous_saves_auto_where_the_host_copies_fit(monkeypatch):
    """checkpoint.async_save 'auto' (the default) is on for CUDA devices when the host copies of a node's ranks
    take at most a quarter of its memory; off on CPU devices, where the state already lives on the host; true
    and false are kept."""
    from fsdpclip.checkpoint import staging
    from fsdpclip.jobspec.job import CheckpointSpec

    monkeypatch.setattr(staging, "host_memory", lambda: 128 * 2 ** 30)
    assert CheckpointSpec().async_save == "auto"
    assert staging.asynchronous_saves("auto", "cuda", 4 * 2 ** 30, 8)
    assert not staging.asynchronous_saves("auto", "cuda", 5 * 2 ** 30, 8)
    assert not staging.asynchronous_saves("auto", "cpu", 2 ** 20, 1)
    assert staging.asynchronous_saves(True, "cpu", 2 ** 40, 8) is True
    assert staging.asynchronous_saves(False, "cuda", 1, 1) is False


@pytest.mark.slow
def test_an_asynchronous_save_waits_for_a_slow_write_without_stopping_training(tmp_path):
    """Background writes slower than the checkpoint interval (1.5 s more each, saves every 2 steps of 0.3 s): a due
    save waits, while training goes on, until the write before it has ended on every rank, and is made then;
    its record names the step it was due at, the log says so once, and every checkpoint is complete."""
    run_dir = tmp_path / "runs" / "slowdisk"
    job = _plain_job(tmp_path, "slowdisk", checkpoint={"async_save": True, "every_steps": 2, "keep": 10},
                     schedule={"steps": 16})
    run = _with_fault(write_job(tmp_path, job), "slow:0.3+slow-write:1.5")
    assert run.returncode == 0, run.stdout[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in records if "loss" in r]
    saves = [r for r in records if "checkpoint" in r and r["checkpoint_staging"] != "synchronous"]
    assert trained == list(range(1, 17)), trained
    late = [r for r in saves if "checkpoint_due_step" in r]
    assert late and all(r["checkpoint_due_step"] < r["step"] and r["checkpoint_due_step"] % 2 == 0 for r in late)
    assert all(later["step"] - earlier["step"] > 2 for earlier, later in zip(saves, saves[1:])), saves
    assert run.stdout.count("saves wait for it without stopping training") == 1, run.stdout[-4000:]
    assert "reserved for its host copy" not in run.stdout  # the estimate made at the start held the state
    assert [p.name for p in complete_checkpoints(run_dir)] == [f"step-{r['step']:08d}" for r in saves] + [
        "step-00000016"]


@pytest.mark.slow
def test_a_failed_background_write_stops_every_rank_with_one_line(tmp_path):
    """Rank 1's background writes fail: the ranks agree on it (DCP tells each at its own time) and stop at
    one step with exit 1 and a line naming the failure, no traceback; the failed checkpoint is never
    published."""
    run_dir = tmp_path / "runs" / "failwrite"
    job = _plain_job(tmp_path, "failwrite", checkpoint={"async_save": True, "every_steps": 3})
    run = _with_fault(write_job(tmp_path, job), "fail-write:1")
    report = json.loads((run_dir / "exit.json").read_text())
    assert report["code"] == 1 and report["message"].startswith(
        "checkpoint step-00000003 could not be written: OSError: the disk went away (injected)"), report
    assert complete_checkpoints(run_dir) == [] and 3 < report["step"] < STEPS, report
    assert not any(f"[rank{rank}]: Traceback" in run.stdout for rank in (0, 1)), run.stdout[-4000:]


@pytest.mark.parametrize("device, nproc, headroom, staging", [
    ("cpu", 2, "", "host"),
    pytest.param("cuda", 1, "", "device", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    pytest.param("cuda", 1, "1.0", "host", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
@pytest.mark.slow
def test_asynchronous_saves_hold_their_own_step(tmp_path, device, nproc, headroom, staging):
    """Two asynchronous saves, each followed at once by a step that changes every parameter and its moving average
    in place: each checkpoint holds its own step's values and average, staged in spare device memory when there is
    some (the copy reused by the second save), else on the host, through a host copy carved out of the memory
    reserved for it (the average counted in)."""
    result = torchrun(["tests/workers/async_save.py", str(tmp_path / "run"), device, headroom], nproc=nproc)
    assert result.returncode == 0, result.stdout[-3000:]
    out = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert out == {"staging": staging, "holds_its_step": {"1": True, "2": True}, "carved": True}, out


def test_a_state_copy_reuses_its_tensors_when_the_layout_holds():
    """copy_state copies into the tensors of an earlier copy of the same layout (no new memory), and makes
    new ones when the layout changed; either way later in-place changes to the state do not reach it."""
    from fsdpclip.checkpoint.staging import copy_state

    state = {"model": {"w": torch.randn(4, 3)},
             "optim": {"state": {"w": {"exp_avg": torch.randn(4, 3), "step": torch.tensor(3.0)}},
                       "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    first = copy_state(state)
    kept = first["model"]["w"].clone()
    state["model"]["w"].add_(1.0)
    assert torch.equal(first["model"]["w"], kept)
    state["optim"]["param_groups"][0]["lr"] = 0.2
    second = copy_state(state, into=first)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()
    assert torch.equal(second["model"]["w"], state["model"]["w"]) and second["optim"]["param_groups"][0]["lr"] == 0.2
    state["model"]["w"] = torch.randn(5, 3)  # another layout
    third = copy_state(state, into=second)
    assert third["model"]["w"].data_ptr() != second["model"]["w"].data_ptr()
    assert torch.equal(third["model"]["w"], state["model"]["w"])
