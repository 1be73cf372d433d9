"""Files of the run directory and its disk: written whole or not at all, text files read with bounds, the
space left, and output that outlives its terminal (diverted to the run's logs once the terminal or pipe is gone).
No torch."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import sys
from pathlib import Path
from typing import Optional




def write_atomically(path: Path, content: str | bytes) -> None:
    """Write a whole file or nothing: readers never see half of it (also across nodes)."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class LineLog:
    """A file of lines (metrics.jsonl) appended to whole lines at a time: a line that does not fit on the disk is
    taken back before the error is raised, and a torn last line (a process killed in the middle of a write, a disk
    that filled) is cut off when the file is opened, so that nothing is ever appended to half a line."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.ftruncate(self.descriptor, self._complete_length())
        except BaseException:
            os.close(self.descriptor)
            raise

    def _complete_length(self) -> int:
        """The file's length up to and with its last newline."""
        end = os.fstat(self.descriptor).st_size
        while end > 0:
            start = max(0, end - 2 ** 16)
            cut = os.pread(self.descriptor, end - start, start).rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            end = start
        return 0

    def append(self, line: str) -> None:
        """Write `line` and a newline, all of it or nothing."""
        data = (line + "\n").encode()
        began = os.lseek(self.descriptor, 0, os.SEEK_END)
        try:
            written = 0
            while written < len(data):
                written += os.write(self.descriptor, data[written:])
        except OSError as exc:
            os.ftruncate(self.descriptor, began)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def close(self) -> None:
        os.close(self.descriptor)


MAX_TEXT_BYTES = 64 * 2 ** 20  # a spec, a model config, a class-name list: far smaller than this
FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
              stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def special_file(path: Path) -> Optional[str]:
    """What a path the user named is when it is there but is no regular file (a FIFO, a device, a directory),
    else None: reading it would block, never end, or fail."""
    try:
        kind = stat.S_IFMT(os.stat(path).st_mode)
    except OSError:
        return None
    return None if kind == stat.S_IFREG else FILE_KINDS.get(kind, "a special file")


def read_text_file(path: Path, limit: int = MAX_TEXT_BYTES) -> str:
    """A UTF-8 text file the user named, read only if it is a regular file of at most `limit` bytes: a FIFO
    would block forever and a device never end (/dev/zero fills the memory). Anything else is an OSError whose
    strerror says why (not UTF-8 included), as a missing file's does."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO waits for a writer without it
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        kind = stat.S_IFMT(os.fstat(descriptor).st_mode)
        if kind != stat.S_IFREG:
            raise OSError(None, f"not a regular file but {FILE_KINDS.get(kind, 'a special file')}", str(path))
        with os.fdopen(descriptor, "rb", closefd=False) as file:
            data = file.read(limit + 1)
    finally:
        os.close(descriptor)
    if len(data) > limit:
        raise OSError(None, f"larger than {limit:,} bytes, more than a text file here holds", str(path))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise OSError(None, f"not UTF-8 text (byte 0x{data[exc.start]:02x} on line {line})", str(path)) from None


def disk_free(path: Path) -> int:
    """Bytes free for this user on the filesystem that holds (or would hold) `path`."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def disk_of(path: Path) -> tuple[str, str]:
    """The device (what is mounted: /dev/nvme0n1p2, tmpfs, server:/export) and the mount point holding `path`
    (Linux: /proc/self/mountinfo); ('the disk', '/') where that cannot be read."""
    where, found = os.path.realpath(path), ("the disk", "/")
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    def unescape(field: str) -> str:  # the kernel writes a space in a path as \040
        return re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), field)

    for line in mounts:
        fields, _, rest = line.partition(" - ")
        mount, source = unescape(fields.split()[4]), unescape(rest.split()[1])
        inside = where == mount or where.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(found[1]):
            found = (source, mount)
    return found


def no_space_message(path: Path, free: int, needed: Optional[int] = None) -> str:
    """What a write that does not fit says: the device, its mount point, the path, what it needs and what is free."""
    device, mount = disk_of(path)
    need = f"needed ~{megabytes(needed)}, " if needed is not None else ""
    return f"no space left on {device} ({mount}) writing {path}: {need}{megabytes(free)} free"


def megabytes(count: int) -> str:
    return f"{count / 1e6:,.0f} MB" if count >= 1e6 else f"{count / 1e6:.2f} MB"


HANGUP_ERRORS = (errno.EIO, errno.EPIPE)  # a terminal that hung up, a pipe whose reader is gone


class DivertingStream:
    """sys.stdout or sys.stderr, outliving the terminal or pipe it writes to: once a write or flush fails with
    one of HANGUP_ERRORS, this process's stdout and stderr (file descriptors 1 and 2, so also what native code
    and child processes write) go to `path`, appended, and the write is made there."""

    def __init__(self, stream, path: Path):
        self.stream, self.path = stream, Path(path)

    def write(self, text: str) -> int:
        return self._diverted_on_hangup("write", text)

    def flush(self) -> None:
        return self._diverted_on_hangup("flush")

    def _diverted_on_hangup(self, method: str, *args):
        try:
            return getattr(self.stream, method)(*args)
        except OSError as exc:
            if exc.errno not in HANGUP_ERRORS:
                raise
            divert_output(self.path)
            return getattr(self.stream, method)(*args)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def divert_output(path: Path) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2) to `path`, appended."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):
        os.dup2(descriptor, target)
    os.close(descriptor)


def keep_output(path: Path) -> None:
    """Make sys.stdout and sys.stderr DivertingStreams to `path` (replacing the path of any they are already)."""
    sys.stdout, sys.stderr = (DivertingStream(stream.stream if isinstance(stream, DivertingStream) else stream, path)
                              for stream in (sys.stdout, sys.stderr))


