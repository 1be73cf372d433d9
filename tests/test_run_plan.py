"""The run plan (fsdpclip.plan.resolved): every 'auto' of the spec settled in one object, in one place; printed
by validate, recorded in the run directory, the spec left as the user wrote it."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from conftest import REPO, TINY_CONFIG, synthetic_job, write_job
from ranks import run_group
from fsdpclip.model.build import model_config
from fsdpclip.model.trainable import frozen_meta_model
from fsdpclip.plan.resolved import Node, RunPlan, plan_for_node, settle_at_start
from fsdpclip.jobspec.job import Job

# Each rule that settles an 'auto', and the one module that may call it (besides the one defining it).
RULES = {"init_kind": "plan/resolved.py", "blocks_per_unit": "plan/resolved.py",
         "whole_tower_wraps": "plan/resolved.py", "resolve_shard_degree": "plan/resolved.py",
         "auto_shard_degree": "plan/resolved.py", "asynchronous_saves": "plan/resolved.py",
         "search_start": "plan/resolved.py", "plan_for_node": None, "settle_at_start": None,
         "decode_mode": "data/sources/webdataset.py", "engines_on": "data/sources/webdataset.py",
         "settled_workers": "data/sources/webdataset.py"}


def _calls(path: Path) -> set[str]:
    """The names of the functions and methods a module calls."""
    return {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)}


def test_each_auto_is_settled_in_one_place():
    """No module but the plan's builder (or, for the data's, its source's `plan`) calls a rule that settles an
    'auto'; the plan's phases are called by whoever needs a plan, and nothing else reaches past them."""
    package = REPO / "fsdpclip"
    callers: dict[str, set[str]] = {rule: set() for rule in RULES}
    for path in package.rglob("*.py"):
        for rule in RULES.keys() & _calls(path):
            callers[rule].add(str(path.relative_to(package)))
    for rule, only in RULES.items():
        if only is not None:
            assert callers[rule] <= {only}, (rule, callers[rule])
    assert callers["settle_at_start"] <= {"plan/resolved.py", "train/building.py", "train/sizing.py",
                                          "train/saving.py"}, callers["settle_at_start"]


def _tiny_plan(tmp_path, **fsdp) -> tuple[Job, RunPlan]:
    job = Job(**{**synthetic_job(tmp_path), "fsdp": {"param_dtype": "fp32", **fsdp},
                 "checkpoint": {"every_steps": 2}})
    model, towers = frozen_meta_model(model_config(job.model), job)
    return job, plan_for_node(job, model, towers, Node(4, 2, "cpu", cores=8))


def test_the_plan_is_concrete_and_round_trips(tmp_path):
    """Every field a value, never 'auto'; the ranks' share pending until settled; the JSON the run directory
    keeps reads back into the same plan."""
    job, plan = _tiny_plan(tmp_path, shard_degree="auto")  # 2 nodes, no GPU memory to weigh: full sharding
    assert (plan.shard_degree, plan.replicas, plan.init, plan.cuda_graph, plan.grad_scaler) == (4, 1, "openclip",
                                                                                               False, False)
    assert plan.layout.compile is False and plan.layout.reshard_after_forward is True
    assert set(plan.layout.unit_size) == {"image", "text"} and all(n >= 1 for n in plan.layout.unit_size.values())
    assert plan.pending == ("async_save",) and plan.samples_per_step == 16 * 4
    assert "auto" not in json.dumps(plan.as_dict())
    settled = settle_at_start(plan, job, {}, host_copy_bytes=2 ** 20)
    assert settled.pending == () and settled.async_save is False  # 'auto' saves synchronously on the CPU
    plan.save(tmp_path)
    assert RunPlan.from_dict(json.loads((tmp_path / "plan.json").read_text())) == plan
    assert RunPlan.from_dict(json.loads(json.dumps(settled.as_dict()))) == settled


def test_a_recorded_batch_settles_per_gpu_auto_and_leaves_nothing_to_search(tmp_path):
    """per_gpu 'auto' with an earlier launch's record that applies: the plan takes its batch and the ranks search
    nothing (the batch is pending only without one)."""
    job = Job(**{**synthetic_job(tmp_path), "batch": {"per_gpu": "auto", "grad_accum": 1}})
    model, towers = frozen_meta_model(model_config(job.model), job)
    node = Node(2, 2, "cuda", cores=8, gpu_bytes=80 * 2 ** 30)
    searched = plan_for_node(job, model, towers, node)
    assert {"per_gpu", "grad_accum"} <= set(searched.pending)
    recorded = plan_for_node(job, model, towers, node, recorded_batch=(96, 2))
    assert (recorded.per_gpu, recorded.grad_accum) == (96, 2)
    assert not {"per_gpu", "grad_accum"} & set(recorded.pending)


def test_validate_prints_the_plan(cli, tmp_path):
    """validate's summary holds the plan, from the same builder, and prints it in a line."""
    path = write_job(tmp_path, {**synthetic_job(tmp_path), "launch": {"device": "cpu", "gpus_per_node": 2,
                                                                     "collective_timeout_s": 60}})
    code, out = cli.validate_json(path)
    assert code == 0, out
    plan = out["summary"]["plan"]
    assert (plan["world_size"], plan["shard_degree"], plan["per_gpu"], plan["init"]) == (2, 2, 16, "openclip")
    assert out["summary"]["mesh"]["shard_degree"] == plan["shard_degree"]
    shown = cli("validate", path)
    assert shown.exit_code == 0 and "plan: shard degree 2, 16 per GPU × 1, init openclip" in \
        " ".join(shown.stdout.split()), shown.stdout


def test_a_run_records_its_plan_and_keeps_the_spec_as_written(tmp_path):
    """The ranks train from the plan rank 0 settled and write it beside the spec (`plan.json`, nothing pending);
    the spec the run wrote and its checkpoint's are the user's, 'auto' and all."""
    job = synthetic_job(tmp_path, gpus_per_node=2)
    job["checkpoint"] = {"every_steps": 2}
    proc = run_group([sys.executable, "-m", "fsdpclip", "launch", str(write_job(tmp_path, job))], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    run = tmp_path / "runs" / "t"
    plan = RunPlan.from_dict(json.loads((run / "plan.json").read_text()))
    assert plan.pending == () and (plan.world_size, plan.shard_degree, plan.per_gpu) == (2, 2, 16)
    written = json.loads((run / "job.json").read_text())
    assert written["fsdp"]["shard_degree"] == written["fsdp"]["compile"] == written["model"]["init"] == "auto"
    saved = json.loads(next((run / "checkpoints").glob("*/meta.json")).read_text())["job"]
    assert saved == written
    assert str(TINY_CONFIG) == written["model"]["config"]
