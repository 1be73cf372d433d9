"""Webdataset shards written from your own images (`fsdpclip data shards`): a caption table (CSV, TSV or parquet,
its columns named as open_clip_train's CSV reader names them) or a folder of images with captions beside them,
each image shrunk to a short side and stored as a JPEG (`jpg`, the caption `txt`: what the webdataset source
reads by default); and existing shards shrunk the same way (`fsdpclip data resize`).

Both run over processes, write each shard under a hidden temporary name and rename it once whole: an interrupted
run (Ctrl-C, SIGTERM) keeps the shards it finished and nothing torn, and the same command again goes on from
them. `shards.json` in the output holds what `data.urls` and `data.samples` need and the settings the shards were
written with (a rerun with others is refused).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import multiprocessing
import os
import re
import signal
import warnings
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

INFO = "shards.json"
MARGIN = 1.15  # the short side kept: the model's image size × this (room for the random crop's scale and shifts)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}  # a shard member's extension: its format
SHOWN = 5  # skipped images named at the end


class WriteError(ValueError):
    """A source or an output that cannot be used: one line for the user."""


def short_side_for(image_size: int | tuple[int, int] | list[int]) -> int:
    """The short side a model of `image_size` (an int, or height and width) trains best from: its larger side
    × MARGIN, rounded (224 → 258)."""
    return round(max(image_size if isinstance(image_size, (list, tuple)) else [image_size]) * MARGIN)


# ----------------------------------------------------------------------- sources
@dataclass(slots=True)  # a table may hold millions
class Pair:
    """An image file and its caption (None or empty: it has none, and is skipped)."""

    image: str
    caption: Optional[str]


def table_pairs(path: Path, image_key: str = "filepath", caption_key: str = "title",
                separator: Optional[str] = None, root: Optional[Path] = None) -> list[Pair]:
    """The (image, caption) rows of a CSV or TSV table (`separator`; None: a tab if the header line has one,
    else a comma) or of a parquet file, in their order; relative image paths start at `root` (default: the
    table's folder)."""
    root = path.parent if root is None else root
    if path.suffix.lower() in (".parquet", ".pq"):
        images, captions = _parquet_columns(path, image_key, caption_key)
    else:
        try:
            with open(path, newline="", encoding="utf-8-sig") as file:
                first = file.readline()
                file.seek(0)
                if separator is None:
                    separator = "\t" if "\t" in first else ","
                reader = csv.DictReader(file, delimiter=separator)
                columns = reader.fieldnames or []
                missing = [key for key in (image_key, caption_key) if key not in columns]
                if missing:
                    raise WriteError(f"{path} has no column {' or '.join(map(repr, missing))} (its columns, split at "
                                     f"{separator!r}: {', '.join(map(repr, columns))}); name them with "
                                     f"--csv-img-key/--csv-caption-key, the separator with --csv-separator")
                rows = [(row[image_key], row[caption_key]) for row in reader]
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise WriteError(f"cannot read the table {path}: {exc}") from None
        images, captions = [r[0] for r in rows], [r[1] for r in rows]
    odd = next((value for value in images if value is not None and not isinstance(value, str)), None)
    if odd is not None:
        raise WriteError(f"{path}'s column {image_key!r} holds {type(odd).__name__} values, not image paths")
    return [Pair(str(root / image) if image else "", caption if isinstance(caption, str) else None)
            for image, caption in zip(images, captions)]


def _parquet_columns(path: Path, image_key: str, caption_key: str) -> tuple[list, list]:
    try:
        import pyarrow.parquet as parquet  # pyright: ignore[reportMissingImports]  (optional: parquet input)
    except ImportError:
        raise WriteError(f"{path} is a parquet file, which needs pyarrow: pip install pyarrow (or give a CSV or "
                         "TSV table)") from None
    try:
        columns = parquet.read_schema(path).names
        missing = [key for key in (image_key, caption_key) if key not in columns]
        if missing:
            raise WriteError(f"{path} has no column {' or '.join(map(repr, missing))} (its columns: "
                             f"{', '.join(map(repr, columns))}); name them with --csv-img-key/--csv-caption-key")
        table = parquet.read_table(path, columns=[image_key, caption_key])
    except (OSError, ValueError) as exc:
        if isinstance(exc, WriteError):
            raise
        raise WriteError(f"cannot read the table {path}: {exc}") from None
    return table.column(image_key).to_pylist(), table.column(caption_key).to_pylist()


def folder_pairs(folder: Path) -> list[Pair]:
    """Every image under `folder` (by suffix, in its subfolders too, sorted by path) with the caption in the
    text file beside it (`name.jpg` and `name.txt`, as img2dataset writes them; None where there is none)."""
    images = sorted(path for path in folder.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file())
    pairs = []
    for image in images:
        text = image.with_suffix(".txt")
        try:
            caption = text.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            caption = None
        pairs.append(Pair(str(image), caption))
    return pairs


# ------------------------------------------------------------------------ images
def shrunk(data: bytes, short_side: int, quality: int, image_format: str = "JPEG") -> bytes:
    """`data`, an encoded image, with its short side at most `short_side`, in `image_format`. An image already
    that small in that format (a JPEG: RGB or grayscale) is kept as it is, once PIL decoded it whole; others are
    decoded (a JPEG through its DCT-domain downscale to at least twice the size), converted to RGB as the
    trainer converts them (grayscale kept), resized with Lanczos and encoded (JPEG and WebP at `quality`).
    EXIF orientation is not applied, as the trainer does not. Raises for what PIL cannot read, images over
    twice PIL's decompression-bomb limit among them; those between it and twice it, which training refuses
    (`jpeg.refuse_huge`), are shrunk."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        scale = short_side / min(width, height)
        size = (max(1, round(width * scale)), max(1, round(height * scale))) if scale < 1 else image.size
        if scale < 1:
            image.draft(image.mode, (2 * size[0], 2 * size[1]))
        image.load()
    kept = image.format == image_format and (image_format != "JPEG" or image.mode in ("RGB", "L"))
    if scale >= 1 and kept:
        return data
    if image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    if image.size != size:
        image = image.resize(size, Image.Resampling.LANCZOS)
    out = io.BytesIO()
    image.save(out, image_format, **({} if image_format == "PNG" else {"quality": quality}))
    return out.getvalue()


def _sample(job: tuple[str, Optional[str], int, int]) -> tuple[Optional[bytes], str]:
    """A data worker's row: the shrunk JPEG, or None and why not."""
    image, caption, short_side, quality = job
    if not caption:
        return None, f"{image}: no caption"
    try:
        with open(image, "rb") as file:
            return shrunk(file.read(), short_side, quality), ""
    except Exception as exc:  # any image PIL cannot read is skipped, and counted
        return None, f"{image}: {unreadable(exc)}"


def unreadable(exc: Exception) -> str:
    """Why an image could not be read, in a few words."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "not an image PIL can read"
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__


# ------------------------------------------------------------------------ shards
@dataclass
class Written:
    """What a run left in its output: the `data.urls` pattern (or list), the samples and shards, the images
    skipped (`write_shards`: in every run's shards) or kept unread (`resize_shards`: in this run's shards),
    and some of them with the reason."""

    urls: str | list[str]
    samples: int
    shards: int
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)
    resumed: int = 0  # shards an earlier run had written

    def spec(self) -> dict:
        """The `data` block that trains on them."""
        return {"urls": self.urls, "samples": self.samples}


def write_shards(pairs: list[Pair], out: Path, short_side: int, quality: int = 90, shard_size: int = 10_000,
                 workers: int = 1, source: str = "", advance: Callable[[int], None] = lambda n: None) -> Written:
    """Shards `shard-NNNNNN.tar` of `shard_size` rows each in `out` (row i in shard i // shard_size, key its
    row number, the image shrunk (`shrunk`) as `jpg`, its caption `txt`), written by `workers` processes (1:
    this one). Shards already there (a run before, with the same settings) are kept; rows whose image cannot
    be read or that have no caption are skipped and counted. `advance(rows)` as rows are done."""
    if not pairs:
        raise WriteError(f"{source or 'the source'} holds no image")
    count = math.ceil(len(pairs) / shard_size)
    name = "shard-{:06d}.tar"
    settings = {"source": source, "rows": len(pairs), "shard_size": shard_size, "short_side": short_side,
                "quality": quality}
    _claim(out, settings)
    rows = [range(i * shard_size, min((i + 1) * shard_size, len(pairs))) for i in range(count)]
    samples, reasons, pending = 0, [], []
    for index in range(count):
        if (out / name.format(index)).exists():
            samples += _samples_in(out / name.format(index))
            advance(len(rows[index]))
        else:
            pending.append(index)
    resumed = count - len(pending)
    jobs = ((pairs[row].image, pairs[row].caption, short_side, quality) for i in pending for row in rows[i])
    with _processes(workers) as imap:
        results = imap(_sample, jobs, chunksize=8)
        for index in pending:
            with _whole(out / name.format(index)) as sink:
                for row in rows[index]:
                    jpeg, reason = next(results)
                    if jpeg is None:
                        reasons += [reason][:SHOWN - len(reasons)]
                    else:
                        sink.write({"__key__": f"{row:09d}", "jpg": jpeg, "txt": pairs[row].caption})
                        samples += 1
                    advance(1)
    urls = str(out.resolve() / f"shard-{{000000..{count - 1:06d}}}.tar")
    written = Written(urls, samples, count, len(pairs) - samples, reasons, resumed)
    _finish(out, settings, written)
    return written


def resize_shards(urls: list[str], out: Path, short_side: int, quality: int, image_keys: tuple[str, ...],
                  workers: int = 1, advance: Callable[[int], None] = lambda n: None) -> Written:
    """Each shard of `urls` written to `out` under its own file name with its images (members `image_keys`)
    shrunk (`shrunk`, each in its member's format) by `workers` processes, every other member as it was; an
    image PIL cannot read is kept as it was and counted. Shards already in `out` are kept. `advance(1)` per
    shard done."""
    if not urls:
        raise WriteError("no shard to resize")
    names = [_file_name(url) for url in urls]
    twice = next((name for name, count in Counter(names).items() if count > 1), None)
    if twice:
        raise WriteError(f"several input shards are named {twice}: they would be written to one file")
    settings = {"source": urls[0] if len(urls) == 1 else f"{urls[0]} ... {urls[-1]} ({len(urls)} shards)",
                "short_side": short_side, "quality": quality, "image_keys": list(image_keys)}
    _claim(out, settings)
    samples, skipped, reasons, pending = 0, 0, [], []
    for url, name in zip(urls, names):
        if (out / name).exists():
            samples += _samples_in(out / name)
            advance(1)
        else:
            pending.append((url, name))
    jobs = ((sample, short_side, quality, image_keys) for url, _ in pending
            for sample in itertools.chain(_samples_of(url), [None]))  # None: the shard's end
    with _processes(workers) as imap:
        results = imap(_shrunk_sample, jobs, chunksize=8)
        for _, name in pending:
            with _whole(out / name) as sink:
                for sample, unread in iter(lambda: next(results), (None, [])):
                    sink.write(sample)
                    samples, skipped, reasons = samples + 1, skipped + len(unread), reasons + unread
            advance(1)
    written = Written(brace_pattern([str(out.resolve() / name) for name in names]), samples, len(urls), skipped,
                      reasons[:SHOWN], len(urls) - len(pending))
    _finish(out, settings, written)
    return written


def _file_name(url: str) -> str:
    """The file name a shard URL ends in (`pipe:` commands' too: `pipe:aws s3 cp s3://b/x-0.tar -` → x-0.tar)."""
    names = re.findall(r"[^/\s:]+\.tar(?:\.gz|\.bz2|\.xz)?(?=\s|$)", url)
    if not names:
        raise WriteError(f"cannot tell the file name of the shard {url} (it names no .tar file)")
    return names[-1]


def _samples_of(url: str) -> Iterator[dict]:
    """A shard's samples, without their `__url__`; a shard that cannot be read whole is a WriteError."""
    from fsdpclip.data.tarshards import shard_samples

    def broken(exc: Exception) -> bool:
        raise WriteError(f"cannot read the shard {url}: {exc}")

    for sample in shard_samples(url, broken):
        del sample["__url__"]
        yield sample


def _shrunk_sample(job: tuple[Optional[dict], int, int, tuple[str, ...]]) -> tuple[Optional[dict], list[str]]:
    """A data worker's sample: its images shrunk, and why each image it kept as it was could not be read."""
    sample, short_side, quality, image_keys = job
    unread: list[str] = []
    if sample is None:
        return sample, unread
    for key in [k for k in sample if k.rsplit(".", 1)[-1] in image_keys]:
        try:
            sample[key] = shrunk(sample[key], short_side, quality, FORMATS.get(key.rsplit(".", 1)[-1], "JPEG"))
        except Exception as exc:  # kept as it was: the trainer counts it as broken
            unread.append(f"{sample['__key__']}.{key}: {unreadable(exc)}")
    return sample, unread


def brace_pattern(paths: list[str]) -> str | list[str]:
    """Paths numbered consecutively at the end of their names, one width (`a/s-000.tar` ... `a/s-041.tar`), as
    one brace pattern (`a/s-{000..041}.tar`); other lists as they are."""
    parts = [part for path in paths if (part := re.fullmatch(r"(.*?)(\d+)(\.[^/]*)", path))]
    if len(parts) != len(paths) or len({(p[1], p[3], len(p[2])) for p in parts}) != 1 or \
            [int(p[2]) for p in parts] != list(range(int(parts[0][2]), int(parts[0][2]) + len(parts))):
        return paths
    first, last = parts[0], parts[-1]
    return paths[0] if len(paths) == 1 else f"{first[1]}{{{first[2]}..{last[2]}}}{first[3]}"


# ----------------------------------------------------------------------- helpers
def _claim(out: Path, settings: dict) -> None:
    """`out` made ready for shards written with `settings`: a new or empty folder, or one a run with the same
    settings wrote (its INFO file says so)."""
    info = out / INFO
    try:
        out.mkdir(parents=True, exist_ok=True)
        if info.exists():
            before = json.loads(info.read_text())
            before = before.get("settings") if isinstance(before, dict) else None
            before = before if isinstance(before, dict) else {}
            if before != settings:
                changed = [f"{k} {before.get(k)!r} → {v!r}" for k, v in settings.items() if before.get(k) != v]
                raise WriteError(f"{out} holds shards written with other settings ({'; '.join(changed)}): give "
                                 "another output folder, or the same settings to go on")
        elif any(not entry.name.startswith(".") for entry in out.iterdir()):
            raise WriteError(f"{out} is not empty and holds no {INFO}: give a new or empty folder")
        info.write_text(json.dumps({"settings": settings}, indent=2) + "\n")
    except (OSError, json.JSONDecodeError) as exc:
        raise WriteError(f"cannot use {out}: {exc}") from None


def _finish(out: Path, settings: dict, written: Written) -> None:
    (out / INFO).write_text(json.dumps({**written.spec(), "shards": written.shards, "skipped": written.skipped,
                                        "settings": settings}, indent=2) + "\n")


def _samples_in(path: Path) -> int:
    """The samples of a shard written before (from its tar headers alone)."""
    from fsdpclip.data.tarshards import shard_samples

    def broken(exc: Exception) -> bool:
        raise WriteError(f"{path} cannot be read ({exc}): delete it and run again")

    return sum(1 for _ in shard_samples(str(path), broken, wanted=lambda index: False))


@contextmanager
def _whole(path: Path) -> Iterator:
    """A webdataset TarWriter on a hidden temporary file beside `path`, renamed to `path` once written whole
    (deleted if not). Its members' times are 0, so the same samples make the same bytes."""
    from webdataset.writer import TarWriter  # (webdataset's own stubs leave it out of the package)

    partial = path.with_name(f".{path.name}.partial")
    try:
        with open(partial, "wb") as file, TarWriter(file, mtime=0) as sink:
            yield sink
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


@contextmanager
def _processes(workers: int) -> Iterator[Callable]:
    """`map(function, jobs, chunksize)` over `workers` processes (1: the builtin map, here), results in the jobs'
    order, a few chunks per process ahead. Inside, SIGTERM raises KeyboardInterrupt as Ctrl-C does; the workers
    ignore Ctrl-C, and on any exception this process kills them (one may wait on an image for ever: a FIFO, a
    hung network file system), then ends the pool (multiprocessing.Pool's terminate would wait for ever on a
    queue lock that a worker killed by the same SIGTERM held). A worker that dies is a WriteError."""
    from concurrent.futures.process import BrokenProcessPool

    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        if workers <= 1:
            yield lambda function, jobs, chunksize: map(function, jobs)
            return
        before = set(multiprocessing.active_children())
        executor = _started_pool(workers)
        try:
            yield lambda function, jobs, chunksize: _in_order(executor, function, iter(jobs), chunksize, 4 * workers)
        except BaseException as exc:
            children = set(multiprocessing.active_children()) - before
            for child in children:
                child.kill()
            for child in children:  # gone before this process is: none is left running under its group
                child.join(10)
            if isinstance(exc, BrokenProcessPool):
                raise WriteError("a worker process died (killed, or out of memory?): the shards written whole are "
                                 "kept, and the same command goes on from them") from None
            raise
        finally:
            executor.shutdown(wait=True, cancel_futures=True)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _in_order(executor, function: Callable, jobs: Iterator, chunksize: int, ahead: int) -> Iterator:
    """`function` of each job, in order, computed by `executor` `chunksize` jobs at a time, `ahead` chunks ahead
    (jobs are read only as far)."""
    pending: deque = deque()
    for chunk in iter(lambda: list(itertools.islice(jobs, chunksize)), []):
        pending.append(executor.submit(_each, function, chunk))
        if len(pending) >= ahead:
            yield from pending.popleft().result()
    while pending:
        yield from pending.popleft().result()


def _each(function: Callable, chunk: list) -> list:
    return [function(job) for job in chunk]


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def _started_pool(workers: int) -> ProcessPoolExecutor:
    """A spawn pool of `workers` processes, all started now with Ctrl-C ignored: a process spawned with SIGINT
    ignored keeps ignoring it (Python installs its own handler otherwise, and a Ctrl-C while it imports would
    print its traceback). Each waits in its initializer until all have started, so none is idle and every submit
    starts one. This process ignores Ctrl-C only while they start."""
    context = multiprocessing.get_context("spawn")
    everyone = context.Barrier(workers)
    kept = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        executor = ProcessPoolExecutor(workers, context, initializer=_wait_for_the_others, initargs=(everyone,))
        for started in [executor.submit(os.getpid) for _ in range(workers)]:
            started.result()
    finally:
        signal.signal(signal.SIGINT, kept)
    return executor


def _wait_for_the_others(everyone) -> None:
    everyone.wait(timeout=300)  # one that died while starting breaks the pool, never hangs it
