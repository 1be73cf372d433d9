"""Webdataset shards read as samples: a tar stream's files grouped by key as webdataset's
`group_by_keys` groups them, without `tarfile`.

`tarfile` spends ~0.1 ms of Python per member (two header objects and a parsed pax header each, for
shards written by webdataset's TarWriter): that was a third of a data worker's time per sample. Here a
member costs a header checksum, two number fields and a name. Understood: ustar (with its name prefix),
GNU long names, pax path and size records, and gzip, bzip2 or xz compression of the whole tar (a
gzip file of several members is read to its end, where tarfile's stream stops after the first). As
with `tarfile`, an archive ends quietly at a header that cannot be read after the first one (a cut or
a tail of other bytes); GNU sparse files are skipped.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import zlib
from typing import Callable, Generator, Iterator, Optional

from webdataset.tariterators import base_plus_ext

BLOCK = 512
_EMPTY = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")  # tarfile's regular files (contiguous files read as regular ones)
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta: files it never puts in a sample
_COMPRESSED = ((re.compile(b"\x1f\x8b"), lambda raw: gzip.GzipFile(fileobj=raw)),
               (re.compile(b"BZh[1-9]1AY&SY"), bz2.BZ2File),
               (re.compile(b"\xfd7zXZ\x00"), lzma.LZMAFile))  # magic bytes, reader (tried where no tar header is)


class TarError(ValueError):
    """The stream is not a tar archive, or is cut short."""


def shard_samples(url: str, handler: Callable[[Exception], bool],
                  wanted: Optional[Callable[[int], bool]] = None) -> Generator[dict, None, None]:
    """The samples of one shard in order: dicts of `__key__`, `__url__` and each file's lower-cased
    extensions → its bytes. A shard that cannot be opened or read further, and a file whose extension
    the sample already has, go to `handler`, once each, the URL added to the error's arguments; if the
    handler returns False the error is raised (where webdataset would stop quietly). What was
    read before an error is kept. A stream's error on closing (a `pipe:` command's exit status) counts
    only where the stream was read to its end without error: closed early, a command may well fail.
    `wanted(i)` False: sample i comes with its key only, its files' bytes skipped (by seeking, where
    the stream can: a resumed worker finds its place in a shard from the tar headers alone)."""
    from webdataset.gopen import gopen

    reported: list[Exception] = []

    def report(exc: Exception) -> None:
        reported.append(exc)
        exc.args = exc.args + (url,)
        try:
            keep_going = handler(exc)
        except Exception as raised:  # the handler's own error goes on as it is
            reported.append(raised)
            raise
        if not keep_going:
            raise exc

    try:
        stream = gopen(url)
    except Exception as exc:
        report(exc)
        return
    sample: Optional[dict] = None
    index, last_key, read_to_end = -1, None, False
    parts: Optional[tuple[str, str]] = None  # the key and extensions of the file tar_members yields next

    def read(name: str) -> bool:  # called for each regular file in order, right before it is yielded
        nonlocal index, last_key, parts
        parts = _sample_file(name)
        if parts is None:
            return False
        if parts[0] != last_key:
            index, last_key = index + 1, parts[0]
        return wanted is None or wanted(index)

    try:
        for name, data in tar_members(stream, read):
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
                report(ValueError(f"{name}: duplicate file name in tar file"))
                continue
            sample[extension] = data
        read_to_end = True
    except Exception as exc:
        if exc not in reported:  # one the handler said to raise goes on as it is
            report(exc)
        else:
            raise
    finally:
        try:
            stream.close()  # a pipe: reports its command's exit status here
        except Exception as exc:
            if read_to_end:
                report(exc)
    if sample is not None:
        yield sample


def _sample_file(name: str) -> Optional[tuple[str, str]]:
    """A file's sample key and lower-cased extensions, as webdataset splits them; None: in no sample."""
    if "/" not in name and name.startswith("__") and name.endswith("__") or _META.match(name):
        return None
    key, extension = base_plus_ext(name)
    return None if key is None or extension is None else (key, extension.lower())


def tar_members(stream, read: Optional[Callable[[str], bool]] = None) -> Iterator[tuple[str, Optional[bytes]]]:
    """(name, bytes) of each regular file of a tar stream, in order; bytes None where `read(name)`,
    called for each of them right before it is yielded, says not to read them (skipped by seeking where
    the stream can). An empty stream, a first block that is no
    tar header (nor a compressed tar), a member cut short and an unreadable header after a pax or GNU
    long-name header raise TarError; as with tarfile, any other unreadable header after the first (cut,
    damaged, other bytes after the archive, a compressed stream's tail) ends the archive quietly."""
    header = _read(stream, BLOCK)
    compressed = False
    if not (len(header) == BLOCK and _valid(header)):
        for magic, opener in _COMPRESSED:
            if magic.match(header):
                stream, compressed = opener(io.BufferedReader(_Rejoined(header, stream))), True
                header = _read(stream, BLOCK)
                break
    if not header:
        raise TarError("an empty file, not a tar archive")
    if header == _EMPTY:
        return
    if len(header) < BLOCK or not _valid(header):
        raise TarError("not a tar archive (its first header's checksum does not match)")
    long_name: Optional[str] = None
    long_size: Optional[int] = None
    first = True
    while True:
        kind = header[156:157]
        extended = kind in (b"x", b"L", b"g", b"K")  # headers about the next member
        try:
            size = _number(header[124:136]) if long_size is None or extended else long_size
        except TarError:
            if first:
                raise
            return  # a damaged header whose checksum happens to match: tarfile ends there too
        first = False
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
        try:
            header = _read(stream, BLOCK)
        except (EOFError, gzip.BadGzipFile, lzma.LZMAError, zlib.error):  # a decompressor's: a cut or a tail
            if not compressed:
                raise
            header = b""
        if len(header) < BLOCK or header == _EMPTY or not _valid(header):
            if extended:
                raise TarError("the header after a pax or GNU long-name header cannot be read")
            return


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


def _valid(header: bytes) -> bool:
    """Whether a 512-byte block is a tar header: its checksum (unsigned, or signed as some old tars sum)."""
    try:
        stored = _number(header[148:156])
    except TarError:
        return False
    unsigned = sum(header) - sum(header[148:156]) + 8 * 32  # the checksum field counts as spaces
    return stored == unsigned or stored == unsigned - 256 * sum(b > 127 for b in header[:148] + header[156:])


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
    """A header's name, with its ustar prefix where one is (as tarfile reads any header's)."""
    name, prefix = header[:100].split(b"\0", 1)[0], header[345:500].split(b"\0", 1)[0]
    return (prefix + b"/" + name if prefix else name).decode("utf-8", "surrogateescape")


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
