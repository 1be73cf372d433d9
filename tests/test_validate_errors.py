"""`fsdpclip validate` on bad inputs: exit code 2, the JSON location and the message, all at once."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

from conftest import RunsCode, write_job


def _set(job: dict, dotted: str, value) -> dict:
    job = copy.deepcopy(job)
    *parents, leaf = dotted.split(".")
    node = job
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return job


def _drop(job: dict, dotted: str) -> dict:
    job = copy.deepcopy(job)
    *parents, leaf = dotted.split(".")
    node = job
    for part in parents:
        node = node[part]
    del node[leaf]
    return job


def _compiled(job: dict, options: dict) -> dict:
    return _set(_set(job, "fsdp.compile", True), "fsdp.compile_options", options)


# (case id, edit of the valid tiny job, expected location, words of the message, words of the hint)
CASES = [
    ("unknown-top-key", lambda j: _set(j, "optimiser", {"lr": 1e-3}), "optimiser", "unknown key", "optimizer"),
    ("unknown-nested-key", lambda j: _set(j, "fsdp.reshard_after_fwd", False), "fsdp.reshard_after_fwd",
     "unknown key", "reshard_after_forward"),
    ("wrong-type-in-list", lambda j: _set(j, "fsdp.wrap", {"image": ["ResidualAttentionBlock", 3]}),
     "fsdp.wrap.image[1]", "valid string", None),
    ("bad-dtype", lambda j: _set(j, "fsdp.param_dtype", "bf32"), "fsdp.param_dtype", "not allowed", "bf16"),
    ("bad-regex", lambda j: _set(j, "optimizer.decay_rules", [{"pattern": "visual.(", "weight_decay": 0}]),
     "optimizer.decay_rules[0].pattern", "regular expression", None),
    ("regex-matches-nothing", lambda j: _set(j, "optimizer.decay_rules",
                                             [{"max_ndim": 1, "weight_decay": 0},
                                              {"pattern": "^visual\\.nonexistent", "weight_decay": 0}]),
     "optimizer.decay_rules[1]", "matches no parameter", "parameter names look like"),
    ("unknown-model", lambda j: _set(j, "model", {"name": "ViT-B-33"}), "model.name", "unknown OpenCLIP model",
     "ViT-B-32"),
    ("name-and-config", lambda j: _set(j, "model.name", "ViT-B-32"), "model", "exactly one of", None),
    ("missing-model-config", lambda j: _set(j, "model.config", "/nonexistent/cfg.json"), "model.config",
     "cannot read model config", None),
    ("wrap-class-missing", lambda j: _set(j, "fsdp.wrap", {"image": ["ResidualAttentionBlok"]}),
     "fsdp.wrap.image[0]", "no module of class", "ResidualAttentionBlock"),
    ("checkpoint-class-missing", lambda j: _set(j, "fsdp.activation_checkpointing", {"text": ["Bottleneck"]}),
     "fsdp.activation_checkpointing.text[0]", "no module of class", "ResidualAttentionBlock"),
    ("freeze-out-of-range", lambda j: _set(j, "freeze", {"image": {"blocks": "0:40"}}), "freeze.image.blocks",
     "out of range for 2 blocks", None),
    ("freeze-empty", lambda j: _set(j, "freeze", {"text": {"blocks": "1:1"}}), "freeze.text.blocks",
     "selects none", None),
    ("freeze-syntax", lambda j: _set(j, "freeze", {"image": {"blocks": "first"}}), "freeze.image.blocks",
     "Python slice", None),
    ("global-batch", lambda j: _set(j, "batch.global_batch", 100), "batch.global_batch",
     "16 × grad_accum 1 × world size 2 = 32", None),
    ("shards-missing", lambda j: _set(j, "data.urls", "/nonexistent/shard-{0..3}.tar"), "data.urls",
     "4 of 4 shards not found", None),
    ("too-few-shards", lambda j: _set(j, "data.workers", 8), "data.urls", "8 shards for 2 ranks × 8 workers",
     "≥ 16 shards"),
    ("fp16-no-scaler", lambda j: _set(j, "fsdp", {"param_dtype": "fp16", "grad_scaler": {"enabled": False}}),
     "fsdp.grad_scaler.enabled", "underflows", None),
    ("siglip-without-bias", lambda j: _set(j, "loss", {"kind": "siglip"}), "loss.kind", "logit bias", None),
    ("clip-option-with-siglip", lambda j: _set(j, "loss", {"kind": "siglip", "local_loss": False}),
     "loss.local_loss", "unknown key", None),
    ("unknown-loss", lambda j: _set(j, "loss", {"kind": "infonce"}), "loss", "unknown kind 'infonce'", "siglip"),
    ("steps-and-epochs", lambda j: _set(j, "schedule", {"steps": 10, "epochs": 2}), "schedule.epochs",
     "not both", None),
    ("missing-data", lambda j: _drop(j, "data"), "data", "required key is missing", None),
    ("unknown-source", lambda j: _set(j, "data", {"source": "parquet"}), "data", "unknown data source", "synthetic"),
    ("warmup-too-long", lambda j: _set(j, "schedule", {"warmup_steps": 1000}), "schedule.warmup_steps",
     "longer than the whole run (44 steps)", None),
    ("eval-without-sets", lambda j: _set(j, "eval", {"every_steps": 10}), "eval.every_steps", "no dataset", None),
    ("pretrained-missing", lambda j: _set(j, "model.pretrained", "/nonexistent/w.pt"), "model.pretrained",
     "file not found", None),
    ("unknown-key-in-union-member", lambda j: _set(j, "data.shuffle", 10), "data.shuffle", "unknown key",
     "shuffle_buffer"),
    ("fp16-on-cpu", lambda j: _set(j, "fsdp.param_dtype", "fp16"), "fsdp.param_dtype", "not supported on CPU", "bf16"),
    ("eval-names-twice", lambda j: _set(j, "eval", {"zeroshot": [{"dataset": "folder", "path": "/x", "classnames": "/c"},
                                                                 {"dataset": "folder", "path": "/y/x", "classnames": "/c",
                                                                  "name": "x"}]}),
     "eval.zeroshot[1]", "a second set named 'x'", "give each set a `name`"),
    ("shard-degree-not-divisor", lambda j: _set(j, "fsdp.shard_degree", 3), "fsdp.shard_degree",
     "does not divide the world size 2", "valid for 1 node(s) × 2: 1, 2 (or 'auto')"),
    ("shard-degree-zero", lambda j: _set(j, "fsdp.shard_degree", 0), "fsdp.shard_degree",
     "expected 'auto' or an integer from 1 to 1,048,576", None),
    ("unit-size-word", lambda j: _set(j, "fsdp.unit_size", "big"), "fsdp.unit_size",
     "expected 'auto' or an integer from 1 to 1,048,576", None),
    ("cuda-graph-on-cpu", lambda j: _set(j, "fsdp.cuda_graph", True), "fsdp.cuda_graph", "need CUDA devices",
     "'auto'"),
    ("cuda-graph-offload", lambda j: _set(_set(j, "launch.device", "cuda"), "fsdp", {"cuda_graph": True,
                                                                                     "cpu_offload": True}),
     "fsdp.cuda_graph", "CPU offload", None),
    ("cuda-graph-fp16", lambda j: _set(_set(j, "launch.device", "cuda"), "fsdp", {"cuda_graph": True,
                                                                                  "param_dtype": "fp16"}),
     "fsdp.cuda_graph", "fp16 loss scaling", "bf16"),
    ("cuda-graph-patch-dropout", lambda j: _set(_set(_set(j, "launch.device", "cuda"), "fsdp.cuda_graph", True),
                                                "model.image", {"patch_dropout": 0.5}),
     "fsdp.cuda_graph", "patch dropout", None),
    ("compile-option-unknown", lambda j: _compiled(j, {"coordinate_descent_tunning": True}),
     "fsdp.compile_options.coordinate_descent_tunning", "not an option", "coordinate_descent_tuning"),
    ("compile-option-type", lambda j: _compiled(j, {"max_autotune": 1}),
     "fsdp.compile_options.max_autotune", "must be bool, not 1", None),
    ("compile-option-twice", lambda j: _compiled(j, {"max_autotune": True, "max-autotune": False}),
     "fsdp.compile_options.max-autotune", "the same option as 'max_autotune'", None),
    ("compile-option-cudagraphs", lambda j: _set(_set(_compiled(j, {"triton.cudagraphs": True}), "fsdp.cuda_graph",
                                                      True), "launch.device", "cuda"),
     "fsdp.compile_options.triton.cudagraphs", "inside a step fsdpclip captures", "fsdp.cuda_graph to false"),
    ("compile-option-cudagraphs-auto", lambda j: _set(_compiled(j, {"triton.cudagraphs": True}), "launch",
                                                      {"device": "cuda", "gpus_per_node": 1}),  # 'auto' captures
     "fsdp.compile_options.triton.cudagraphs", "inside a step fsdpclip captures", "fsdp.cuda_graph to false"),
    ("compile-option-list", lambda j: _compiled(j, {"max_autotune": [True]}),
     "fsdp.compile_options.max_autotune", "expected true/false, a number, a string or null", None),
    ("env-name", lambda j: _set(j, "launch.env", {"NCCL_DEBUG=INFO": "1"}), "launch.env",
     "not an environment variable name", None),
    ("slurm-env-name", lambda j: _set(j, "launch.slurm.env", {"MY VAR": "1"}), "launch.slurm.env",
     "not an environment variable name", None),
    ("env-own-variable", lambda j: _set(j, "launch.env", {"FSDPCLIP_LOCK_TOKEN": "shared"}), "launch.env",
     "'FSDPCLIP_LOCK_TOKEN': FSDPCLIP_* variables are set by fsdpclip's launcher", None),
    ("slurm-env-own-variable", lambda j: _set(j, "launch.slurm.env", {"FSDPCLIP_LAUNCHER": "1:2"}), "launch.slurm.env",
     "'FSDPCLIP_LAUNCHER': FSDPCLIP_* variables are set by fsdpclip's launcher", None),
    ("min-lr-above-lr", lambda j: _set(_set(j, "optimizer.lr", 0.5), "schedule.min_lr", 1.0), "schedule.min_lr",
     "above the peak learning rate optimizer.lr 0.5", "at most optimizer.lr"),
    ("lr-infinite", lambda j: _set(j, "optimizer.lr", float("inf")), "optimizer.lr", "finite number", None),
    ("wsd-decay-does-not-fit", lambda j: _set(j, "schedule", {"kind": "wsd", "warmup_steps": 10,
                                                               "decay_fraction": 0.9}), "schedule.decay_fraction",
     "a decay of 40 steps after 10 warmup steps does not fit in the run's 44 steps", "at most 34 steps of decay"),
    ("wsd-decay-of-no-step", lambda j: _set(j, "schedule", {"kind": "wsd", "decay_fraction": 0.01}),
     "schedule.decay_fraction", "a decay of no step in the run's 44 steps", None),
    ("decay-length-missing", lambda j: _set(j, "schedule.kind", "const-cooldown"), "schedule",
     "`const-cooldown` needs the length of its final decay", None),
    ("decay-length-twice", lambda j: _set(j, "schedule", {"kind": "wsd", "decay_steps": 4, "decay_fraction": 0.1}),
     "schedule.decay_fraction", "give one of decay_steps, decay_epochs, decay_fraction, not `decay_steps` too", None),
    ("decay-epochs-without-epochs", lambda j: _set(j, "schedule", {"kind": "const-cooldown", "steps": 40,
                                                                    "decay_epochs": 1}),
     "schedule.decay_epochs", "needs `schedule.epochs`", None),
    ("decay-epochs-beyond-the-run", lambda j: _set(j, "schedule", {"kind": "const-cooldown", "epochs": 2,
                                                                    "decay_epochs": 3}),
     "schedule.decay_epochs", "more than the run's 2 epochs", None),
    ("decay-for-cosine", lambda j: _set(j, "schedule.decay_steps", 4), "schedule.decay_steps",
     "a final decay's length, for `kind` const-cooldown or wsd", None),
    ("seed-beyond-torch", lambda j: _set(j, "run.seed", 2 ** 64), "run.seed", "less than 9223372036854775808", None),
    ("boolean-batch", lambda j: _set(j, "batch.per_gpu", True), "batch.per_gpu", "a number, not true/false", None),
    ("boolean-beta", lambda j: _set(j, "optimizer.betas", [False, 0.98]), "optimizer.betas",
     "a number, not true/false", None),
    ("boolean-unit-size", lambda j: _set(j, "fsdp.unit_size", True), "fsdp.unit_size", "a number, not true/false",
     None),
    ("batch-in-a-string", lambda j: _set(j, "batch.per_gpu", "32"), "batch.per_gpu",
     "expected 'auto' or an integer from 1 to 1,048,576", None),
    ("number-in-a-string", lambda j: _set(j, "optimizer.lr", "1e-3"), "optimizer.lr",
     "expected a number, not a string: write it without quotes", None),
    ("boolean-in-a-string", lambda j: _set(j, "fsdp.compile", "yes"), "fsdp.compile",
     "expected true/false, not a string", None),
    ("batch-beyond-any-gpu", lambda j: _set(j, "batch.per_gpu", 999999999999999999999), "batch.per_gpu",
     "expected 'auto' or an integer from 1 to 1,048,576", None),
    ("accumulation-beyond-any-job", lambda j: _set(j, "batch.grad_accum", 2 ** 64), "batch.grad_accum",
     "less than or equal to 1048576", None),
    ("mixture-weights-overflow", lambda j: _set(j, "data", {"sources": [{"urls": j["data"]["urls"], "weight": 1e308,
                                                                         "samples": 700},
                                                                        {"urls": j["data"]["urls"], "weight": 1e308,
                                                                         "samples": 738}], "workers": 1}),
     "data.sources", "the weights sum to more than a float holds", None),
    ("wandb-project", lambda j: _set(j, "logging.wandb", {"project": "team/clip", "mode": "disabled"}),
     "logging.wandb.project", "W&B refuses project names containing /", None),
    ("wandb-long-project", lambda j: _set(j, "logging.wandb", {"project": "p" * 129, "mode": "disabled"}),
     "logging.wandb.project", "at most 128 characters", None),
    ("wandb-tag", lambda j: _set(j, "logging.wandb", {"tags": ["ok", "t" * 65], "mode": "disabled"}),
     "logging.wandb.tags[1]", "at most 64 characters", None),
    ("world-too-large", lambda j: _set(j, "launch", {"nodes": 2 ** 19, "gpus_per_node": 4}), "launch",
     "2,097,152 ranks, more than a job may have (1,048,576)", None),
    ("nodes-beyond-any-cluster", lambda j: _set(j, "launch.nodes", 2 ** 64), "launch.nodes",
     "less than or equal to 1048576", None),
    ("unbalanced-braces", lambda j: _set(j, "data.urls", "/data/shard-{0..3.tar"), "data.urls",
     "unbalanced braces", "every '{' needs its '}'"),
    ("ema-decay-of-one", lambda j: _set(j, "ema", {"decay": 1.0}), "ema.decay", "less than 1", None),
    ("ema-no-decay", lambda j: _set(j, "ema", {"decay": 0}), "ema.decay", "greater than 0", None),
    ("ema-every-no-step", lambda j: _set(j, "ema", {"every_steps": 0}), "ema.every_steps", "greater than 0", None),
    ("ema-negative-start", lambda j: _set(j, "ema", {"start_step": -1}), "ema.start_step",
     "greater than or equal to 0", None),
    ("ema-warmup-in-a-string", lambda j: _set(j, "ema", {"warmup": "true"}), "ema.warmup",
     "expected true/false, not a string", None),
    ("ema-unknown-key", lambda j: _set(j, "ema", {"dacay": 0.999}), "ema.dacay", "unknown key", "decay"),
    ("ema-true", lambda j: _set(j, "ema", True), "ema", "expected 'auto' (off) or an object (the block)", None),
    ("ema-on", lambda j: _set(j, "ema", "on"), "ema", "expected 'auto' (off) or an object (the block)", None),
    ("eval-ema-without-ema", lambda j: _set(j, "eval.ema", True), "eval.ema",
     "evaluates the averaged weights of the `ema` block, and `ema` is 'auto'", '"ema": {"decay": 0.9999}'),
]

# Values written into the batch script of `launch --slurm` (issue: a newline became a line of the script).
SCRIPT_CASES = [
    ("launch.slurm.partition", "gpu\n#SBATCH --exclusive"),
    ("launch.slurm.account", "proj\ntouch /tmp/x"),
    ("launch.slurm.qos", "low\r"),
    ("run.output_dir", "/runs\nrm -rf /"),
    ("launch.slurm.setup", ["module load cuda\u0007"]),
    ("launch.env", {"NCCL_DEBUG": "INFO\ntouch /tmp/x"}),
    ("launch.slurm.env", {"A": "1\x00"}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_located(case, cli, tiny_job, tmp_path):
    _, edit, location, message, hint = case
    code, out = cli.validate_json(write_job(tmp_path, edit(tiny_job)))
    assert code == 2
    assert out["ok"] is False
    match = [e for e in out["errors"] if e["location"] == location]
    assert match, f"no error at {location}: {out['errors']}"
    assert message in match[0]["message"], match[0]
    if hint:
        assert hint in (match[0]["hint"] or ""), match[0]


def test_every_error_at_once(cli, tiny_job, tmp_path):
    job = _set(_set(_set(tiny_job, "fsdp.param_dtype", "bf32"), "model.nmae", "x"), "batch.per_gpu", 0)
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert code == 2
    assert {e["location"] for e in out["errors"]} == {"fsdp.param_dtype", "model.nmae", "batch.per_gpu"}


def test_one_mistake_of_every_kind_in_one_round(cli, tiny_job, tmp_path):
    """A spec holding one mistake of every kind validate knows, each in a field of its own: a key given twice, an
    unknown key, a wrong type, a number in a string, a value not allowed, one out of range, a bad regex, an unknown
    kind, an override that cannot apply; the batch's arithmetic, the schedule, a class, a freeze range, the shard
    degree, a CUDA-only option on the CPU, a compile option, the data, an eval set, a weights file and the run
    directory. Every one comes in the first round, one located row each, and nothing follows from another."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    edits = {"fsdp.reshard_after_fwd": False, "data.workers": "two", "checkpoint.keep": "2", "schedule.kind": "cosin",
             "logging.every_steps": 0, "optimizer.decay_rules": [{"pattern": "visual.(", "weight_decay": 0}],
             "loss": {"kind": "infonce"}, "batch.global_batch": 100, "optimizer.lr": 0.5, "schedule.min_lr": 1.0,
             "fsdp.wrap": {"text": ["Nope"]}, "freeze": {"image": {"blocks": "0:40"}}, "fsdp.shard_degree": 3,
             "fsdp.cuda_graph": True, "fsdp.compile_options": {"coordinate_descent_tunning": True},
             "data.urls": "/nonexistent/shard-{0..3}.tar",
             "eval.zeroshot": [{"dataset": "digits", "path": "/nonexistent/test"}],
             "model.image.pretrained": "/nonexistent/image.pt", "run.output_dir": str(blocker / "runs")}
    job = tiny_job
    for dotted, value in edits.items():
        job = _set(job, dotted, value)
    path = write_job(tmp_path, job)
    path.write_text(path.read_text().replace('"run": {', '"run": {"seed": 1, "seed": 2, ', 1))
    code, out = cli.validate_json(path, "--set", "run.name.x=1")
    expected = {"run.seed", "run.name.x", "fsdp.reshard_after_fwd", "data.workers", "checkpoint.keep", "schedule.kind",
                "logging.every_steps", "optimizer.decay_rules[0].pattern", "loss", "batch.global_batch",
                "schedule.min_lr", "fsdp.wrap.text[0]", "freeze.image.blocks", "fsdp.shard_degree", "fsdp.cuda_graph",
                "fsdp.compile_options.coordinate_descent_tunning", "data.urls", "eval.zeroshot[0].path",
                "model.image.pretrained", "run.output_dir"}
    assert code == 2
    assert sorted(e["location"] for e in out["errors"]) == sorted(expected), out["errors"]


def test_relative_paths_start_where_fsdpclip_runs(cli, tiny_job, tmp_path, digits_dir, monkeypatch):
    """A spec with relative paths (as the examples hold them) validated from another directory: each row of a
    missing relative path says which directory it was looked for in; a missing absolute path's row does not. From the
    directory they start at, they are found."""
    import shutil

    from conftest import TINY_CONFIG

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "models").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(TINY_CONFIG, project / "models" / "tiny-clip.json")
    (project / "data").symlink_to(digits_dir)
    job = {**tiny_job, "model": {"config": "models/tiny-clip.json"},
           "data": {**tiny_job["data"], "urls": "data/train-{000000..000007}.tar"},
           "eval": {"zeroshot": [{"dataset": "digits", "path": "data/test"}],
                    "retrieval": [{"path": str(tmp_path / "absent")}]}}
    path = write_job(tmp_path, job)
    monkeypatch.chdir(elsewhere)
    code, out = cli.validate_json(path)
    hints = {e["location"]: e["hint"] or "" for e in out["errors"]}
    relative = {"model.config", "data.urls", "eval.zeroshot[0].path"}
    assert code == 2 and set(hints) == relative | {"eval.retrieval[0].path"}, out["errors"]
    assert all(f"a relative path starts at the directory fsdpclip runs in ({elsewhere}), not at the spec's" in
               hints[location] for location in relative), hints
    assert "relative path" not in hints["eval.retrieval[0].path"]
    monkeypatch.chdir(project)
    code, out = cli.validate_json(path)
    assert [e["location"] for e in out["errors"]] == ["eval.retrieval[0].path"], out["errors"]


def test_every_semantic_error_at_once(cli, tiny_job, tmp_path):
    job = _set(_set(_set(tiny_job, "freeze", {"image": {"blocks": "0:9"}}), "batch.global_batch", 7),
               "fsdp.wrap", {"text": ["Nope"]})
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert code == 2
    assert {"freeze.image.blocks", "batch.global_batch", "fsdp.wrap.text[0]"} <= {e["location"] for e in out["errors"]}


def test_bad_json_file(cli, tmp_path):
    path = tmp_path / "job.json"
    path.write_text('{"model": {"name": "ViT-B-32"},\n  "batch": }')
    code, out = cli.validate_json(path)
    assert code == 2
    assert out["errors"][0]["location"] == "(file)"
    assert "line 2" in out["errors"][0]["message"]


def test_output_dir_is_a_file(cli, tiny_job, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, out = cli.validate_json(write_job(tmp_path, _set(tiny_job, "run.output_dir", str(blocker / "sub"))))
    assert code == 2
    assert [e["message"] for e in out["errors"] if e["location"] == "run.output_dir"] == ["not a directory"]


def test_set_override_is_validated_like_the_file(cli, tiny_job, tmp_path):
    code, out = cli.validate_json(write_job(tmp_path, tiny_job), "--set", "batch.per_gpu=-3")
    assert code == 2
    assert out["errors"][0]["location"] == "batch.per_gpu"


def test_set_values_are_read_as_json(cli, tiny_job, tmp_path):
    """What a file must write without quotes, `--set` may: its value is read as JSON before the spec sees it."""
    code, out = cli.validate_json(write_job(tmp_path, tiny_job), "--set", "batch.per_gpu=8", "--set",
                                  "optimizer.lr=1e-3", "--set", "fsdp.compile=false")
    assert code == 0, out["errors"]
    assert out["summary"]["batch"]["per_gpu"] == 8


def test_world_size_flags_change_the_batch_check(cli, tiny_job, tmp_path):
    path = write_job(tmp_path, _set(tiny_job, "batch.global_batch", 32))
    assert cli.validate_json(path)[0] == 0
    code, out = cli.validate_json(path, "--nodes", "2", "--gpus-per-node", "2", "--no-check-paths")
    assert code == 2 and out["errors"][0]["location"] == "batch.global_batch"


@pytest.mark.slow
def test_no_traceback_from_the_real_command(tiny_job, tmp_path):
    """The installed entry point prints a table and exits 2, without a Python traceback."""
    path = write_job(tmp_path, _set(tiny_job, "freeze", {"image": {"blocks": "0:40"}}))
    proc = subprocess.run([sys.executable, "-m", "fsdpclip", "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "freeze.image.blocks" in proc.stderr


def test_inputs_that_once_ended_in_tracebacks(cli, tiny_job, tmp_path):
    """A 300-character run name, a run directory whose name the filesystem refuses, a key nested 1000
    deep, a 10 MB string: each a located error (exit 2), the long value shown shortened."""
    long_name = _set(tiny_job, "run.name", "r" * 300)
    code, out = cli.validate_json(write_job(tmp_path, long_name))
    assert code == 2 and out["errors"][0]["location"] == "run.name" and "128" in out["errors"][0]["message"]

    code, out = cli.validate_json(write_job(tmp_path, _set(tiny_job, "run.output_dir", str(tmp_path / ("d" * 300)))))
    assert code == 2 and [e["location"] for e in out["errors"]] == ["run.output_dir"]
    assert "cannot hold a run directory" in out["errors"][0]["message"]

    deep = tmp_path / "deep.json"
    deep.write_text('{"model": {"name": "ViT-B-32"}, "x": ' + '{"x": ' * 1000 + "{}" + "}" * 1001)
    code, out = cli.validate_json(deep)
    assert code == 2 and "nested too deeply" in out["errors"][0]["message"]

    result = cli("validate", write_job(tmp_path, _set(tiny_job, "model", {"name": "A" * 10_000_000})))
    assert result.exit_code == 2 and len(result.output) < 20_000, len(result.output)
    assert "(10,000,000 characters)" in result.output.replace("\n", "")


def test_shard_degree_against_nodes_and_memory(cli, tiny_job, tmp_path):
    """A group must lie in a node or span whole nodes; a degree whose estimate does not fit
    launch.gpu_memory_gib is refused when a larger one fits; 'auto' shards over a node, over more
    nodes only when a node's group does not fit."""
    def validate(degree, *flags, memory=None):
        job = _set(_set(tiny_job, "fsdp.shard_degree", degree), "data.resampled", True)  # shards for any world
        if memory is not None:
            job = _set(job, "launch.gpu_memory_gib", memory)
        return cli.validate_json(write_job(tmp_path, job), "--no-check-paths", *flags)

    code, out = validate(4, "--nodes", "2", "--gpus-per-node", "6")
    assert code == 2 and out["errors"][0]["location"] == "fsdp.shard_degree"
    assert "span part of a node of 6 ranks" in out["errors"][0]["message"]
    assert "1, 2, 3, 6, 12" in out["errors"][0]["hint"]
    assert validate(12, "--nodes", "2", "--gpus-per-node", "6")[0] == 0
    code, out = validate(8, "--nodes", "4", "--gpus-per-node", "4")
    assert code == 0 and out["summary"]["mesh"] | {"traffic_gib_per_step": None} == {
        "shard_degree": 8, "replicas": 2, "auto": False, "decided_at_start": False, "traffic_gib_per_step": None}

    two_nodes = ("--nodes", "2", "--gpus-per-node", "2")
    totals = {d: validate(d, *two_nodes)[1]["summary"]["memory_gib"]["total"] for d in (1, 2, 4)}
    assert totals[4] < totals[2] < totals[1]
    between = (totals[2] + totals[4]) / 2
    code, out = validate(2, *two_nodes, memory=between)
    assert code == 2 and out["errors"][0]["location"] == "fsdp.shard_degree" and "shard_degree 4 fits" in \
        out["errors"][0]["hint"]
    assert validate("auto", *two_nodes, memory=between / 0.9)[1]["summary"]["mesh"]["shard_degree"] == 4  # margin
    assert validate("auto", *two_nodes, memory=totals[1] / 0.8)[1]["summary"]["mesh"]["shard_degree"] == 2
    code, out = validate("auto", *two_nodes)
    assert out["summary"]["mesh"]["shard_degree"] == 4 and out["summary"]["mesh"]["decided_at_start"] is False  # CPU


def test_a_key_given_twice_is_an_error(cli, tmp_path):
    """JSON keeps the last of two equal keys without a word; the spec names each repeated key instead."""
    path = tmp_path / "twice.json"
    path.write_text('{"model": {"name": "ViT-B-32"}, "batch": {"per_gpu": 8}, "schedule": {"steps": 3},\n'
                    ' "data": {"source": "synthetic", "samples": 10, "samples": 20}, "batch": {"per_gpu": 16}}')
    code, out = cli.validate_json(path)
    assert code == 2
    assert [(e["location"], "more than once" in e["message"]) for e in out["errors"]] == [
        ("batch", True), ("data.samples", True)]


def test_data_urls_the_reader_cannot_open(cli, tiny_job, tmp_path):
    """An s3:// URL (webdataset has no opener for it) is refused by validate, also without path checks,
    with the pipe: form as the hint; pipe: and file: URLs pass the scheme check."""
    code, out = cli.validate_json(write_job(tmp_path, _set(tiny_job, "data.urls", "s3://bucket/shard-{0..15}.tar")),
                                  "--no-check-paths")
    assert code == 2 and out["errors"][0]["location"] == "data.urls"
    assert "cannot open 's3:' URLs" in out["errors"][0]["message"] and "16 of 16 shards" in out["errors"][0]["message"]
    assert "pipe:aws s3 cp" in out["errors"][0]["hint"]
    piped = _set(tiny_job, "data.urls", "pipe:cat /data/shard-{0..15}.tar")
    assert cli.validate_json(write_job(tmp_path, piped), "--no-check-paths")[0] == 0
    local = tiny_job["data"]["urls"]
    code, out = cli.validate_json(write_job(tmp_path, _set(tiny_job, "data.urls", "file://" + local)))
    assert code == 0, out


def test_compile_options_the_installed_torch_knows_pass(cli, tiny_job, tmp_path):
    """Dotted or nested (as `--set` writes them), '-' or '_'; inductor's CUDA graphs where fsdpclip captures no
    step (here: the CPU)."""
    job = _compiled(tiny_job, {"coordinate_descent_tuning": True, "max-autotune-gemm": False,
                               "triton": {"cudagraphs": True}})
    code, out = cli.validate_json(write_job(tmp_path, job), "--set",
                                  "fsdp.compile_options.triton.unique_kernel_names=true")
    assert (code, out["errors"], out["warnings"]) == (0, [], [])
    code, out = cli.validate_json(write_job(tmp_path, job), "--set", "fsdp.compile_options.triton.cudagraph=true")
    assert [(e["location"], e["hint"]) for e in out["errors"]] == \
        [("fsdp.compile_options.triton.cudagraph", "did you mean 'triton.cudagraphs'?")]


TIMM_IMAGE_TOWER = {"name": "ViT-B-32", "embed_dim": 64, "image": {"timm": {"name": "vit_tiny_patch16_224"}}}


@pytest.mark.parametrize("edits, why", [({"fsdp.compile": False}, "unused: fsdp.compile is false"),
                                        ({}, "unused: compile 'auto' is off on the CPU"),
                                        ({"launch.device": "cuda", "model": TIMM_IMAGE_TOWER},
                                         "unused: compile 'auto' is off on the CPU and for other libraries' blocks"),
                                        ({"launch.device": "cuda", "fsdp.unit_size": 1},
                                         "unused where compile 'auto' leaves blocks eager"),
                                        ({"launch.device": "cuda", "fsdp.unit_size": 1, "launch.gpus_per_node": 1},
                                         None),  # one GPU: the step is graphed, and its blocks compiled
                                        ({"launch.device": "cuda"}, None)])
def test_compile_options_where_nothing_is_compiled_are_reported(cli, tiny_job, tmp_path, edits, why):
    """A warning where the options would go unused: compile off, 'auto' on the CPU or over a timm tower, and
    where 'auto' decides at start (units other than whole towers, several GPUs); none where 'auto' compiles whole
    towers or the blocks of a graphed step."""
    job = _set(tiny_job, "fsdp.compile_options", {"max_autotune": True})
    for dotted, value in edits.items():
        job = _set(job, dotted, value)
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert code == 0, out["errors"]
    warned = [w["message"] for w in out["warnings"] if w["location"] == "fsdp.compile_options"]
    assert len(warned) == (1 if why else 0) and all(why in message for message in warned), warned


def test_compile_options_refused_wherever_torch_compile_refuses_them():
    """Every inductor option of the installed torch × a value of each JSON scalar kind: where torch.compile
    refuses it, validate does too, and where its declared type is a plain one, validate takes what torch takes.
    Literals and unions, which torch leaves unchecked, are checked too."""
    import typing

    import torch
    from torch._inductor import config

    from fsdpclip.validate.checks import compile_option_problem

    disagree = []
    for name in config.get_config_copy():
        for value in (True, 1, 1.5, "x", None):
            try:
                torch.compile(lambda x: x, options={name: value})
                refused = False
            except (RuntimeError, TypeError):
                refused = True
            plain = isinstance(config.get_type(name), type) and typing.get_origin(config.get_type(name)) is None
            if (compile_option_problem(name, value) is not None) != refused and (refused or plain):
                disagree.append((name, value, refused))
    assert disagree == []


def test_declared_types_torch_leaves_unchecked():
    """Literals and unions (torch.compile checks plain types only)."""
    import typing

    from fsdpclip.validate.checks import _fits

    assert [_fits(v, typing.Literal["DEFAULT", "EXHAUSTIVE"]) for v in ("DEFAULT", "default")] == [True, False]
    for optional_int in (typing.Optional[int], int | None):
        assert [_fits(v, optional_int) for v in (None, 64, True, "64", 1.5)] == [True, True, True, False, False]
    assert [_fits(v, float) for v in (1.5, 1)] == [True, False]
    assert _fits(1, dict[str, int]) is False and _fits(1, "SomeType | None") is None


def _script_location(dotted: str, value) -> str:
    return f"{dotted}[0]" if isinstance(value, list) else f"{dotted}.{next(iter(value))}" if isinstance(value, dict) \
        else dotted


@pytest.mark.parametrize("dotted, value", SCRIPT_CASES, ids=[c[0] for c in SCRIPT_CASES])
def test_control_characters_in_script_values_are_refused(cli, tiny_job, tmp_path, dotted, value):
    """Every value `launch --slurm` writes into its batch script is one line of printable text, at validate."""
    code, out = cli.validate_json(write_job(tmp_path, _set(tiny_job, dotted, value)))
    assert code == 2
    match = [e for e in out["errors"] if e["location"] == _script_location(dotted, value)]
    assert match and "control character" in match[0]["message"], out["errors"]


def test_extra_sbatch_items_are_single_options(cli, tiny_job, tmp_path):
    items = ["--exclusive", "--mem=0", "--comment=two words", "--exclusive --mem=0", "-N 2", "--mail-type=END\nid",
             "exclusive"]
    code, out = cli.validate_json(write_job(tmp_path, _set(tiny_job, "launch.slurm.extra_sbatch", items)))
    assert code == 2
    assert [e["location"] for e in out["errors"]] == [f"launch.slurm.extra_sbatch[{i}]" for i in (3, 4, 5, 6)]
    assert "one sbatch option per item" in out["errors"][0]["message"]
    assert "control character" in out["errors"][2]["message"]


def test_a_huge_brace_range_is_counted_not_expanded(cli, tiny_job, tmp_path):
    """10^9 shards are refused at once (they were expanded: minutes and gigabytes); 10^5 present ones are
    checked by a sample (the first, the last and evenly between), which still finds missing ones."""
    billion = _set(tiny_job, "data.urls", "/data/shard-{000000000..999999999}.tar")
    code, out = cli.validate_json(write_job(tmp_path, billion), "--no-check-paths")
    assert code == 2 and out["errors"][0]["location"] == "data.urls"
    assert "1,000,000,000 shards, more than a job may read (1,048,576" in out["errors"][0]["message"]

    many = tmp_path / "many"
    many.mkdir()
    for i in range(0, 100_000, 7):  # a seventh of them: the sample finds the rest missing
        (many / f"{i:05d}.tar").touch()
    job = _set(tiny_job, "data.urls", str(many / "{00000..99999}.tar"))
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert code == 2 and out["errors"][0]["location"] == "data.urls"
    assert " of 1,000 checked (of 100,000) shards not found" in out["errors"][0]["message"]


@pytest.mark.parametrize("flags", [("--world-size", str(2 ** 64)), ("--nodes", str(2 ** 64)),
                                   ("--nodes", str(2 ** 20), "--gpus-per-node", "2")])
def test_world_size_flags_are_bounded(cli, tiny_job, tmp_path, flags):
    """A world of 2^64 ranks was counted through rank by rank; flags and their product stop at 2^20."""
    result = cli("validate", write_job(tmp_path, tiny_job), "--no-check-paths", *flags)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "1048576" in result.output.replace(",", "")


def test_files_the_spec_names_are_regular_bounded_utf8(cli, tiny_job, tmp_path):
    """A FIFO (reading it blocked forever), a device (/dev/zero filled the memory) and non-UTF-8 bytes
    (a raw UnicodeDecodeError): located errors, for the model config, class names, templates and weights."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    latin = tmp_path / "classes.txt"
    latin.write_bytes("zéro\nun\n".encode("latin-1"))
    for config, why in ((fifo, "not a regular file but a FIFO"), ("/dev/zero", "not a regular file but a character "
                                                                              "device"), (latin, "not UTF-8 text")):
        code, out = cli.validate_json(write_job(tmp_path, _set(tiny_job, "model.config", str(config))))
        assert code == 2 and [e["location"] for e in out["errors"]] == ["model.config"], out["errors"]
        assert why in out["errors"][0]["message"]
    zeroshot = {"dataset": "folder", "path": str(tmp_path), "classnames": str(latin), "templates": str(fifo)}
    job = _set(_set(tiny_job, "eval.zeroshot", [zeroshot]), "model.pretrained", "/dev/zero")
    code, out = cli.validate_json(write_job(tmp_path, job))
    errors = {e["location"]: e["message"] for e in out["errors"]}
    assert code == 2 and "not UTF-8 text (byte 0xe9 on line 1)" in errors["eval.zeroshot[0].classnames"]
    assert "FIFO" in errors["eval.zeroshot[0].templates"]
    assert "character device" in errors["model.pretrained"]


@pytest.mark.slow
@pytest.mark.parametrize("content", [None, b'{"model": {"name": "ViT-B-32", "note": "\xe9"}}'])
def test_a_job_file_that_is_no_text_file(tiny_job, tmp_path, content):
    """The job file itself as a FIFO (the command hung) or in Latin-1 (a traceback): a located error, exit 2."""
    import os

    path = tmp_path / "job.json"
    if content is None:
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "fsdpclip", "validate", str(path), "--json"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    error = __import__("json").loads(proc.stdout)["errors"][0]
    assert error["location"] == "(file)"
    assert ("FIFO" if content is None else "not UTF-8 text (byte 0xe9 on line 1)") in error["message"]


def test_a_section_that_does_not_parse_hides_no_other_mistake(cli, tiny_job, tmp_path):
    """A typo in one section (schema) and mistakes of meaning in the sections that parsed: one round shows all,
    and no check that reads the broken section runs on a default in its place."""
    job = _set(_set(_set(tiny_job, "schedule", {"step": 10}), "batch.global_batch", 7), "model", {"name": "ViT-B-32x"})
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert code == 2
    assert {e["location"] for e in out["errors"]} == {"schedule.step", "batch.global_batch", "model.name"}
    job = _set(_set(tiny_job, "batch", {"per_gpu": 0}), "model", {"name": "ViT-B-32x"})
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert {e["location"] for e in out["errors"]} == {"batch.per_gpu", "model.name"}
    job = _set(_set(tiny_job, "data", {"source": "parquet"}), "freeze", {"image": {"blocks": "0:40"}})
    code, out = cli.validate_json(write_job(tmp_path, job))  # the model is checked without the data's preprocessing
    assert {e["location"] for e in out["errors"]} == {"data", "freeze.image.blocks"}
    # the launch section lays out the world: without its layout nothing that counts ranks is checked, unless a flag
    # gives it; a mistake in another of its fields hides nothing
    job = _set(_set(_set(tiny_job, "launch.gpus_per_node", "two"), "batch.global_batch", 7), "model",
               {"name": "ViT-B-32x"})
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert {e["location"] for e in out["errors"]} == {"launch.gpus_per_node", "model.name"}
    code, out = cli.validate_json(write_job(tmp_path, job), "--world-size", "2")
    assert {e["location"] for e in out["errors"]} == {"launch.gpus_per_node", "model.name", "batch.global_batch"}
    job = _set(_set(_set(tiny_job, "launch.device", "gpu"), "batch.global_batch", 7), "model", {"name": "ViT-B-32x"})
    code, out = cli.validate_json(write_job(tmp_path, job))
    assert {e["location"] for e in out["errors"]} == {"launch.device", "model.name", "batch.global_batch"}


def test_a_run_directory_too_deep_for_the_files_a_run_writes(cli, tiny_job, tmp_path):
    """A run directory's path a few bytes under PATH_MAX passed validate, then every rank crashed writing its launch
    record (ENAMETOOLONG): validate counts the longest name a run writes below it."""
    from fsdpclip.validate.checks import longest_run_file

    limit = os.pathconf(tmp_path, "PC_PATH_MAX")
    output_dir = tmp_path
    while len(str(output_dir)) < limit - 200:
        output_dir /= "d" * 150
    output_dir /= "d" * (limit - 20 - len(str(output_dir)))  # RUN_DIR is output_dir/t: 18 bytes under the limit
    code, out = cli.validate_json(write_job(tmp_path, _set(tiny_job, "run.output_dir", str(output_dir))))
    errors = {error["location"]: error["message"] for error in out["errors"]}
    assert code == 2 and "too long a path for the files a run writes" in errors["run.output_dir"], out["errors"]
    assert f"{len(str(output_dir / 't' / longest_run_file())):,} bytes" in errors["run.output_dir"]
    fits = tmp_path / ("d" * 150)
    code, out = cli.validate_json(write_job(tmp_path, _set(tiny_job, "run.output_dir", str(fits))))
    assert code == 0, out["errors"]


def test_weights_the_spec_names_are_checked_for_their_format(cli, tiny_job, tmp_path):
    """`model.pretrained: "/etc/passwd"` passed validate, then every rank failed with an IndexError; a plain pickle
    that runs os.system was refused by torch with its hint to load it with weights_only=False. validate reads each
    local weights file's format (a safetensors header, torch.save's pickle) without loading its tensors, and the
    ranks refuse a pickle with the project's own line."""
    import pickle

    import torch

    from fsdpclip.model.weights import read_state_dict
    from fsdpclip.jobspec.problems import ModelError

    marker = tmp_path / "code-ran"
    text = tmp_path / "passwd.pt"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    zipped, plain, torn = tmp_path / "zipped.pt", tmp_path / "plain.pt", tmp_path / "torn.safetensors"
    torch.save({"state_dict": {"w": RunsCode(marker)}}, zipped)
    plain.write_bytes(pickle.dumps({"w": RunsCode(marker)}, protocol=4))  # torch stops at its FRAME opcode
    torn.write_bytes(b"\xff" * 16)
    fine = tmp_path / "fine.pt"
    torch.save({"w": torch.zeros(2)}, fine)
    for weights, why in ((text, "is no weights file: neither torch.save's format nor safetensors"),
                         (zipped, "holds a pickle that names posix.system: refusing"),
                         (plain, "holds a pickle that names posix.system: refusing"),
                         (torn, "is not a safetensors file")):
        code, out = cli.validate_json(write_job(tmp_path, _set(tiny_job, "model.image.pretrained", str(weights))))
        errors = {error["location"]: error["message"] for error in out["errors"]}
        assert code == 2 and why in errors.get("model.image.pretrained", ""), out["errors"]
    with pytest.raises(ModelError, match="holds a pickle that names posix.system: refusing") as refused:
        read_state_dict(str(plain))
    assert "weights_only" not in str(refused.value)
    assert not marker.exists()
    code, out = cli.validate_json(write_job(tmp_path, _set(tiny_job, "model.image.pretrained", str(fine))))
    assert "model.image.pretrained" not in {error["location"] for error in out["errors"]}, out["errors"]
