"""`fsdpclip data shards` (a caption table or a folder of images → webdataset shards the trainer reads) and
`fsdpclip data resize` (existing shards' images shrunk): what they write, what they skip, and an interrupted
run continued."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from conftest import REPO, synthetic_job, write_job
from fsdpclip.data.stream import ShardStream
from fsdpclip.data.tarshards import shard_samples, tar_members
from fsdpclip.jobspec.urls import shard_urls
from fsdpclip.jobspec.webdataset_spec import WebDatasetSpec
from fsdpclip.data.writer import _file_name, brace_pattern, short_side_for


def photo(seed: int, width: int, height: int, mode: str = "RGB") -> Image.Image:
    """A smooth random image (JPEG-friendly, like a photo)."""
    coarse = np.random.default_rng(seed).integers(0, 256, (4, 5, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BICUBIC).convert(mode)


def save(image: Image.Image, path: Path, fmt: str = "JPEG") -> Path:
    image.save(path, fmt)
    return path


def data_block(output: str) -> dict:
    """The `data` block `data shards` and `data resize` print last."""
    return json.loads(output[output.rindex('{\n  "data"'):])["data"]


def samples_of(urls: str) -> list[dict]:
    """Every sample of the shards, in order, as the reader groups their members."""
    return [sample for url in shard_urls(urls) for sample in shard_samples(url, lambda exc: False)]


def read_back(data: dict) -> dict[str, tuple[int, int]]:
    """caption → image size (width, height) of every sample, read as the trainer reads them: the printed data
    block as the webdataset source's spec, its shards through the data workers' stream ("cpu" decode), none
    broken."""
    spec = WebDatasetSpec(**data, shuffle_buffer=0, workers=0, decode="cpu")
    sizes: list[tuple[int, int]] = []

    def preprocess(image):
        sizes.append(image.size)
        return torch.zeros(1)

    captions: list[str] = []
    stream = ShardStream(spec, preprocess, lambda texts: captions.extend(texts) or torch.zeros(len(texts)), 1,
                         rank=0, world_size=1, seed=0)
    batches = stream.worker_batches(0, 1)
    for _ in range(spec.samples):
        assert next(batches)["broken"] == 0
    return dict(zip(captions, sizes))


def test_a_caption_table_becomes_shards_the_trainer_reads(cli, tmp_path):
    """A CSV with open_clip_train's columns (filepath, title; relative paths from the table's folder): large
    images shrunk to the short side, a small JPEG kept as it was, a PNG and a CMYK JPEG re-encoded; a missing
    file, an unreadable one and a zero-byte one skipped and counted. The printed data block trains on them:
    the reader reads every caption with its image at the expected size."""
    images = tmp_path / "images"
    images.mkdir()
    rows = [(save(photo(0, 400, 300), images / "wide.jpg"), "a wide photo", (85, 64)),
            (save(photo(1, 200, 500), images / "tall.jpg"), "a tall photo", (64, 160)),
            (save(photo(2, 50, 40), images / "small.jpg"), "a small photo", (50, 40)),
            (save(photo(3, 128, 96), images / "drawing.png", "PNG"), "a png, with a comma", (85, 64)),
            (save(photo(4, 64, 64, "CMYK"), images / "print.jpg"), "a cmyk photo", (64, 64))]
    (images / "unreadable.jpg").write_bytes(b"not an image")
    (images / "empty.jpg").write_bytes(b"")
    table = tmp_path / "pairs.csv"
    lines = ["filepath,title"] + [f'images/{path.name},"{caption}"' for path, caption, _ in rows]
    lines += ["images/unreadable.jpg,bad", "images/missing.jpg,gone", "images/empty.jpg,empty"]
    table.write_text("\n".join(lines) + "\n")
    out = tmp_path / "shards"
    result = cli("data", "shards", table, out, "--size", "64", "--shard-size", "3", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert f"5 samples in 3 shards in {out}" in result.output
    assert "3 images skipped (unreadable, or without a caption)" in result.output
    assert "missing.jpg: No such file or directory" in result.output and "unreadable.jpg: not an image" in result.output
    data = data_block(result.output)
    assert data == {"urls": str(out.resolve() / "shard-{000000..000002}.tar"), "samples": 5}
    assert json.loads((out / "shards.json").read_text())["samples"] == 5
    assert read_back(data) == {caption: size for _, caption, size in rows}
    members = [name for url in shard_urls(data["urls"]) for name, _ in tar_members(open(url, "rb"))]
    assert members[:2] == ["000000000.jpg", "000000000.txt"]
    assert {name.rsplit(".", 1)[1] for name in members} == {"jpg", "txt"}
    kept = next(sample for sample in samples_of(data["urls"]) if sample["txt"] == b"a small photo")
    assert kept["jpg"] == (images / "small.jpg").read_bytes()  # already small: not encoded again
    assert all(Image.open(io.BytesIO(sample["jpg"])).format == "JPEG" for sample in samples_of(data["urls"]))


def test_a_folder_of_images_with_captions_beside_them(cli, tmp_path):
    """img2dataset's layout (subfolders of name.jpg + name.txt): every image with a caption, sorted by path; an
    image without one is skipped and counted; a TSV's tab is found without --csv-separator; other columns by
    flag; the model's image size × 1.15 (--model, --job) is the default short side."""
    source = tmp_path / "crawl"
    for part, (width, height) in enumerate([(640, 400), (90, 120), (500, 500)]):
        folder = source / f"{part:05d}"
        folder.mkdir(parents=True)
        save(photo(part, width, height), folder / f"{part:09d}.jpg")
        (folder / f"{part:09d}.txt").write_text(f"caption {part}\n")
    save(photo(9, 80, 80), source / "00000" / "uncaptioned.jpg")
    out = tmp_path / "shards"
    job = write_job(tmp_path, synthetic_job(tmp_path))  # the tiny model: 32 px
    result = cli("data", "shards", source, out, "--job", job, "--workers", "1")
    assert result.exit_code == 0, result.output
    assert "1 image skipped" in result.output and "uncaptioned.jpg: no caption" in result.output
    assert read_back(data_block(result.output)) == {"caption 0": (59, 37), "caption 1": (37, 49),
                                                    "caption 2": (37, 37)}
    table = tmp_path / "pairs.tsv"
    table.write_text("url\tcaption\tother\n" + "".join(f"{path}\tline {i}\tx\n" for i, path in
                                                          enumerate(sorted(source.rglob("0*.jpg")))))
    result = cli("data", "shards", table, tmp_path / "from-table", "--model", "ViT-B-32", "--csv-img-key", "url",
                 "--csv-caption-key", "caption", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert read_back(data_block(result.output)) == {"line 0": (413, 258), "line 1": (90, 120), "line 2": (258, 258)}
    assert short_side_for(224) == 258 and short_side_for([256, 320]) == 368


def test_a_parquet_table(cli, tmp_path):
    """A parquet table (with pyarrow installed) is read as a CSV one: its columns by name, in row order."""
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    paths = [str(save(photo(index, 90, 60 + index), tmp_path / f"{index}.jpg")) for index in range(3)]
    table = pyarrow.table({"title": [f"row {index}" for index in range(3)], "filepath": paths, "other": [1, 2, 3]})
    parquet.write_table(table, tmp_path / "pairs.parquet")
    result = cli("data", "shards", tmp_path / "pairs.parquet", tmp_path / "shards", "--size", "30", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert read_back(data_block(result.output)) == {"row 0": (45, 30), "row 1": (44, 30), "row 2": (44, 30)}
    result = cli("data", "shards", tmp_path / "pairs.parquet", tmp_path / "o", "--size", "30", "--csv-img-key", "x")
    assert result.exit_code == 2 and "has no column 'x' (its columns: 'title', 'filepath', 'other')" in result.output


def test_mistakes_are_one_line_each(cli, tmp_path):
    """A table without the columns, a parquet table without pyarrow, a size given twice or not at all, an output
    folder holding something else, and one holding shards of other settings: one line each, exit 2."""
    table = tmp_path / "pairs.csv"
    table.write_text("path,text\nimage.jpg,a caption\n")
    save(photo(0, 40, 40), tmp_path / "image.jpg")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    cases = [(("data", "shards", table, tmp_path / "o", "--size", "64"),
              "has no column 'filepath' or 'title' (its columns, split at ',': 'path', 'text'); name them with "
              "--csv-img-key/--csv-caption-key"),
             (("data", "shards", table, tmp_path / "o"), "give one of --size N"),
             (("data", "shards", table, tmp_path / "o", "--size", "64", "--model", "ViT-B-32"), "give one of"),
             (("data", "shards", tmp_path / "nothing.csv", tmp_path / "o", "--size", "64"), "does not exist"),
             (("data", "shards", table, other, "--size", "64", "--csv-img-key", "path", "--csv-caption-key", "text"),
              "is not empty and holds no shards.json"),
             (("data", "resize", str(tmp_path / "s-{0..2}.tar"), tmp_path / "o", "--size", "64"),
              "s-0.tar does not exist (3 of the 3 shards are missing)"),
             (("data", "resize", other, tmp_path / "o", "--size", "64"), "no shard to resize")]
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        (tmp_path / "pairs.parquet").write_bytes(b"PAR1")
        cases.append((("data", "shards", tmp_path / "pairs.parquet", tmp_path / "o", "--size", "64"),
                      "is a parquet file, which needs pyarrow: pip install pyarrow"))
    for args, message in cases:
        result = cli(*args)
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output
    out = tmp_path / "shards"
    args = ("data", "shards", table, out, "--csv-img-key", "path", "--csv-caption-key", "text", "--workers", "1")
    assert cli(*args, "--size", "32").exit_code == 0
    result = cli(*args, "--size", "48")
    assert result.exit_code == 2 and "holds shards written with other settings (short_side 32 → 48)" in result.output
    assert cli(*args, "--size", "32").exit_code == 0  # the same: nothing left to do
    assert not (tmp_path / "o").exists()  # no mistake above left an output folder
    assert brace_pattern(["a/s-08.tar", "a/s-09.tar", "a/s-10.tar"]) == "a/s-{08..10}.tar"
    assert brace_pattern(["a/s-08.tar", "a/s-10.tar"]) == ["a/s-08.tar", "a/s-10.tar"]
    assert _file_name("pipe:aws s3 cp s3://bucket/laion/00042.tar -") == "00042.tar"
    assert _file_name("https://host/a/b-1.tar.gz") == "b-1.tar.gz" and _file_name("/data/x.tar") == "x.tar"


def worker_pids(pid: int) -> list[int]:
    """The multiprocessing workers a process started (its children running multiprocessing's spawn_main)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, "a worker killed"])
def test_an_interrupted_run_goes_on_to_the_same_shards(cli, tmp_path, stop):
    """`data shards` over 2 processes, its process group sent SIGINT (Ctrl-C) or SIGTERM, or one of its
    workers SIGKILL (as the kernel's out-of-memory killer would), while an image of its third shard is a FIFO
    nobody writes (the run waits there, its first two shards written): it exits 130 (2 and one line for the
    dead worker), leaves those two whole and no other file, and no process; run again once the image is a
    file, it keeps them, writes the rest, and its shards are byte for byte an uninterrupted run's."""
    images = tmp_path / "images"
    images.mkdir()
    for index in range(11):
        save(photo(index, 120 + index, 90), images / f"{index}.jpg")
    waiting = images / "8.jpg"
    waiting.unlink()
    os.mkfifo(waiting)
    table = tmp_path / "pairs.csv"
    table.write_text("filepath,title\n" + "".join(f"images/{index}.jpg,photo {index}\n" for index in range(11)))
    out = tmp_path / "shards"
    args = ["data", "shards", str(table), str(out), "--size", "48", "--shard-size", "4", "--workers", "2"]
    process = subprocess.Popen([sys.executable, "-m", "fsdpclip", *args], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        while not (out / "shard-000001.tar").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (out / "shard-000001.tar").exists(), "the first two shards were never written"
        if stop == "a worker killed":
            os.kill(worker_pids(process.pid)[0], signal.SIGKILL)
        else:
            os.killpg(process.pid, stop)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if stop == "a worker killed":
        assert process.returncode == 2 and "a worker process died (killed, or out of memory?)" in output, output
    else:
        assert process.returncode == 130 and "interrupted: the shards written whole are kept" in output, output
    assert "Traceback" not in output, output
    deadline = time.monotonic() + 15  # multiprocessing's resource tracker ends once the command has ended
    while (running := _still_running(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running, running  # none of its processes is left
    assert sorted(path.name for path in out.iterdir()) == ["shard-000000.tar", "shard-000001.tar", "shards.json"]
    for path in out.glob("*.tar"):  # whole: every member there, to the archive's end
        assert len(list(tar_members(open(path, "rb")))) == 8
    kept = {path.name: path.stat().st_ino for path in out.glob("*.tar")}
    waiting.unlink()
    save(photo(8, 128, 90), waiting)
    result = cli(*args)
    assert result.exit_code == 0 and "11 samples in 3 shards" in result.output, result.output
    assert "2 of them from an earlier run" in result.output
    assert {path.name: path.stat().st_ino for path in out.glob("shard-00000[01].tar")} == kept
    straight = tmp_path / "straight"
    assert cli(*args[:3], str(straight), *args[4:]).exit_code == 0
    for index in range(3):
        name = f"shard-{index:06d}.tar"
        assert (out / name).read_bytes() == (straight / name).read_bytes(), name


def _still_running(group: int) -> list[str]:
    """The processes of process group `group` that have not exited (a zombie, not yet reaped, has)."""
    found = subprocess.run(["ps", "-o", "stat=,pid=,args=", "-g", str(group)], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if not line.startswith("Z")]


def test_resize_shrinks_the_images_and_keeps_every_other_member(cli, tmp_path):
    """`data resize` of a folder of shards over 2 processes: each sample's images shrunk to the short side in
    their own format (jpg, png), a small image and every other member (txt, json, cls) as they were, an
    unreadable image kept and counted; the same samples in the same shards, and the data block to train on
    them. Run again after a shard was lost, it keeps the other and writes that one as it was."""
    source = tmp_path / "big"
    source.mkdir()
    samples = []
    for shard in range(2):
        with wds.TarWriter(str(source / f"part-{shard:03d}.tar")) as sink:
            for index in range(3):
                key = f"{shard}{index:04d}"
                image = io.BytesIO()
                photo(shard * 3 + index, 300 + index, 200).save(image, "JPEG")
                sample = {"__key__": key, "jpg": image.getvalue(), "txt": f"caption {key}".encode(),
                          "json": json.dumps({"key": key}).encode(), "cls": str(index).encode()}
                if index == 1:
                    png = io.BytesIO()
                    photo(9, 128, 512).save(png, "PNG")
                    sample["png"] = png.getvalue()
                if index == 2:
                    small = io.BytesIO()
                    photo(7, 60, 50).save(small, "JPEG")
                    sample["jpg"] = small.getvalue()
                if shard == 1 and index == 0:
                    sample["jpg"] = b"broken"
                sink.write(sample)
                samples.append(sample)
    out = tmp_path / "small"
    result = cli("data", "resize", source, out, "--size", "100", "--workers", "2")
    assert result.exit_code == 0, result.output
    assert "6 samples in 2 shards" in result.output and "1 image unreadable, kept unchanged" in result.output
    assert data_block(result.output) == {"urls": str(out.resolve() / "part-{000..001}.tar"), "samples": 6}
    got = samples_of(data_block(result.output)["urls"])
    assert len(got) == len(samples)
    for want, sample in zip(samples, got):
        assert set(sample) - {"__url__"} == set(want)
        for member in ("__key__", "txt", "json", "cls"):
            assert sample[member] == want[member], member
        if want["jpg"] == b"broken" or want["__key__"].endswith("2"):
            assert sample["jpg"] == want["jpg"]
        else:
            image = Image.open(io.BytesIO(sample["jpg"]))
            assert image.format == "JPEG" and image.size[1] == 100, image.size
        if "png" in want:
            image = Image.open(io.BytesIO(sample["png"]))
            assert image.format == "PNG" and image.size == (100, 400)
    kept, first = (out / "part-000.tar").stat().st_ino, (out / "part-001.tar").read_bytes()
    (out / "part-001.tar").unlink()  # as if the run had stopped before it
    result = cli("data", "resize", source, out, "--size", "100", "--workers", "1")
    assert result.exit_code == 0 and "6 samples in 2 shards in" in result.output, result.output
    assert "1 of them from an earlier run" in result.output and (out / "part-000.tar").stat().st_ino == kept
    assert (out / "part-001.tar").read_bytes() == first
