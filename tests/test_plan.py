"""`fsdpclip plan` and the mesh rules behind `fsdp.shard_degree`: which degrees are valid, the bytes each
strategy moves (checked against sums by hand from the parameter count), its step model, and the
choice 'auto' makes."""

from __future__ import annotations

import pytest

from conftest import REPO, write_job
from fsdpclip.plan.mesh import EXPOSED_FRACTION, ShardDegreeError, choose_shard_degree, resolve_shard_degree, \
    shard_degree_problem, valid_shard_degrees

B32 = REPO / "examples" / "vit-b-32-laion400m.json"
BIGG = REPO / "examples" / "vit-bigg-14.json"


def _plan(cli, path, *flags: str) -> tuple[int, dict | str]:
    import json

    result = cli("plan", path, "--json", *flags)
    return result.exit_code, json.loads(result.stdout) if result.exit_code == 0 else result.stdout + result.stderr


@pytest.mark.parametrize("degree, world, per_node, problem", [
    (3, 8, 8, "does not divide the world size 8"),
    (4, 12, 6, "span part of a node of 6 ranks"),
    (12, 24, 8, "span part of a node of 8 ranks"),
    (16, 32, 8, None), (2, 32, 8, None), (1, 32, 8, None), (32, 32, 8, None), (64, 32, 8, "does not divide"),
])
def test_shard_degree_rules(degree, world, per_node, problem):
    found = shard_degree_problem(degree, world, per_node)
    assert (found is None) if problem is None else (problem in (found or ""))


def test_valid_degrees_lie_in_a_node_or_span_whole_nodes():
    assert valid_shard_degrees(96, 8) == [1, 2, 4, 8, 16, 24, 32, 48, 96]
    assert valid_shard_degrees(12, 6) == [1, 2, 3, 6, 12]


def test_plan_of_the_vit_b_32_example(cli):
    """12 nodes × 8: every valid degree once; replication all-reduces the fp32 gradients of all
    151,277,313 parameters (2 × 95/96 of them per GPU), full FSDP all-reduces nothing, a group of 1
    gathers nothing; memory falls with the degree; 'auto' shards over a node (8)."""
    code, plan = _plan(cli, B32, "--nodes", "12", "--gpus-per-node", "8", "--gpu-memory-gib", "80")
    assert code == 0, plan
    rows = {row["degree"]: row for row in plan["rows"]}
    assert sorted(rows) == valid_shard_degrees(96, 8)
    assert plan["parameters"] == 151_277_313
    assert rows[1]["traffic"]["all_reduce"] == pytest.approx(2 * 95 / 96 * 151_277_313 * 4)
    assert rows[1]["traffic"]["all_gather"] == 0 and rows[96]["traffic"]["all_reduce"] == 0
    assert rows[8]["traffic"]["all_reduce"] == pytest.approx(2 * 11 / 12 * 151_277_313 * 4 / 8, rel=1e-3)
    memory = [rows[d]["memory_gib"] for d in sorted(rows)]
    assert memory == sorted(memory, reverse=True)
    # the host of a node: 8 rank processes of 2 GiB and the fp32 initial weights; nothing offloaded
    assert [row["host_gib_per_node"] for row in rows.values()] == [pytest.approx(16 + 4 * 151_277_313 / 2 ** 30)] * 9
    code, offloaded = _plan(cli, B32, "--nodes", "12", "--gpus-per-node", "8", "--set", "fsdp.cpu_offload=true")
    host = {row["degree"]: row["host_gib_per_node"] - 16 - 4 * 151_277_313 / 2 ** 30 for row in offloaded["rows"]}
    assert host[1] == pytest.approx(8 * 16 * 151_277_313 / 2 ** 30, rel=0.01)  # each rank holds the whole state
    assert host[96] == pytest.approx(host[8] / 12, rel=0.02)  # a node's 8 of 96 shards against 8 of 8
    assert rows[1]["memory_gib"] <= 80 * 0.9 and plan["auto_degree"] == 8
    for row in rows.values():  # the stated step model
        assert row["step_s"] == pytest.approx(max(row["compute_s"], row["communication_s"])
                                              + EXPOSED_FRACTION * row["communication_s"])
        assert row["samples_per_s_per_gpu"] == pytest.approx(plan_batch(B32) / row["step_s"])


def plan_batch(path) -> int:
    from fsdpclip.jobspec.jobfile import load_job

    job = load_job(path)
    return job.batch.per_gpu * job.batch.grad_accum


@pytest.mark.slow
def test_auto_shards_what_does_not_fit(cli):
    """ViT-bigG-14 over 2 nodes of 8: replicated it needs ~42 GiB per GPU, sharded over a node ~15.
    On 40 GiB GPUs 'auto' shards over a node; on 16 GiB GPUs (14.4 usable) over both nodes."""
    code, plan = _plan(cli, BIGG, "--nodes", "2", "--gpus-per-node", "8", "--gpu-memory-gib", "40")
    assert code == 0, plan
    rows = {row["degree"]: row for row in plan["rows"]}
    assert rows[1]["memory_gib"] > 40 and plan["auto_degree"] == 8
    assert rows[16]["memory_gib"] < 16 * 0.9 < rows[8]["memory_gib"]
    totals = {degree: row["memory_gib"] * 2 ** 30 for degree, row in rows.items()}
    assert choose_shard_degree(totals, 16 * 2 ** 30, 8) == 16 and choose_shard_degree(totals, None, 8) == 16



def test_one_resolver_decides_the_shard_degree_for_validate_and_the_trainer():
    """A given degree stands or is refused with its reason; 'auto' takes the whole world inside one node
    without measuring anything, and asks the memory model (the caller's `auto`) only across nodes."""
    asked = []

    def auto() -> int:
        asked.append(True)
        return 8

    assert resolve_shard_degree("auto", 4, 8, auto) == 4 and not asked
    assert resolve_shard_degree("auto", 16, 8, auto) == 8 and asked
    assert resolve_shard_degree(2, 16, 8, auto) == 2
    with pytest.raises(ShardDegreeError, match="span part of a node of 8 ranks"):
        resolve_shard_degree(12, 24, 8, auto)

def test_plan_table_marks_the_choices(cli):
    """The table names every strategy and marks what does not fit, 'auto' and the spec's degree."""
    result = cli("plan", B32, "--nodes", "2", "--gpus-per-node", "4", "--gpu-memory-gib", "29.5",
                 "--set", "fsdp.shard_degree=2")
    assert result.exit_code == 0, result.stdout
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 5}
    assert {"replicate", "HSDP 2", "HSDP 4", "full FSDP"} <= set(rows)
    assert "does not fit" in rows["replicate"] and "spec" in rows["HSDP 2"]
    assert "auto" in rows["full FSDP"] and "auto" not in rows["HSDP 4"]  # nothing fits with the margin: shard all


def test_plan_prices_the_cpu_only_at_a_rate_given(cli, tiny_job, tmp_path):
    """A job on the CPU: the H200 rate priced the demo at ~10^6 samples/s a rank, where it runs ~100. Refused in one
    row naming launch.device, unless --tflops gives the rate."""
    path = write_job(tmp_path, tiny_job)
    code, out = _plan(cli, path, "--nodes", "1", "--gpus-per-node", "2")
    assert code == 2 and "launch.device" in out and "--tflops N" in out, out
    code, plan = _plan(cli, path, "--nodes", "1", "--gpus-per-node", "2", "--tflops", "0.001")
    assert code == 0 and plan["tflops"] == 0.001
    assert plan["rows"][0]["compute_s"] == pytest.approx(16 * plan["flops_per_sample"] / 1e9)


def test_plan_refuses_a_bad_spec(cli, tiny_job, tmp_path):
    tiny_job["freeze"] = {"image": {"blocks": "0:40"}}
    code, out = _plan(cli, write_job(tmp_path, tiny_job), "--nodes", "1", "--gpus-per-node", "2")
    assert code == 2 and "freeze.image.blocks" in out


def test_plan_refuses_a_world_beyond_the_maximum(cli, tmp_path):
    """2^20 nodes × 2 GPUs: an error naming the maximum (every shard degree up to the world was tried);
    a node count of 2^64 stops at the flag."""
    code, out = _plan(cli, B32, "--nodes", str(2 ** 20), "--gpus-per-node", "2")
    assert code == 2 and "2,097,152 ranks, more than a job may have (1,048,576)" in out.replace("\n", ""), out
    code, out = _plan(cli, B32, "--nodes", str(2 ** 64), "--gpus-per-node", "8")
    assert code == 2 and "--nodes" in out, out
