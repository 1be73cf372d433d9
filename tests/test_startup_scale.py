"""Start-up: per-rank set-up does no work that grows with the world size (fake process group, up to
1024), and compile work carries over to a launch on another machine through the run directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

import pytest

from conftest import tiny_job_in, write_job
from ranks import REPO, json_result

OURS = ("mesh", "build", "plan", "materialize", "optimizer")


def _counts(world: int) -> dict:
    return json_result([sys.executable, "tests/workers/setup_calls.py", str(world), "ViT-B-32"], timeout=300)


@pytest.mark.slow
def test_setup_work_does_not_grow_with_world_size():
    small, large = _counts(8), _counts(1024)
    for stage in OURS:  # Python calls of each stage, counted by cProfile: equal up to a small margin
        assert large[stage] <= small[stage] * 1.02 + 50, (stage, small[stage], large[stage])
    # Each rank holds its share only: 151M parameters / 1024 ≈ 148K (plus per-tensor padding).
    assert small["local_numel"] > 18_000_000 and large["local_numel"] < 200_000
    # torch's own fully_shard chunks every parameter into world-size pieces (O(world × tensors));
    # measured here, documented in docs/performance.md, not asserted: it is upstream's to change.
    print({"fully_shard calls": (small["fully_shard"], large["fully_shard"])})


# One compiled forward and backward on a fresh machine (its own TORCHINDUCTOR_CACHE_DIR), with the run
# directory's compile cache loaded first ("load") or kept after the step ("save"), as the trainer does. Its
# kernels are scalar C++ (TORCHINDUCTOR_VEC_ISA_OK=0): inductor would otherwise build and load a probe of each
# vector instruction set the CPU has in every fresh cache directory (~5 CPU-seconds of each step here).
COMPILED_STEP = """
import json, sys
from pathlib import Path
import torch
from torch._dynamo.utils import counters
from fsdpclip.parallel.parallelize import load_compile_cache, save_compile_cache
mode, path = sys.argv[1], Path(sys.argv[2])
loaded = load_compile_cache(path) if mode == "load" else 0
model = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)))
model(torch.randn(8, 16)).sum().backward()
saved = save_compile_cache(path) if mode == "save" else 0
print(json.dumps({"loaded": loaded, "saved": saved, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


@pytest.mark.slow
def test_compile_cache_carries_to_a_fresh_machine(tmp_path):
    from fsdpclip.parallel.parallelize import COMPILE_CACHE, load_compile_cache

    if shutil.which("c++") is None:  # inductor compiles CPU kernels with it
        pytest.skip("needs a C++ compiler for torch.compile on the CPU")

    cache = tmp_path / COMPILE_CACHE

    def step(mode: str, machine: str) -> dict:
        return json_result([sys.executable, "-c", COMPILED_STEP, mode, str(cache)], timeout=300,
                           env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / machine), "TORCHINDUCTOR_VEC_ISA_OK": "0"})

    first = step("save", "first-machine")
    assert first["misses"] >= 1 and first["hits"] == 0 and first["saved"] >= 2 and cache.is_file()
    requeued = step("load", "second-machine")  # its own cache is empty: every graph comes from the file
    assert requeued["loaded"] == first["saved"] and requeued["hits"] == first["misses"] and requeued["misses"] == 0
    cache.write_bytes(b"not a compile cache")  # damaged: passed over, never fatal
    assert load_compile_cache(cache) == 0 and load_compile_cache(tmp_path / "absent.bin") == 0
    # torch 2.7's CacheInfo lists each kind in its own field (2.8 on: one dict, as above)
    from types import SimpleNamespace

    from fsdpclip.parallel.parallelize import _artifacts

    assert _artifacts(SimpleNamespace(inductor_artifacts=["a", "b"], autotune_artifacts=[],
                                      aot_autograd_artifacts=["c"], pgo_artifacts=[])) == 3


def test_import_in_background(tmp_path, monkeypatch, capsys):
    """The trainer's and OpenCLIP's imports overlap the process group's set-up: the modules are imported
    once each, in order, on their own thread, and the main thread's import of one meanwhile waits for the
    whole module; a module that fails to import says nothing there (the next one is still imported) and
    fails at the main thread's import, with its own error."""
    from fsdpclip.launch.entry import import_in_background

    (tmp_path / "slow_module.py").write_text(
        "import threading, time\nimported_on = threading.current_thread().name\ntime.sleep(0.5)\nfinished = True\n")
    (tmp_path / "next_module.py").write_text(
        "import sys, threading\nimported_on = threading.current_thread().name\n"
        "after_slow = getattr(sys.modules.get('slow_module'), 'finished', False)\n")
    (tmp_path / "broken_module.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("slow_module", "next_module", "broken_module"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    thread = import_in_background(["slow_module", "next_module"])
    deadline = time.monotonic() + 30
    while "slow_module" not in sys.modules and time.monotonic() < deadline:  # the thread has begun it
        time.sleep(0.001)
    import slow_module  # while the thread still sleeps inside it

    assert getattr(slow_module, "finished", False), "the main thread got a half-imported module"
    assert slow_module.imported_on == thread.name != threading.current_thread().name
    thread.join(timeout=30)
    import next_module

    assert next_module.imported_on == thread.name and next_module.after_slow
    monkeypatch.delitem(sys.modules, "next_module")
    import_in_background(["broken_module", "next_module"]).join(timeout=30)
    assert "broken_module" not in sys.modules and "next_module" in sys.modules
    assert "Traceback" not in capsys.readouterr().err
    try:
        import broken_module  # noqa: F401
    except ImportError as exc:
        assert "broken on purpose" in str(exc)
    else:
        raise AssertionError("the broken module imported")


@pytest.mark.slow
def test_rank_entry_imports_only_what_the_process_group_needs():
    """`python -m fsdpclip.launch.entry` imports torch and the spec, not the trainer's libraries (DTensor and
    sympy, webdataset, OpenCLIP, dynamo): those are imported on a thread while the process group forms."""
    heavy = ["fsdpclip.train.trainer", "fsdpclip.checkpoint.sharded", "torch.distributed.tensor", "sympy", "webdataset",
             "open_clip", "torch._dynamo"]
    code = f"import json, sys, fsdpclip.launch.entry\nprint(json.dumps([m for m in {heavy!r} if m in sys.modules]))\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == []


@pytest.mark.slow
def test_open_clip_imports_without_transformers_for_a_model_without_hugging_face_parts():
    """A model without a Hugging Face text tower, in a job that does not log to W&B, has OpenCLIP imported without
    transformers (its slowest import) and wandb (which timm imports), builds, and both still import afterwards; in
    a fresh interpreter, as on a rank. A job that logs to W&B keeps wandb in (its rank 0 imports it meanwhile)."""
    code = (
        "import sys\n"
        "from fsdpclip.model.build import build_model, left_out_of_open_clip\n"
        "from fsdpclip.jobspec.job import ModelSpec\n"
        "from fsdpclip.launch.entry import import_in_background\n"
        "spec = ModelSpec(name='ViT-B-32')\n"
        "assert left_out_of_open_clip(spec, logs_to_wandb=True) == ('transformers',)\n"
        "assert not {'transformers', 'wandb'} & set(sys.modules), 'imported before OpenCLIP'\n"
        "import_in_background(['open_clip'], absent=left_out_of_open_clip(spec)).join()\n"
        "assert 'open_clip' in sys.modules, 'OpenCLIP was not imported'\n"
        "assert not {'transformers', 'wandb'} & set(sys.modules), 'transformers or wandb was imported'\n"
        "model = build_model(spec)\n"
        "import transformers, wandb\n"
        "print(type(model).__name__, transformers.__name__, wandb.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["CLIP", "transformers", "wandb"]


def test_which_models_may_have_a_hugging_face_text_tower(tmp_path):
    """Read from the spec and the config files without OpenCLIP: OpenCLIP's bundled configs by name, a
    config file of the spec's, a text tower put in by the spec; a config that cannot be read keeps transformers."""
    from fsdpclip.model.build import hf_text_tower
    from fsdpclip.jobspec.job import ModelSpec

    plain, hf = tmp_path / "plain.json", tmp_path / "hf.json"
    plain.write_text(json.dumps({"model_cfg": {"embed_dim": 8, "vision_cfg": {}, "text_cfg": {"width": 8}}}))
    hf.write_text(json.dumps({"embed_dim": 8, "vision_cfg": {}, "text_cfg": {"hf_model_name": "local"}}))
    (tmp_path / "broken.json").write_text("{")
    assert not hf_text_tower(ModelSpec(name="ViT-B-32"))
    assert hf_text_tower(ModelSpec(name="mt5-base-ViT-B-32"))
    assert hf_text_tower(ModelSpec(name="no-such-model"))
    assert not hf_text_tower(ModelSpec(config=str(plain)))
    assert hf_text_tower(ModelSpec(config=str(hf)))
    assert hf_text_tower(ModelSpec(config=str(tmp_path / "broken.json")))
    assert hf_text_tower(ModelSpec(config=str(tmp_path / "missing.json")))
    assert hf_text_tower(ModelSpec(name="ViT-B-32", text={"hf": {"path": str(tmp_path)}}))


def test_flops_are_counted_on_plain_meta_tensors_the_same_as_on_fake_ones(monkeypatch):
    """A model without Hugging Face parts skips the FakeTensorMode (2.5x faster on ViT-B-32) and counts the
    same FLOPs, frozen parameters included."""
    import fsdpclip.model.build
    from torch._subclasses.fake_tensor import FakeTensor

    from fsdpclip.model.build import build_model, fake_batch, training_flops_per_sample
    from fsdpclip.jobspec.job import ModelSpec

    model = build_model(ModelSpec(name="ViT-B-32"))
    model.visual.transformer.resblocks[:6].requires_grad_(False)
    with fake_batch(model) as (images, texts):
        assert not isinstance(images, FakeTensor) and images.is_meta and texts.is_meta
    plain = training_flops_per_sample(model)
    monkeypatch.setattr(fsdpclip.model.build, "holds_hugging_face_modules", lambda model: True)
    with fake_batch(model) as (images, texts):
        assert isinstance(images, FakeTensor)
    assert training_flops_per_sample(model) == plain > 0


# Builds a Trainer on a world of one for each case, in one process: a build that fails in its model build ("fresh",
# "resumed": with a checkpoint to resume from) or after it ("late": building the optimizer), recording the live data
# workers at the failure; argv: the job file of each case, in CASES' order.
CASES = ("fresh", "resumed", "late")
_WORKERS_DURING_BUILD = """
import json, multiprocessing, sys
from pathlib import Path
from fsdpclip.train import trainer
from fsdpclip.parallel.distributed import init_distributed
from fsdpclip.jobspec.jobfile import load_job

env = init_distributed("cpu", 60)
originals = (trainer.Checkpointer.resume_candidates, trainer.build_optimizer, trainer.build_model)
seen = {}
for case, path in zip(%r, sys.argv[1:]):
    job, seen[case] = load_job(Path(path)), {}
    job.run_dir.mkdir(parents=True)

    def fail(*args, case=case, **kwargs):
        seen[case]["during"] = len(multiprocessing.active_children())
        raise RuntimeError("start stopped by the test")

    if case == "resumed":
        trainer.Checkpointer.resume_candidates = lambda self, job=job: [job.run_dir / "step_00000001"]
    if case == "late":
        trainer.build_optimizer = fail
    else:
        trainer.build_model = fail
    try:
        trainer.Trainer(job, env)
    except RuntimeError as exc:  # its traceback still holds the trainer: the workers are stopped, not collected
        seen[case]["error"], seen[case]["after"] = str(exc), len(multiprocessing.active_children())
    trainer.Checkpointer.resume_candidates, trainer.build_optimizer, trainer.build_model = originals
print(json.dumps(seen))
""" % (CASES,)


@pytest.fixture(scope="module")
def workers_during_build(tmp_path_factory, digits_dir) -> dict:
    """What each case of _WORKERS_DURING_BUILD saw, its job 2 data workers on the digits."""
    tmp = tmp_path_factory.mktemp("build")
    paths = []
    for case in CASES:
        job = tiny_job_in(tmp, digits_dir, case)
        job["data"]["workers"], job["launch"]["gpus_per_node"] = 2, 1
        paths.append(write_job(tmp, job, f"{case}.json"))
    return json_result([sys.executable, "-c", _WORKERS_DURING_BUILD, *map(str, paths)], timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_data_workers_of_a_fresh_run_start_before_the_model_is_built(workers_during_build, case):
    """A fresh run's data workers are running while the model is built (they fill their queues
    meanwhile), and stop when the build, or anything after it, fails; a resumed run starts them only
    after its position is loaded."""
    seen = workers_during_build[case]
    assert seen["error"] == "start stopped by the test"
    assert seen["during"] == (0 if case == "resumed" else 2)
    assert seen["after"] == 0
