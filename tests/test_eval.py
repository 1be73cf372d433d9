"""`fsdpclip eval` (zero-shot and retrieval) against CLIP_benchmark's own metric code, on one process and two."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
import webdataset as wds

from conftest import TINY_CONFIG, Cli, hangs_fail_after, squeezed, write_job
from ranks import torchrun

TEMPLATES = ["a photo of the number {c}.", "the digit {c}.", "a handwritten {c}."]


@pytest.fixture(scope="module")
def trained(demo_run, tmp_path_factory):
    """The demo run (40 steps on the digits, checkpointed) and its export."""
    run_dir, _ = demo_run
    exported = tmp_path_factory.mktemp("exported") / "tiny.pt"
    result = Cli()("export", run_dir, exported)
    assert result.exit_code == 0, result.output
    return run_dir, exported


def _reference(weights, dataloader, classnames):
    """CLIP_benchmark's classifier and logits, on the exported weights loaded by OpenCLIP itself.

    Its evaluate() then takes top-k accuracies and sklearn's balanced accuracy; its accuracy()
    helper fails under NumPy 2 ("only 0-dimensional arrays can be converted to Python scalars"),
    so those two lines are taken here the same way.
    """
    import open_clip
    from clip_benchmark.metrics.zeroshot_classification import run_classification, zero_shot_classifier
    from sklearn.metrics import balanced_accuracy_score

    open_clip.add_model_config(TINY_CONFIG)
    model, _, preprocess = open_clip.create_model_and_transforms(TINY_CONFIG.stem, pretrained=str(weights))
    model.eval()
    tokenizer = open_clip.get_tokenizer(TINY_CONFIG.stem)
    classifier = zero_shot_classifier(model, tokenizer, classnames, TEMPLATES, "cpu", amp=False)
    logits, target = run_classification(model, classifier, dataloader(preprocess), "cpu", amp=False)
    top5 = logits.topk(5, dim=1).indices
    return {"acc1": (top5[:, 0] == target).float().mean().item(),
            "acc5": (top5 == target[:, None]).any(dim=1).float().mean().item(),
            "mean_per_class_recall": balanced_accuracy_score(target, logits.argmax(dim=1))}


def _ours(cli, tmp_path, *args) -> dict:
    out = tmp_path / "ours.json"
    result = cli("eval", *args, "--output", out, "--workers", "0")
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def _assert_same(record: dict, reference: dict):
    for key in ("acc1", "acc5", "mean_per_class_recall"):
        assert record["metrics"][key] == pytest.approx(reference[key], abs=1e-6), key


@pytest.mark.slow
def test_folder_matches_clip_benchmark(trained, digits_dir, tmp_path, cli):
    from torchvision.datasets import ImageFolder

    from fsdpclip.data.digits import CLASSNAMES

    run_dir, weights = trained
    record = _ours(cli, tmp_path, run_dir, "--zeroshot", "digits", "--data", digits_dir / "test")
    assert "folder_classes" not in record  # folders 0-9 are paired with the digits' class list, as made to be
    assert set(record) == {"dataset", "model", "pretrained", "task", "metrics", "language"}
    assert record["task"] == "zeroshot_classification" and record["dataset"] == "digits"
    assert record["metrics"]["acc1"] > 0.2  # trained: well above chance (0.1)

    def loader(preprocess):
        return torch.utils.data.DataLoader(ImageFolder(str(digits_dir / "test"), transform=preprocess), batch_size=50)

    _assert_same(record, _reference(weights, loader, list(CLASSNAMES)))
    exported = _ours(cli, tmp_path, weights, "--model-config", TINY_CONFIG, "--zeroshot", "digits",
                     "--data", digits_dir / "test")
    assert exported["metrics"] == record["metrics"]
    # Folders named after their classes, the names listed in label order (not sorted): matched by name.
    named = tmp_path / "named"
    for label, name in enumerate(CLASSNAMES):
        shutil.copytree(digits_dir / "test" / str(label), named / name)
    by_name = _ours(cli, tmp_path, run_dir, "--zeroshot", "folder", "--data", named, "--classnames",
                    _names(tmp_path, CLASSNAMES), "--templates", _templates(tmp_path))
    assert by_name["metrics"] == pytest.approx(record["metrics"], abs=1e-6) and "folder_classes" not in by_name
    unnamed = _ours(cli, tmp_path, run_dir, "--zeroshot", "folder", "--data", named, "--templates",
                    _templates(tmp_path))
    assert unnamed["metrics"] == by_name["metrics"] and "folder_classes" not in unnamed  # the folder names
    # The trainer's own evaluation of the same weights (2 sharded ranks, eval.batch_per_gpu 37) agrees.
    logged = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "zeroshot/digits" in r][-1]["zeroshot/digits"]
    for key, value in record["metrics"].items():
        assert logged[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.slow
def test_two_ranks_agree_with_one(trained, digits_dir, tmp_path, cli):
    run_dir, _ = trained
    one = _ours(cli, tmp_path, run_dir, "--zeroshot", "digits", "--data", digits_dir / "test")
    out = tmp_path / "two.json"
    proc = torchrun(["-m", "fsdpclip", "eval", str(run_dir), "--zeroshot", "digits", "--data",
                     str(digits_dir / "test"), "--output", str(out), "--workers", "0", "--batch-size", "37"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    two = json.loads(out.read_text())
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, abs=1e-6)


@pytest.fixture(scope="module")
def wds_digits(digits_dir, tmp_path_factory):
    """The held-out digits in CLIP_benchmark's wds layout (test/nshards.txt, .cls labels, classnames.txt,
    templates): (root, shards)."""
    from PIL import Image
    from torchvision.datasets import ImageFolder

    from fsdpclip.data.digits import CLASSNAMES

    root = tmp_path_factory.mktemp("wds")
    (root / "test").mkdir(parents=True)
    images = ImageFolder(str(digits_dir / "test"))
    shards = 3
    for shard in range(shards):
        with wds.TarWriter(str(root / "test" / f"{shard}.tar")) as sink:
            for i in range(shard, len(images), shards):
                path, label = images.samples[i]
                sink.write({"__key__": f"s{i:05d}", "webp": _webp(Image.open(path)), "cls": label})
    (root / "test" / "nshards.txt").write_text(f"{shards}\n")
    (root / "classnames.txt").write_text("\n".join(CLASSNAMES) + "\n")
    (root / "zeroshot_classification_templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    return root, shards


@pytest.mark.slow
def test_clip_benchmark_webdataset_layout(trained, wds_digits, tmp_path, cli):
    """CLIP_benchmark's wds layout (test/nshards.txt, .cls labels, classnames.txt, templates.txt)."""
    from fsdpclip.data.digits import CLASSNAMES

    run_dir, weights = trained
    root, shards = wds_digits
    record = _ours(cli, tmp_path, run_dir, "--zeroshot", "folder", "--data", root)

    def loader(preprocess):  # as clip_benchmark.datasets.builder.build_wds_dataset reads it
        pattern = str(root / "test" / f"{{0..{shards - 1}}}.tar")
        dataset = (wds.WebDataset(pattern, nodesplitter=lambda src: src, shardshuffle=False)
                   .decode(wds.autodecode.ImageHandler("pil", extensions=["webp", "png", "jpg", "jpeg"]))
                   .to_tuple(["webp", "png", "jpg", "jpeg"], "cls").map_tuple(preprocess, None))
        dataset.classes = list(CLASSNAMES)
        return torch.utils.data.DataLoader(dataset.batched(40), batch_size=None)

    _assert_same(record, _reference(weights, loader, list(CLASSNAMES)))


@pytest.mark.slow
def test_max_samples_is_exact(trained, wds_digits, digits_dir, cli):
    """--max-samples N evaluates N images whatever the data workers and ranks (CLIP_benchmark's wds
    layout, whose shards are read by workers, and the folder layout)."""
    run_dir, _ = trained
    root, _ = wds_digits
    for data in (root, digits_dir / "test"):
        kind = "folder" if data == root else "digits"
        for workers in ("1", "2", "4"):
            result = cli("eval", run_dir, "--zeroshot", kind, "--data", data, "--max-samples", "5", "--workers", workers,
                         "--batch-size", "2")
            assert result.exit_code == 0 and "(5 images)" in result.stdout, (data, workers, result.output[-2000:])
    proc = torchrun(["-m", "fsdpclip", "eval", str(run_dir), "--zeroshot", "folder", "--data", str(root),
                     "--max-samples", "7", "--workers", "2", "--batch-size", "2"])
    assert proc.returncode == 0 and "(7 images)" in proc.stdout, proc.stdout[-3000:]


def _webp(image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="WEBP", lossless=True)
    return buffer.getvalue()


@pytest.mark.slow
def test_bad_inputs_are_clear(trained, digits_dir, tmp_path, cli):
    run_dir, weights = trained
    cases = [
        ((run_dir, "--zeroshot", "digits", "--data", tmp_path / "nowhere"), "dataset folder not found"),
        ((run_dir, "--zeroshot", "imagenet", "--data", digits_dir / "test"),
         "has 10 class folders but the imagenet class list names 1000 classes"),
        ((run_dir, "--zeroshot", "folder", "--data", digits_dir / "test", "--classnames", _names(tmp_path, 9)),
         "has 10 class folders but"),
        ((run_dir, "--zeroshot", "digits", "--data", digits_dir / "test" / "3"), "has no class folders"),
        ((weights, "--zeroshot", "digits", "--data", digits_dir / "test"), "give --model NAME or --model-config"),
        ((weights, "--model", "ViT-B-32", "--zeroshot", "digits", "--data", digits_dir / "test"),
         "holds the weights of another model than ViT-B-32"),
        ((tmp_path, "--zeroshot", "digits", "--data", digits_dir / "test"), "is not a checkpoint"),
        ((run_dir, "--zeroshot", "digits", "--data", _empty_classes(tmp_path)), "Found no valid file"),
        ((run_dir, "--model", "ViT-B-32", "--zeroshot", "digits", "--data", digits_dir / "test"),
         "names its own model: --model and --model-config are for exported weights files"),
    ]
    for args, message in cases:
        result = cli("eval", *args)
        assert result.exit_code == 2, (args, result.output)
        assert squeezed(message) in squeezed(result.output), (message, result.output)
        assert "Traceback" not in result.output


def test_each_tasks_flags_are_read_back_as_its_set():
    """The options a finished launch prints to evaluate a set again (`EvalTask.flags`) give that set back."""
    from fsdpclip.eval.retrieval import RetrievalSpec
    from fsdpclip.jobspec.task import task_of
    from fsdpclip.eval.zeroshot import ZeroShotSpec

    for spec in (ZeroShotSpec(dataset="folder", path="/d", classnames="/n.txt", templates="simple", max_samples=5),
                 ZeroShotSpec(dataset="digits", path="/digits"), RetrievalSpec(path="/r", max_samples=3)):
        kind, value, *options = task_of(spec).flags(spec)
        given = dict(zip(options[::2], options[1::2]))
        samples = given.pop("--max-samples", None)
        read = task_of(spec).spec_from_flags(value, given.pop("--data", None), given.pop("--classnames", None),
                                             given.pop("--templates", None), samples and int(samples))
        assert kind == f"--{task_of(spec).kind}" and given == {} and read == spec


def test_weights_of_another_model_are_named_as_such(tmp_path, digits_dir, cli):
    """The tiny model's weights evaluated as ViT-B-32: one line naming both models and a tensor of another
    size, instead of OpenCLIP's 'text pos_embed width changed!'."""
    import open_clip

    open_clip.add_model_config(TINY_CONFIG)
    weights = tmp_path / "tiny.pt"
    torch.save(open_clip.create_model(TINY_CONFIG.stem).state_dict(), weights)
    result = cli("eval", weights, "--model", "ViT-B-32", "--zeroshot", "digits", "--data", digits_dir / "test")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    line = squeezed(result.output)
    assert squeezed(f"{weights} holds the weights of another model than ViT-B-32:") in line, result.output
    assert re.search(r"is\[[0-9,]+\]there,\[[0-9,]+\]inViT-B-32;[0-9]+tensorsofanothersize", line), result.output
    assert "pos_embed width changed" not in result.output


def test_weights_of_another_model_in_the_legacy_format_are_named_as_such(tmp_path, digits_dir, cli):
    """The same in the pre-zip format of torch.save (which cannot be memory-mapped): the same one line, not a
    RuntimeError about mmap."""
    import open_clip

    open_clip.add_model_config(TINY_CONFIG)
    weights = tmp_path / "tiny-legacy.pt"
    torch.save(open_clip.create_model(TINY_CONFIG.stem).state_dict(), weights, _use_new_zipfile_serialization=False)
    result = cli("eval", weights, "--model", "ViT-B-32", "--zeroshot", "digits", "--data", digits_dir / "test")
    assert result.exit_code == 2 and "mmap" not in result.output, result.output
    assert squeezed(f"{weights} holds the weights of another model than ViT-B-32:") in squeezed(result.output)


def _empty_classes(tmp_path):
    """Ten class folders with no image in them."""
    root = tmp_path / "empty"
    for label in range(10):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
    return root


def _names(tmp_path, names):
    """A class-name file: `names` (a count: 'class 0', 'class 1', ...)."""
    names = [f"class {i}" for i in range(names)] if isinstance(names, int) else list(names)
    path = tmp_path / f"names{len(names)}.txt"
    path.write_text("\n".join(names) + "\n")
    return path


def _templates(tmp_path):
    path = tmp_path / "templates.txt"
    path.write_text("\n".join(TEMPLATES) + "\n")
    return path


# ---------------------------------------------------------------------- retrieval
RECALL_KEYS = {f"{d}_retrieval_recall@{k}" for d in ("image", "text") for k in (1, 5, 10)}


def _retrieval_reference(weights, dataloader) -> dict:
    """CLIP_benchmark's own zeroshot_retrieval.evaluate on the exported weights loaded by OpenCLIP itself."""
    import open_clip
    from clip_benchmark.metrics.zeroshot_retrieval import evaluate

    open_clip.add_model_config(TINY_CONFIG)
    model, _, preprocess = open_clip.create_model_and_transforms(TINY_CONFIG.stem, pretrained=str(weights))
    model.eval()
    tokenizer = open_clip.get_tokenizer(TINY_CONFIG.stem)
    return evaluate(model, dataloader(preprocess), tokenizer, "cpu", amp=False, recall_k_list=[1, 5, 10])


def _pairs(folder) -> list:
    """(image path, captions) of a folder of image/caption pairs, in the order ours reads them."""
    return [(p, p.with_suffix(".txt").read_text().splitlines()) for p in sorted(folder.rglob("*.jpg"))]


@pytest.fixture(scope="module")
def wds_retrieval(digits_dir, tmp_path_factory):
    """The held-out digits with their captions in CLIP_benchmark's retrieval layout, written by its own
    converter (dataset_type.txt 'retrieval', test/nshards.txt, webp + .txt captions), in 4 shards."""
    from clip_benchmark.webdataset_builder import convert_retrieval_dataset
    from PIL import Image

    root = tmp_path_factory.mktemp("wds-retrieval")
    pairs = [(_webp(Image.open(path)), captions) for path, captions in _pairs(digits_dir / "test")]
    convert_retrieval_dataset(pairs, "test", str(root), max_count=100, verbose=False)
    return root


@pytest.mark.slow
def test_retrieval_matches_clip_benchmark(trained, digits_dir, wds_retrieval, tmp_path, cli):
    """Recall@1/5/10 both ways on the digits test split with its captions, as a folder of image/caption pairs
    and in CLIP_benchmark's retrieval shards, equal CLIP_benchmark's own numbers; the trainer's evaluation of
    the same weights (2 sharded ranks, 37 images per forward) agrees."""
    from clip_benchmark.datasets.builder import build_wds_dataset, image_captions_collate_fn
    from PIL import Image

    run_dir, weights = trained
    pairs = _pairs(digits_dir / "test")
    counts = f"({len(pairs)} images, {sum(len(c) for _, c in pairs)} captions)"
    result = cli("eval", run_dir, "--retrieval", digits_dir / "test", "--output", tmp_path / "folder.json",
                 "--workers", "0")
    assert result.exit_code == 0 and squeezed(counts) in squeezed(result.stdout), result.output
    folder = json.loads((tmp_path / "folder.json").read_text())
    assert set(folder) == {"dataset", "model", "pretrained", "task", "metrics", "language"}
    assert folder["task"] == "zeroshot_retrieval" and folder["dataset"] == "test" and set(folder["metrics"]) == RECALL_KEYS
    assert folder["metrics"]["image_retrieval_recall@10"] > 10 / len(pairs)  # trained: above chance

    def pairs_loader(preprocess):
        dataset = [(preprocess(Image.open(path).convert("RGB")), captions) for path, captions in pairs]
        return torch.utils.data.DataLoader(dataset, batch_size=50, collate_fn=image_captions_collate_fn)

    _assert_same_recalls(folder, _retrieval_reference(weights, pairs_loader))

    result = cli("eval", weights, "--model-config", TINY_CONFIG, "--retrieval", wds_retrieval, "--batch-size", "23",
                 "--workers", "2", "--output", tmp_path / "shards.json")  # 2 data workers over 4 shards
    assert result.exit_code == 0 and squeezed(counts) in squeezed(result.stdout), result.output
    shards = json.loads((tmp_path / "shards.json").read_text())

    def wds_loader(preprocess):  # as CLIP_benchmark's cli reads a wds/ dataset
        dataset = build_wds_dataset("digits", preprocess, split="test", data_dir=str(wds_retrieval))
        return torch.utils.data.DataLoader(dataset.batched(50), batch_size=None, shuffle=False)

    _assert_same_recalls(shards, _retrieval_reference(weights, wds_loader))
    logged = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "retrieval/digits" in r][-1]["retrieval/digits"]
    _assert_same_recalls(folder, logged)


def _assert_same_recalls(record: dict, reference: dict):
    for key in RECALL_KEYS:
        assert record["metrics"][key] == pytest.approx(reference[key], abs=1e-6), key


@pytest.mark.slow
def test_retrieval_bad_inputs_are_clear(trained, digits_dir, wds_digits, wds_retrieval, tmp_path, cli):
    """A retrieval set that is missing or misshapen, or flags that do not go with --retrieval: exit 2 and
    one line that says where."""
    run_dir, _ = trained
    bare = tmp_path / "bare"  # images without their captions
    shutil.copytree(digits_dir / "test" / "3", bare, ignore=shutil.ignore_patterns("*.txt"))
    blank = tmp_path / "blank"  # a caption file with no caption in it
    shutil.copytree(digits_dir / "test" / "3", blank)
    next(blank.glob("*.txt")).write_text("\n  \n")
    classified = tmp_path / "classified"  # CLIP_benchmark's classification shards, said so
    shutil.copytree(wds_digits[0], classified)
    (classified / "dataset_type.txt").write_text("classification\n")
    short = tmp_path / "short"  # nshards.txt names more shards than there are
    shutil.copytree(wds_retrieval, short)
    (short / "test" / "nshards.txt").write_text("9\n")
    cases = [
        (("--retrieval", tmp_path / "nowhere"), "retrieval dataset folder not found"),
        (("--retrieval", tmp_path / "empty-dir"), "holds no images: a retrieval set is a folder of image/caption pairs"),
        (("--retrieval", bare), "has no caption file"),
        (("--retrieval", blank), ".txt holds no caption"),
        (("--retrieval", classified), "dataset_type.txt says 'classification'"),
        (("--retrieval", wds_digits[0]), "0.tar: sample s00000 has no captions (.txt, one per line)"),
        (("--retrieval", short), "nshards.txt names 9 shards but"),
        ((), ("give --zeroshot KIND --data DIR (classification), --retrieval DIR (image-text retrieval) or "
              "--validation SHARDS")),
        (("--retrieval", bare, "--zeroshot", "digits"), "give --zeroshot KIND --data DIR"),
        (("--retrieval", bare, "--data", bare), "--data, --classnames and --templates are for --zeroshot"),
        (("--zeroshot", "digits"), "--zeroshot needs --data DIR"),
    ]
    (tmp_path / "empty-dir").mkdir()
    for args, message in cases:
        result = cli("eval", run_dir, *args, "--workers", "2")
        assert result.exit_code == 2, (args, result.output)
        assert squeezed(message) in squeezed(result.output), (message, result.output)
        assert "Traceback" not in result.output


def test_retrieval_spec_is_checked(tiny_job, digits_dir, tmp_path, cli):
    """validate: a retrieval set's folder must exist and hold a retrieval set; two sets may not share a name."""
    bare = tmp_path / "bare"  # images without their captions
    shutil.copytree(digits_dir / "test" / "3", bare, ignore=shutil.ignore_patterns("*.txt"))
    tiny_job["eval"] = {"retrieval": [{"path": str(tmp_path / "nowhere")}, {"path": str(bare), "name": "nowhere"},
                                      {"path": str(digits_dir / "test")}]}
    code, out = cli.validate_json(write_job(tmp_path, tiny_job))
    assert code == 2
    problems = sorted((e["location"], e["message"]) for e in out["errors"])
    assert [location for location, _ in problems] == ["eval.retrieval[0].path", "eval.retrieval[1]",
                                                      "eval.retrieval[1].path"], problems
    assert "retrieval dataset folder not found" in problems[0][1] and "has no caption file" in problems[2][1]
    assert problems[1][1] == "a second set named 'nowhere'"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zeroshot", "retrieval"])
def test_a_failure_mid_set_stops_the_data_workers(digits_dir, kind):
    """An evaluation that fails mid-set (a CUDA out-of-memory, a collective timing out) stops its data
    workers at once: they ignore the stop signals, and a rank holding them in its traceback would never
    exit (multiprocessing waits for them at exit)."""
    import multiprocessing

    from fsdpclip.eval.retrieval import RetrievalSpec
    from fsdpclip.jobspec.task import evaluate_set, load_eval_set
    from fsdpclip.eval.zeroshot import ZeroShotSpec
    from fsdpclip.model.build import build_model, build_tokenizer, image_transform, model_config
    from fsdpclip.jobspec.job import ModelSpec

    spec = ModelSpec(config=str(TINY_CONFIG))
    model = build_model(spec, device="cpu")
    path = str(digits_dir / "test")
    set_spec = ZeroShotSpec(dataset="digits", path=path) if kind == "zeroshot" else RetrievalSpec(path=path, name="d")
    data = load_eval_set(set_spec, image_transform(model, train=False))

    def encode_image(images, **kwargs):
        assert len(multiprocessing.active_children()) == 2  # the set's data workers
        raise RuntimeError("out of memory (the test's)")

    model.encode_image = encode_image
    with pytest.raises(RuntimeError, match="the test's") as failure:
        evaluate_set(model, build_tokenizer(model_config(spec)), data, torch.device("cpu"), 4, workers=2)
    assert failure.value.__traceback__ is not None  # the failing frames are still held, as in a rank's crash
    assert multiprocessing.active_children() == []


def test_an_unwritable_output_is_found_before_the_evaluation(digits_dir, tmp_path, cli):
    """--output where no file can be written (under a file; a directory; a FIFO, whose opening waited forever for a
    reader): said before the checkpoint is even read (here it does not exist), not after the whole evaluation;
    nothing is left behind."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    os.mkfifo(tmp_path / "a-fifo")
    for output, why in ((tmp_path / "a-file" / "result.json", f"{tmp_path / 'a-file'} is not a directory"),
                        (tmp_path / "a-folder", "not a regular file but a directory"),
                        (tmp_path / "a-fifo", "not a regular file but a FIFO")):
        with hangs_fail_after(20):
            result = cli("eval", tmp_path / "no-run", "--zeroshot", "digits", "--data", digits_dir / "test",
                         "--output", output)
        assert result.exit_code == 2, result.output
        assert squeezed(result.output).startswith(squeezed(f"✗ cannot write {output}: {why}")), result.output
    writable = tmp_path / "new" / "result.json"
    result = cli("eval", tmp_path / "no-run", "--zeroshot", "digits", "--data", digits_dir / "test",
                 "--output", writable)
    assert result.exit_code == 2 and "no-run is not a checkpoint" in result.output and not writable.exists(), result.output


def test_the_resolved_preprocess_is_what_eval_export_and_resume_read(tiny_job):
    """A published tag's own mean and std (SigLIP's webli: 0.5) are the model's; data.preprocess is applied over
    them in the config the trainer saves with each checkpoint, so a model built from it (eval of a run or
    checkpoint, export) evaluates with OpenCLIP's transform for those options; a relaunch that changes them
    changes no fixed field and keeps the data position."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    from fsdpclip.model.build import image_transform, model_config, model_from_config, training_config
    from fsdpclip.jobspec.job import Job, ModelSpec
    from fsdpclip.jobspec.resume import checkpoint_changes, is_fixed, keeps_data_position

    siglip = model_config(ModelSpec(name="ViT-B-16-SigLIP", pretrained="webli"))["preprocess_cfg"]
    assert siglip["mean"] == siglip["std"] == [0.5, 0.5, 0.5]
    preprocess = {"mean": [0.1, 0.2, 0.3], "std": [0.3, 0.2, 0.1], "interpolation": "bilinear", "resize_mode": "longest"}
    job = Job.model_validate(dict(tiny_job, data={**tiny_job["data"], "preprocess": preprocess}))
    saved = json.loads(json.dumps(training_config(job)))  # as a checkpoint's meta.json holds it
    transform = image_transform(model_from_config(saved), train=False)
    want = image_transform_v2(PreprocessCfg(size=32, **preprocess), is_train=False)
    assert repr(transform) == repr(want) and transform.transforms[-1].mean == [0.1, 0.2, 0.3]
    before = Job.model_validate(tiny_job)
    meta = {"job": json.loads(before.to_json()), "model": {"open_clip_config": training_config(before)}}
    changes = checkpoint_changes(meta, job, training_config(job), lambda: None)
    assert {c.field for c in changes} == {f"data.preprocess.{key}" for key in preprocess}
    assert not any(is_fixed(c) for c in changes) and keeps_data_position(changes)


def test_eval_ema_is_for_the_checkpoints_of_a_run(tmp_path, cli, digits_dir):
    """`eval --ema` evaluates the moving average a run's checkpoint holds: an exported weights file has none, and one
    line says so before anything is read."""
    result = cli("eval", tmp_path / "model.pt", "--model", "ViT-B-32", "--zeroshot", "digits", "--data",
                 digits_dir / "test", "--ema")
    assert result.exit_code == 2, result.output
    assert squeezed(f"{tmp_path / 'model.pt'} is not an fsdpclip checkpoint: --ema reads the moving average a run's "
                    "checkpoint holds") in squeezed(result.output)
