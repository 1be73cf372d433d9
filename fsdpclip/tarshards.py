"""Webdataset shards read as samples: a tar stream's files grouped by key, as webdataset groups them
(`tar_file_expander` + `group_by_keys`), without `tarfile`.

`tarfile` spends ~0.1 ms of Python per member (two header objects and a parsed pax header each, for
shards written by webdataset's TarWriter): that was a third of a data worker's time per sample. Here a
member costs a header checksum, two number fields and a name. Understood: ustar (with its name prefix),
GNU long names, pax path and size records, and gzip, bzip2 or xz compression of the whole tar.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
from typing import Callable, Iterator, Optional

BLOCK = 512
_EMPTY = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")  # tarfile's regular files (contiguous files read as regular ones)
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta: files it never puts in a sample
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext: key, extensions
_COMPRESSED = ((b"\x1f\x8b", lambda raw: gzip.GzipFile(fileobj=raw)), (b"BZh", bz2.BZ2File),
               (b"\xfd7zXZ\x00", lzma.LZMAFile))  # magic bytes, reader


class TarError(ValueError):
    """The stream is not a tar archive, or is cut short."""


def shard_samples(url: str, handler: Callable[[Exception], bool],
                  wanted: Optional[Callable[[int], bool]] = None) -> Iterator[dict]:
    """The samples of one shard in order: dicts of `__key__`, `__url__` and each file's lower-cased
    extensions → its bytes. A shard that cannot be opened or read further, and a file whose extension
    the sample already has, go to `handler` (webdataset's contract: False stops the reading with the
    error); what was read before an error is kept. `wanted(i)` False: sample i comes with its key
    only, its files' bytes skipped (by seeking, where the stream can: a resumed worker finds its place
    in a shard from the tar headers alone)."""
    from webdataset.gopen import gopen

    try:
        stream = gopen(url)
    except Exception as exc:
        _handled(handler, exc, url)
        return
    sample: Optional[dict] = None
    index, last_key = -1, None

    def read(name: str) -> bool:  # called for each file in order, before its bytes
        nonlocal index, last_key
        parts = _sample_file(name)
        if parts is None:
            return False
        if parts[0] != last_key:
            index, last_key = index + 1, parts[0]
        return wanted is None or wanted(index)

    try:
        for name, data in tar_members(stream, read):
            parts = _sample_file(name)
            if parts is None:
                continue
            key, extension = parts
            if sample is None or key != sample["__key__"]:
                if sample is not None:
                    yield sample
                sample = {"__key__": key, "__url__": url}
            if data is None:
                continue
            if extension in sample:
                _handled(handler, ValueError(f"{name}: duplicate file name in tar file"), url)
                continue
            sample[extension] = data
    except Exception as exc:
        _handled(handler, exc, url)
    finally:
        try:
            stream.close()  # a pipe: reports its command's exit status here
        except Exception as exc:
            _handled(handler, exc, url)
    if sample is not None:
        yield sample


def _sample_file(name: str) -> Optional[tuple[str, str]]:
    """A file's sample key and lower-cased extensions, as webdataset splits them; None: in no sample."""
    if "/" not in name and name.startswith("__") and name.endswith("__") or _META.match(name):
        return None
    parts = _KEY.match(name)
    return None if parts is None else (parts.group(1), parts.group(2).lower())


def _handled(handler: Callable[[Exception], bool], exc: Exception, url: str) -> None:
    exc.args = exc.args + (url,)
    if not handler(exc):
        raise exc


def tar_members(stream, read: Optional[Callable[[str], bool]] = None) -> Iterator[tuple[str, Optional[bytes]]]:
    """(name, bytes) of each regular file of a tar stream, in order; bytes None where `read(name)` says
    not to read them (skipped by seeking where the stream can). A header whose checksum is wrong (not a
    tar archive, or damaged) or a member cut short raises TarError; a stream ending without the
    end-of-archive blocks ends quietly, as with tarfile."""
    header = _read(stream, BLOCK)
    for magic, opener in _COMPRESSED:
        if header.startswith(magic):
            stream = opener(io.BufferedReader(_Rejoined(header, stream)))
            header = _read(stream, BLOCK)
            break
    long_name: Optional[str] = None
    long_size: Optional[int] = None
    while header and header != _EMPTY:
        if len(header) < BLOCK:
            raise TarError(f"a tar header cut short ({len(header)} of {BLOCK} bytes)")
        _check(header)
        kind = header[156:157]
        extended = kind in (b"x", b"L", b"g", b"K")  # headers about the next member
        size = _number(header[124:136]) if long_size is None or extended else long_size
        if extended:
            body = _body(stream, size)
            if kind == b"x":
                long_name, long_size = _pax(body, long_name, long_size)
            elif kind == b"L":
                long_name = body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        else:
            name = long_name or _name(header)
            regular = kind in _REGULAR and not (kind == b"\0" and name.endswith("/"))  # old tars' directories
            if regular and (read is None or read(name)):
                yield name, _body(stream, size)
            else:
                _skip(stream, size + -size % BLOCK)
                if regular:
                    yield name, None
            long_name = long_size = None
        header = _read(stream, BLOCK)


def _body(stream, size: int) -> bytes:
    """A member's `size` bytes (and the padding to its last block)."""
    body = _read(stream, size + -size % BLOCK)
    if len(body) < size:
        raise TarError(f"a tar member cut short ({len(body)} of {size} bytes)")
    return body[:size]


def _skip(stream, count: int) -> None:
    """Past `count` bytes of the stream: a seek where it can (past its end: the next header read finds
    nothing, and the archive ends there), else read and dropped."""
    if not count:
        return
    try:
        seekable = stream.seekable()
    except (AttributeError, OSError, ValueError):
        seekable = False
    if seekable:
        stream.seek(count, io.SEEK_CUR)
        return
    while count:
        chunk = stream.read(min(count, 1 << 20))
        if not chunk:
            return
        count -= len(chunk)


def _read(stream, size: int) -> bytes:
    """`size` bytes, fewer only at the stream's end (a pipe may hand over less per read)."""
    data = stream.read(size)
    while len(data) < size:
        more = stream.read(size - len(data))
        if not more:
            break
        data += more
    return data


def _check(header: bytes) -> None:
    stored = _number(header[148:156])
    unsigned = sum(header) - sum(header[148:156]) + 8 * 32  # the checksum field counts as spaces
    if stored == unsigned:
        return
    signed = unsigned - 256 * sum(b > 127 for b in header[:148] + header[156:])  # as some old tars sum
    if stored != signed:
        raise TarError("not a tar archive here (a header's checksum does not match)")


def _number(field: bytes) -> int:
    """A header's number: octal digits, or GNU's base-256 (first byte 0x80 or 0xff)."""
    if field[0] in (0x80, 0xff):
        value = int.from_bytes(field[1:], "big")
        return value - (1 << (8 * len(field) - 8)) if field[0] == 0xff else value
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits or b"0", 8)
    except ValueError:
        raise TarError(f"not a tar archive here (a header's number reads {field!r})") from None


def _name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0]
    if header[257:265] == b"ustar\x0000":  # POSIX ustar: a prefix (GNU tars keep other fields there)
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def _pax(records: bytes, name: Optional[str], size: Optional[int]) -> tuple[Optional[str], Optional[int]]:
    """The next member's name and size from a pax extended header ("LENGTH key=value\\n" records)."""
    at = 0
    while at < len(records):
        space = records.find(b" ", at)
        if space < 0:
            break
        try:
            length = int(records[at:space])
        except ValueError:
            raise TarError("a damaged pax header") from None
        if length <= 0:
            raise TarError("a damaged pax header")
        key, _, value = records[space + 1:at + length - 1].partition(b"=")
        if key == b"path":
            name = value.decode("utf-8", "surrogateescape")
        elif key == b"size":
            size = int(value)
        at += length
    return name, size


class _Rejoined(io.RawIOBase):
    """A stream whose first bytes were read already: those, then the rest."""

    def __init__(self, head: bytes, rest):
        self.head, self.rest = memoryview(head), rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.head:
            count = min(len(buffer), len(self.head))
            buffer[:count], self.head = self.head[:count], self.head[count:]
            return count
        data = self.rest.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)
