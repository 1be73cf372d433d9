"""fsdpclip.data.tarshards reads shards into the samples webdataset's own reader gives, for the tar layouts
tools write (webdataset's TarWriter, GNU, ustar, pax, compressed) and for broken shards."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile

import pytest
import webdataset as wds
from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

from fsdpclip.data.tarshards import TarError, shard_samples


def webdataset_samples(url: str) -> tuple[list[dict], list[str]]:
    errors = []
    handler = lambda exc: errors.append(type(exc).__name__) or True  # noqa: E731
    files = tar_file_expander(url_opener([{"url": url}], handler=handler), handler=handler)
    return list(group_by_keys(files, handler=handler)), errors


def our_samples(url: str) -> tuple[list[dict], list[Exception]]:
    errors = []
    return list(shard_samples(url, lambda exc: errors.append(exc) or True)), errors


def write_tar(path, members: list[tuple[str, bytes]], form=tarfile.GNU_FORMAT, compress=None) -> str:
    """A tar of `members` (name ending in '/': a directory; '-> target': a symbolic link)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=form) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name.rstrip("/"))
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
            elif data.startswith(b"-> "):
                info.type, info.linkname = tarfile.SYMTYPE, data[3:].decode()
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    path.write_bytes(compress(raw.getvalue()) if compress else raw.getvalue())
    return str(path)


def layout() -> list[tuple[str, bytes]]:
    """Names a shard holds in practice, and some it should not: long, nested, upper-case extensions,
    several dots, metadata, directories, links."""
    deep = "d" * 60 + "/" + "e" * 60 + "/"
    return [("__meta__", b"ignored"), ("dir/", b""),
            ("000.jpg", b"\xff\xd8 image 0"), ("000.txt", b"caption 0"), ("000.Seg.PNG", b"mask 0"),
            ("001.jpg", b"image 1" * 300), ("001.txt", b"caption 1"), ("link.txt", b"-> 001.txt"),
            (deep + "sample_with_a_long_name_" + "x" * 70 + ".jpg", b"image 2"),
            (deep + "sample_with_a_long_name_" + "x" * 70 + ".txt", "légende 2".encode()),
            ("noextension", b"skipped"), ("sub/003.jpg", b""), ("sub/003.json", b'{"a": 1}')]


@pytest.mark.parametrize("form", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
@pytest.mark.parametrize("compress", [None, gzip.compress, bz2.compress, lzma.compress])
def test_the_samples_webdataset_reads(tmp_path, form, compress):
    members = layout()
    if form == tarfile.USTAR_FORMAT:  # ustar splits names into prefix and name; no name over 255 bytes
        members = [(name.replace("x" * 70, "x" * 20), data) for name, data in members]
    url = write_tar(tmp_path / "shard.tar", members, form, compress)
    ours, errors = our_samples(url)
    theirs, _ = webdataset_samples(url)
    assert ours == theirs and not errors
    keys = [s["__key__"] for s in ours]
    assert keys[:2] == ["000", "001"] and keys[-1] == "sub/003" and "link" not in keys  # links are no files
    assert ours[0]["seg.png"] == b"mask 0" and len(ours) == 4
    assert any(len(s["__key__"]) > 150 for s in ours) or form == tarfile.USTAR_FORMAT


def test_webdataset_tarwriter_shards(tmp_path):
    url = str(tmp_path / "shard.tar")
    with wds.TarWriter(url) as sink:
        for index in range(50):
            sink.write({"__key__": f"{index:05d}", "jpg": bytes([index]) * (100 + 37 * index), "txt": f"caption {index}",
                        "json": {"index": index}})
    ours, errors = our_samples(url)
    assert ours == webdataset_samples(url)[0] and len(ours) == 50 and not errors
    assert ours[7]["jpg"] == bytes([7]) * 359 and ours[7]["txt"] == b"caption 7"


def test_a_repeated_extension_goes_to_the_handler_and_the_first_is_kept(tmp_path):
    url = write_tar(tmp_path / "shard.tar", [("a.txt", b"one"), ("a.txt", b"two"), ("b.txt", b"three")])
    ours, errors = our_samples(url)
    assert ours == webdataset_samples(url)[0] == [{"__key__": "a", "__url__": url, "txt": b"one"},
                                                   {"__key__": "b", "__url__": url, "txt": b"three"}]
    assert len(errors) == 1 and "duplicate" in str(errors[0])


def test_a_truncated_shard_keeps_what_came_before(tmp_path):
    url = write_tar(tmp_path / "shard.tar", [(f"{i:03d}.{ext}", bytes(700)) for i in range(10) for ext in ("jpg", "txt")])
    data = (tmp_path / "shard.tar").read_bytes()
    (tmp_path / "shard.tar").write_bytes(data[:len(data) // 2 + 100])
    ours, errors = our_samples(url)
    assert ours == webdataset_samples(url)[0]
    assert 0 < len(ours) < 10 and all({"jpg", "txt"} <= set(s) for s in ours[:-1]) and "txt" not in ours[-1]
    assert len(errors) == 1 and isinstance(errors[0], TarError) and "cut short" in str(errors[0])


@pytest.mark.parametrize("content", [b"no tar here " * 100, b"", b"\0" * 1024 + b"trailing"])
def test_no_archive(tmp_path, content):
    path = tmp_path / "shard.tar"
    path.write_bytes(content)
    ours, errors = our_samples(str(path))
    assert ours == webdataset_samples(str(path))[0] == []
    assert len(errors) == (0 if content.startswith(b"\0") else 1)  # an empty file is an error, as in tarfile
    if errors:
        assert isinstance(errors[0], TarError) and str(path) in errors[0].args


def test_a_missing_shard_and_a_failing_pipe_go_to_the_handler_once(tmp_path):
    """A shard that cannot be opened, and a `pipe:` command that fails after the shard was read to its
    end: one error each. A command that fails after the reader stopped early (a worker's shard dropped at
    an epoch's end) is no error of the shard's. A pipe read whole gives the file's samples."""
    missing = str(tmp_path / "missing.tar")
    assert our_samples(missing)[0] == [] and len(our_samples(missing)[1]) == 1
    url = write_tar(tmp_path / "shard.tar", [(f"{i}.txt", b"x" * 700) for i in range(3)])
    piped, errors = our_samples(f"pipe:cat {url}")
    assert [{**s, "__url__": url} for s in piped] == our_samples(url)[0] and not errors
    failing = f"pipe:cat {url}; sleep 0.5; exit 3"
    ours, errors = our_samples(failing)
    assert [s["__key__"] for s in ours] == ["0", "1", "2"] and len(errors) == 1 and "3" in str(errors[0])
    assert our_samples("pipe:exit 3")[0] == [] and len(our_samples("pipe:exit 3")[1]) == 1
    assert our_samples("pipe:printf junk; exit 3")[0] == [] and len(our_samples("pipe:printf junk; exit 3")[1]) == 1
    doubled = write_tar(tmp_path / "doubled.tar", [("a.txt", b"one"), ("a.txt", b"two")])
    ours, errors = our_samples(f"pipe:cat {doubled}; sleep 0.5; exit 3")
    assert len(ours) == 1 and ["duplicate" in str(e) for e in errors] == [True, False]  # the exit status too
    errors = []
    samples = shard_samples(failing, lambda exc: errors.append(exc) or True)
    assert next(samples)["__key__"] == "0"
    samples.close()
    assert errors == []


def test_where_tarfile_ends_quietly(tmp_path):
    """A shard cut inside its end-of-archive blocks, other bytes after them or after a compressed tar, a
    compressed tar cut after a member: the samples before, no error, as webdataset reads them. A first
    file whose name begins like a bzip2 stream is still a tar."""
    members = [(f"{i:03d}.{ext}", bytes([i]) * 300) for i in range(4) for ext in ("jpg", "txt")]
    raw = (tmp_path / "raw.tar")
    write_tar(raw, members)
    data = raw.read_bytes()
    end = data.rstrip(b"\0")
    unended = data[:len(end) + -len(end) % 512]  # the members, no end-of-archive blocks
    cases = {"cut in the end blocks": end + bytes(700), "bytes after the end": data + b"trailing bytes" * 50,
             "no end blocks, bytes after": unended + b"trailing bytes" * 50,
             "gzip, bytes after": gzip.compress(data) + b"junk" * 10,
             "gzip, no end blocks, bytes after": gzip.compress(unended) + b"junk" * 200,
             "gzip, cut after a member": gzip.compress(data)[:len(gzip.compress(data)) - 40]}
    for name, content in cases.items():
        path = tmp_path / f"{name}.tar"
        path.write_bytes(content)
        ours, errors = our_samples(str(path))
        assert ours == webdataset_samples(str(path))[0] and not errors, (name, errors)
        assert len(ours) == 4 or name.startswith("gzip, cut"), name
    pax = raw.with_name("pax.tar")
    write_tar(pax, [("a.txt", b"one"), ("ä" * 120 + ".txt", b"two")], tarfile.PAX_FORMAT)
    content = pax.read_bytes()
    pax.write_bytes(content[:1536 + 512] + b"junk" * 256)  # a.txt, then a pax header, then no header
    ours, errors = our_samples(str(pax))
    theirs, their_errors = webdataset_samples(str(pax))
    assert ours == theirs and len(ours) == 1 and len(errors) == len(their_errors) == 1, (errors, their_errors)
    url = write_tar(tmp_path / "bzh.tar", [("BZh001.jpg", b"a"), ("BZh001.txt", b"b")])
    ours, errors = our_samples(url)
    assert ours == webdataset_samples(url)[0] and len(ours) == 1 and not errors
    url = write_tar(tmp_path / "bzh9.tar", [("BZh91AY&SY.jpg", b"a")])  # tarfile takes this for bzip2
    assert [s["__key__"] for s in our_samples(url)[0]] == ["BZh91AY&SY"]


def test_a_handler_that_says_stop_raises(tmp_path):
    path = tmp_path / "shard.tar"
    path.write_bytes(b"no tar here " * 100)
    with pytest.raises(TarError):
        list(shard_samples(str(path), lambda exc: False))


class CountingStream(io.RawIOBase):
    """A file's bytes, counting those read; seekable or not."""

    def __init__(self, data: bytes, seekable: bool):
        self.data, self.at, self.read_bytes, self.can_seek = data, 0, 0, seekable

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.can_seek

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        assert self.can_seek and whence == io.SEEK_CUR
        self.at += offset
        return self.at

    def readinto(self, buffer) -> int:
        chunk = self.data[self.at:self.at + len(buffer)]
        buffer[:len(chunk)] = chunk
        self.at += len(chunk)
        self.read_bytes += len(chunk)
        return len(chunk)


@pytest.mark.parametrize("seekable", [True, False])
def test_unwanted_samples_come_with_their_keys_only(tmp_path, seekable, monkeypatch):
    """A resumed reader's samples before its place: their keys from the headers, their bytes skipped (a
    seek where the stream can; read and dropped from a pipe); the wanted ones are whole."""
    import importlib

    url = write_tar(tmp_path / "shard.tar", [(f"{i:03d}.{ext}", bytes([i]) * 5000) for i in range(20)
                                             for ext in ("jpg", "txt")])
    streams = []

    def opened(path, *args, **kwargs):
        streams.append(CountingStream((tmp_path / "shard.tar").read_bytes(), seekable))
        return streams[-1]

    monkeypatch.setattr(importlib.import_module("webdataset.gopen"), "gopen", opened)
    wanted, errors = {3, 17, 18}, []
    samples = list(shard_samples(url, lambda exc: errors.append(exc) or True, wanted.__contains__))
    assert [s["__key__"] for s in samples] == [f"{i:03d}" for i in range(20)] and not errors
    assert [i for i, s in enumerate(samples) if len(s) > 2] == sorted(wanted)
    assert samples[17] == {"__key__": "017", "__url__": url, "jpg": bytes([17]) * 5000, "txt": bytes([17]) * 5000}
    whole = 40 * (512 + 5120)
    assert streams[0].read_bytes < whole / 2 if seekable else streams[0].read_bytes >= whole  # read, dropped


def test_a_read_error_of_the_stream_is_reported(tmp_path, monkeypatch):
    """An error of the stream itself (EIO on a network file system) at a header is no end of the archive."""
    import importlib

    url = write_tar(tmp_path / "shard.tar", [(f"{i}.txt", b"x" * 700) for i in range(4)])

    class Failing(CountingStream):
        def readinto(self, buffer) -> int:
            if self.at >= 3 * 1536:
                raise OSError(5, "Input/output error")
            return super().readinto(buffer)

    monkeypatch.setattr(importlib.import_module("webdataset.gopen"), "gopen",
                        lambda *a, **k: Failing((tmp_path / "shard.tar").read_bytes(), True))
    ours, errors = our_samples(url)
    assert [s["__key__"] for s in ours] == ["0", "1", "2"] and len(errors) == 1 and isinstance(errors[0], OSError)
