"""`eval.validation`: held-out image-text shards' contrastive loss against open_clip_train's own `evaluate()`, on one
process and two, during training, in the report, and `validate`'s checks of the set."""

from __future__ import annotations

import copy
import json
import sys
from types import SimpleNamespace

import pytest
import torch
import webdataset as wds

from conftest import TINY_CONFIG, squeezed, synthetic_job, write_job
from ranks import run_group, torchrun

SHARD_SIZES = (13, 9, 6)  # pairs per shard: in batches of 4, short batches at every shard's end


@pytest.fixture(scope="module")
def val_shards(digits_dir, tmp_path_factory) -> str:
    """The held-out digits with their first captions, as image-text shards of SHARD_SIZES pairs (a brace URL)."""
    images = sorted((digits_dir / "test").rglob("*.jpg"))
    root = tmp_path_factory.mktemp("val")
    start = 0
    for shard, size in enumerate(SHARD_SIZES):
        with wds.TarWriter(str(root / f"val-{shard}.tar")) as sink:
            for path in images[start:start + size]:
                caption = path.with_suffix(".txt").read_text().splitlines()[0]
                sink.write({"__key__": path.stem, "jpg": path.read_bytes(), "txt": caption})
        start += size
    return str(root / f"val-{{0..{len(SHARD_SIZES) - 1}}}.tar")


def _tiny_model():
    from fsdpclip.model.build import build_model
    from fsdpclip.jobspec.job import ModelSpec

    torch.manual_seed(0)
    return build_model(ModelSpec(config=str(TINY_CONFIG)), device="cpu").eval()


def _ours(model, urls: str, batch_size: int, workers: int = 0) -> dict:
    from fsdpclip.jobspec.task import EVAL_TASKS
    from fsdpclip.eval.validation import ValidationSpec
    from fsdpclip.model.build import build_tokenizer, image_transform, model_config
    from fsdpclip.jobspec.job import ModelSpec

    task = EVAL_TASKS["validation"]
    dataset = task.load(ValidationSpec(urls=urls, name="digits"), image_transform(model, train=False))
    tokenizer = build_tokenizer(model_config(ModelSpec(config=str(TINY_CONFIG))))
    return task.measure(model, tokenizer, dataset, torch.device("cpu"), batch_size, workers)


def _open_clip_train(model, urls: str, batch_size: int, workers: int) -> dict:
    """open_clip_train's `evaluate()` on `--val-data URLS` (one process, fp32 on the CPU), its loader as its
    `get_wds_dataset(is_train=False)` builds it, written out here (its module imports pandas, which the test
    environment lacks) with its own filter and handler, its model's eval preprocessing and its tokenizer."""
    import open_clip
    from open_clip.transform import PreprocessCfg, image_transform_v2
    from open_clip_train.train import evaluate

    open_clip.add_model_config(TINY_CONFIG)
    theirs = copy.deepcopy(model)
    theirs.output_dict = True  # as open_clip_train creates its models
    args = SimpleNamespace(val_data=urls, val_num_samples=None, batch_size=batch_size, workers=workers, device="cpu",
                           precision="fp32", val_frequency=1, epochs=1, zeroshot_frequency=0, distributed=False,
                           horovod=False, rank=0, local_rank=0, save_logs=False, wandb=False)
    preprocess = image_transform_v2(PreprocessCfg(**model.visual.preprocess_cfg), is_train=False)
    tokenizer = open_clip.get_tokenizer(TINY_CONFIG.stem)

    def log_and_continue(exn):
        return True

    def filter_no_caption_or_no_image(sample):
        return "txt" in sample and any(key in sample for key in ("png", "jpg", "jpeg", "webp"))

    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls), wds.split_by_worker, wds.tarfile_to_samples(handler=log_and_continue),
        wds.select(filter_no_caption_or_no_image), wds.decode("pilrgb", handler=log_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=preprocess, text=lambda text: tokenizer(text)[0]), wds.to_tuple("image", "text"),
        wds.batched(batch_size, partial=True))
    loader = wds.WebLoader(pipeline, batch_size=None, shuffle=False, num_workers=workers,
                           persistent_workers=workers > 0)
    loader.num_samples = 0  # its val_num_samples, not given
    return evaluate(theirs, {"val": SimpleNamespace(dataloader=loader)}, 1, args, tokenizer=tokenizer)


def test_validation_loss_matches_open_clip_train(val_shards):
    """The loss equals open_clip_train's clip_val_loss where its batches are ours (a data worker per shard:
    each shard cut into batches of its own, short ones at their ends, so the batches' weights matter); where the
    set is one batch, the in-batch recall@1 both ways equals its image_to_text_R@1 and text_to_image_R@1."""
    model = _tiny_model()
    ours = _ours(model, val_shards, 4, workers=2)
    theirs = _open_clip_train(model, val_shards, 4, workers=len(SHARD_SIZES))
    assert ours["samples"] == theirs["num_samples"] == sum(SHARD_SIZES) and ours["batch_size"] == 4
    assert ours["loss"] == pytest.approx(theirs["clip_val_loss"], abs=1e-5)
    assert _ours(model, val_shards, 4)["loss"] == pytest.approx(ours["loss"], abs=1e-6)  # without data workers

    one_shard = val_shards.replace(f"{{0..{len(SHARD_SIZES) - 1}}}", "0")
    ours = _ours(model, one_shard, 64)
    theirs = _open_clip_train(model, one_shard, 64, workers=1)
    assert ours["samples"] == theirs["num_samples"] == SHARD_SIZES[0]
    assert ours["loss"] == pytest.approx(theirs["clip_val_loss"], abs=1e-5)
    assert ours["image_to_text_batch_R@1"] == pytest.approx(theirs["image_to_text_R@1"], abs=1e-9)
    assert ours["text_to_image_batch_R@1"] == pytest.approx(theirs["text_to_image_R@1"], abs=1e-9)
    # The batches matter: the same shard in batches of 4 is another loss (open_clip_train's too).
    assert _ours(model, one_shard, 4)["loss"] == pytest.approx(
        _open_clip_train(model, one_shard, 4, workers=1)["clip_val_loss"], abs=1e-5)
    assert abs(_ours(model, one_shard, 4)["loss"] - ours["loss"]) > 1e-3


@pytest.mark.slow
def test_two_ranks_agree_with_one(val_shards, tmp_path, cli):
    """`fsdpclip eval --validation` on one process and sharded over two ranks (shards 0 and 2 on rank 0, shard 1 on
    rank 1, which runs padding forwards while rank 0 goes on): the same loss and recalls."""
    weights = tmp_path / "tiny.pt"
    torch.save(_tiny_model().state_dict(), weights)
    args = [str(weights), "--model-config", str(TINY_CONFIG), "--validation", val_shards, "--batch-size", "4"]
    result = cli("eval", *args, "--workers", "2", "--output", tmp_path / "one.json")
    assert result.exit_code == 0 and squeezed(f"({sum(SHARD_SIZES)} images)") in squeezed(result.stdout), result.output
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["task"] == "contrastive_validation" and one["dataset"] == "val" and one["metrics"]["batch_size"] == 4
    proc = torchrun(["-m", "fsdpclip", "eval", *args, "--workers", "1", "--output", str(tmp_path / "two.json")])
    assert proc.returncode == 0, proc.stdout[-4000:]
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["metrics"] == pytest.approx(one["metrics"], abs=1e-6)
    assert one["metrics"]["loss"] == pytest.approx(_ours(_tiny_model(), val_shards, 4)["loss"], abs=1e-6)


@pytest.mark.slow
def test_validation_during_training_and_in_the_report(val_shards, tmp_path, cli):
    """A short run on 2 CPU ranks evaluates the held-out shards every step and at the end; its last number is
    `fsdpclip eval --validation` of its final checkpoint, and the report draws and lists it."""
    job = {**synthetic_job(tmp_path), "schedule": {"steps": 2}, "logging": {"every_steps": 1},
           "eval": {"validation": [{"urls": val_shards, "name": "digits", "batch_size": 4}], "every_steps": 1}}
    path = write_job(tmp_path, job)
    result = run_group([sys.executable, "-m", "fsdpclip", "train", str(path)], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "step 1 validation digits: loss " in result.stdout
    run_dir = tmp_path / "runs" / "t"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [(r["step"], r["validation/digits"]) for r in records if "validation/digits" in r]
    assert [step for step, _ in evaluated] == [1, 2]
    assert all(values["samples"] == sum(SHARD_SIZES) and values["batch_size"] == 4 for _, values in evaluated)
    assert evaluated[0][1]["loss"] != evaluated[1][1]["loss"]  # the weights changed in between

    again = cli("eval", run_dir, "--validation", val_shards, "--batch-size", "4", "--workers", "0",
                "--output", tmp_path / "final.json")
    assert again.exit_code == 0, again.output
    final = json.loads((tmp_path / "final.json").read_text())["metrics"]
    assert final == pytest.approx({k: v for k, v in evaluated[-1][1].items() if k != "samples"}, abs=1e-5)

    report = cli("report", run_dir, "--json", "--png", tmp_path / "report.png")
    assert report.exit_code == 0, report.output
    info = json.loads(report.stdout)
    assert info["validation"]["digits"] == evaluated[-1][1] and "validation loss" in info["panels"]
    shown = cli("report", run_dir, "--png", tmp_path / "again.png")
    assert squeezed(f"validation digits: loss {evaluated[-1][1]['loss']:.4f}") in squeezed(shown.stdout)


@pytest.mark.slow
def test_the_moving_average_evaluated_during_training_and_after(val_shards, tmp_path, cli):
    """With `eval.ema`, a run's evaluations during training are of its moving average (`ema`), their records say so
    and the report lists them; the last is `fsdpclip eval --ema` of its final checkpoint (its record saying so
    too), and another number than `fsdpclip eval` of the weights."""
    job = {**synthetic_job(tmp_path), "schedule": {"steps": 2}, "logging": {"every_steps": 1}, "ema": {"decay": 0.5},
           "eval": {"validation": [{"urls": val_shards, "name": "digits", "batch_size": 4}], "every_steps": 1,
                    "ema": True}}
    result = run_group([sys.executable, "-m", "fsdpclip", "train", str(write_job(tmp_path, job))], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "step 1 EMA validation digits: loss " in result.stdout
    run_dir = tmp_path / "runs" / "t"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "validation/digits" in r]
    assert [(r["step"], r["weights"]) for r in evaluated] == [(1, "ema"), (2, "ema")]

    args = [run_dir, "--validation", val_shards, "--batch-size", "4", "--workers", "0", "--output"]
    averaged, trained = cli("eval", *args, tmp_path / "ema.json", "--ema"), cli("eval", *args, tmp_path / "w.json")
    assert averaged.exit_code == 0 and trained.exit_code == 0, averaged.output
    assert "(its moving average)" in averaged.stdout
    final, plain = (json.loads((tmp_path / name).read_text()) for name in ("ema.json", "w.json"))
    assert final["weights"] == "ema" and "weights" not in plain
    last = {k: v for k, v in evaluated[-1]["validation/digits"].items() if k != "samples"}
    assert final["metrics"] == pytest.approx(last, abs=1e-5)
    assert abs(plain["metrics"]["loss"] - final["metrics"]["loss"]) > 1e-4
    report = cli("report", run_dir, "--json")
    assert report.exit_code == 0
    assert json.loads(report.stdout)["validation"]["digits"] == evaluated[-1]["validation/digits"]


def test_validation_sets_are_checked(tmp_path, val_shards, cli):
    """validate: the shard URLs parse, name shards there are (local ones present) that the reader can open, and two
    sets do not share a name; `fsdpclip eval --validation` takes none of the other tasks' flags."""
    job = synthetic_job(tmp_path)
    sets = [{"urls": str(tmp_path / "val-{0..3.tar")}, {"urls": str(tmp_path / "missing-{0..1}.tar"), "name": "m"},
            {"urls": "s3://bucket/val-{0..1}.tar", "name": "s3"}, {"urls": val_shards, "name": "m"}]
    code, out = cli.validate_json(write_job(tmp_path, {**job, "eval": {"validation": sets}}))
    assert code == 2
    problems = sorted((e["location"], e["message"]) for e in out["errors"])
    assert [location for location, _ in problems] == ["eval.validation[0].urls", "eval.validation[1].urls",
                                                      "eval.validation[2].urls", "eval.validation[3]"], problems
    assert "unbalanced braces" in problems[0][1] and problems[1][1] == "2 of 2 shards not found"
    assert "the data reader cannot open 's3:' URLs" in problems[2][1]
    assert problems[3][1] == "a second set named 'm'"
    code, out = cli.validate_json(write_job(tmp_path, {**job, "eval": {"validation": [{"urls": []}]}}))
    assert [(e["location"], e["message"]) for e in out["errors"]] == [("eval.validation[0].urls", "no shards")]
    code, out = cli.validate_json(write_job(tmp_path, {**job, "eval": {"validation": [{"urls": val_shards,
                                                                                        "batch_size": 0}]}}))
    assert [e["location"] for e in out["errors"]] == ["eval.validation[0].batch_size"]
    code, out = cli.validate_json(write_job(tmp_path, {**job, "eval": {"validation": [{"urls": val_shards}],
                                                                       "every_steps": 2}}))
    assert code == 0, out

    for args, message in [(("--data", tmp_path), "--data, --classnames and --templates are for --zeroshot"),
                          (("--max-samples", "3"), "--max-samples is not for --validation")]:
        result = cli("eval", tmp_path, "--validation", val_shards, *args)
        assert result.exit_code == 2 and squeezed(message) in squeezed(result.output), result.output
