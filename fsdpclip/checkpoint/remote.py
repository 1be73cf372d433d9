"""Checkpoints mirrored in object storage (`checkpoint.remote`: s3://, gs://, any fsspec URL), so that a run whose
local directory is gone (a requeued job on other nodes, a fresh machine) resumes from the remote copy.

The remote folder holds what `RUN_DIR/checkpoints/` holds: `step-NNNNNNNN/` with the same files, and `latest`.
Whoever can write the bucket may not write the run directory: a remote `latest` is followed only where it names one
of the folder's own checkpoints (a path or another name is ignored, with a warning), and every download stays inside
the run directory (a key that would climb out of it is refused).
Rank 0 uploads each checkpoint once it is complete locally, on a background thread (`Uploads`): whatever an earlier
attempt left of it removed, its files but meta.json, then meta.json (a remote checkpoint with meta.json is
complete, as a local one is), then `latest`, then the remote checkpoints beyond `checkpoint.keep` and any
incomplete ones are deleted. Rank 0 reads every file, so the run directory is one every rank writes into, as local
checkpoints already need. A resume downloads a remote checkpoint whole through a `.partial` directory
(`fetch_resume`). Everything goes through fsspec (s3fs for s3://, gcsfs for gs://), imported when first used.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Optional

from fsdpclip.checkpoint.layout import (
    CHECKPOINTS, LATEST, META, PARTIAL_SUFFIX, CheckpointError, complete_checkpoints, is_checkpoint_name,
    point_latest,
)
from fsdpclip.jobspec.job import CheckpointSpec, is_url

log = logging.getLogger("fsdpclip.checkpoint.remote")
DOWNLOADS = "downloads"  # RUN_DIR/downloads/: checkpoints a resume URL named, downloaded
PROBE = ".fsdpclip-write-check"  # the object `validate --check-remote` writes and deletes


IN_PROCESS = {"memory"}  # fsspec schemes whose files live in the process that wrote them
NEEDS = {"hdfs": "pyarrow", "arrow_hdfs": "pyarrow"}  # packages a filesystem imports only once it is made


def backend_problem(url: str) -> Optional[tuple[str, str]]:
    """(problem, hint) where this machine cannot open `url` through fsspec (fsspec, or the package its scheme
    needs, not installed; a scheme fsspec does not know), or where what is written there would not outlive the
    process (memory://); None where it can. Touches no network."""
    scheme = url.split("://", 1)[0]
    if scheme in IN_PROCESS:
        return (f"{scheme}:// keeps its files in the memory of the process that writes them: no other rank nor a "
                "later launch would find a checkpoint there", "a folder in object storage, e.g. s3://bucket/runs/NAME")
    if importlib.util.find_spec("fsspec") is None:
        return "needs the 'fsspec' package", "pip install 'fsdpclip[remote]'"
    from fsspec.registry import known_implementations, registry

    if scheme in registry and scheme not in NEEDS:
        return None
    known = known_implementations.get(scheme)
    if known is None:
        return f"fsspec knows no filesystem for '{scheme}://'", "s3:// (s3fs) and gs:// (gcsfs) are the usual ones"
    package = NEEDS.get(scheme) or known["class"].split(".", 1)[0]
    if importlib.util.find_spec(package) is None:
        return f"needs the '{package}' package for {scheme}://", known.get("err") or f"pip install {package}"
    return None


def error_line(exc: BaseException) -> str:
    """An exception of any backend on one line: its type and message."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


class RemoteFolder:
    """A folder of checkpoints in object storage, laid out as `RUN_DIR/checkpoints/`."""

    def __init__(self, url: str, options: dict):
        import fsspec

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def names(self) -> list[str]:
        """The checkpoint names in the folder, complete or not, oldest first."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(name for name in (PurePosixPath(p).name for p in found) if is_checkpoint_name(name))

    def is_complete(self, name: str) -> bool:
        return self.fs.exists(self._path(name, META))

    def latest(self) -> Optional[str]:
        """The newest complete checkpoint: the one `latest` names where it is one of the folder's, else the newest
        complete found."""
        names = self.names()
        try:
            named = self.fs.cat_file(self._path(LATEST)).decode(errors="replace").strip()
        except FileNotFoundError:
            named = None
        if named in names and self.is_complete(named):
            return named
        if named is not None and named not in names:
            log.warning("%s/%s names %r, which is not one of its checkpoints (step-NNNNNNNN in the folder): ignored",
                        self.url, LATEST, named[:200])
        return next((name for name in reversed(names) if self.is_complete(name)), None)

    def put(self, files: list[Path], checkpoint: Path) -> None:
        """Files of a local checkpoint uploaded into the remote checkpoint of the same name."""
        self.fs.put([str(f) for f in files],
                    [self._path(checkpoint.name, *f.relative_to(checkpoint).parts) for f in files])

    def upload(self, checkpoint: Path) -> None:
        """A complete local checkpoint uploaded, meta.json after every other file, then named by `latest`."""
        self._remove(checkpoint.name)
        files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
        self.put([f for f in files if f.name != META], checkpoint)
        self.put([checkpoint / META], checkpoint)
        self.fs.pipe_file(self._path(LATEST), f"{checkpoint.name}\n".encode())

    def prune(self, keep: int) -> list[str]:
        """Delete the complete checkpoints before the newest `keep` and every incomplete one (an upload that
        died: only one upload runs at a time); returns their names."""
        names = self.names()
        complete = [name for name in names if self.is_complete(name)]
        removed = [name for name in names if name not in complete[-keep:]]
        for name in removed:
            self._remove(name)
        return removed

    def _remove(self, name: str) -> None:
        found = self.fs.find(self._path(name))
        if found:
            self.fs.rm(found)

    def download(self, name: str, into: Path) -> Path:
        """Remote checkpoint `name` into directory `into` (through a `.partial` directory, renamed once whole);
        CheckpointError for a name or key that would leave `into`, before anything there is touched."""
        final, partial = _inside(into, name), _inside(into, name + PARTIAL_SUFFIX)
        source = self._path(name)
        files = self.fs.find(source)
        local = [_inside(partial, *PurePosixPath(f).relative_to(source).parts) for f in files]
        shutil.rmtree(partial, ignore_errors=True)
        for path in {partial, *(p.parent for p in local)}:
            path.mkdir(parents=True, exist_ok=True)
        self.fs.get(files, [str(p) for p in local])
        if not (partial / META).is_file():
            raise CheckpointError(f"{self.url}/{name} is not a complete checkpoint (it has no {META})")
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        return final

    def access_problem(self) -> Optional[str]:
        """Why this folder cannot be used (it cannot be listed, or an object cannot be written and deleted there),
        or None: what `validate --check-remote` asks."""
        try:
            self.names()
        except Exception as exc:  # noqa: BLE001  (each backend fails in its own exception types)
            return f"cannot be listed: {error_line(exc)}"
        try:
            self.fs.pipe_file(self._path(PROBE), b"")
            self.fs.rm_file(self._path(PROBE))
        except Exception as exc:  # noqa: BLE001
            return f"cannot be written: {error_line(exc)}"
        return None


def _inside(folder: Path, *parts: str) -> Path:
    """`folder` joined with the parts of a remote key; CheckpointError where they could lead out of it (an
    absolute path, '..', '.' or an empty part: names object storage keeps as they are)."""
    if not parts or any(part in ("", ".", "..") or "/" in part or "\0" in part for part in parts):
        raise CheckpointError(f"refusing to download {'/'.join(parts)!r} into {folder}: it is no name inside it")
    return folder.joinpath(*parts)


def remote_checkpoint(url: str, options: dict) -> tuple[RemoteFolder, str]:
    """(the folder, the checkpoint's name) a resume URL names: a checkpoint (it holds meta.json), or a folder of
    them (its newest complete one)."""
    folder = RemoteFolder(url, options)
    if folder.fs.exists(folder._path(META)):
        parent, name = folder.url.rsplit("/", 1)
        return RemoteFolder(parent, options), name
    name = folder.latest()
    if name is None:
        raise CheckpointError(f"{url} is neither a complete checkpoint (a folder with {META}) nor a folder holding one")
    return folder, name


@contextlib.contextmanager
def _reading(url: str):
    """Any failure to read object storage as a CheckpointError naming the URL."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001  (each backend fails in its own exception types)
        raise CheckpointError(f"cannot read {url} to resume from it: {error_line(exc)}") from None


def fetch_resume(run_dir: Path, spec: CheckpointSpec) -> Optional[str]:
    """`checkpoint.resume` with what object storage holds made local (rank 0, before the candidates are chosen):
    a resume URL's checkpoint downloaded into RUN_DIR/downloads/ (its local path returned); for 'latest', the
    newest complete checkpoint of `checkpoint.remote` downloaded into RUN_DIR/checkpoints/ and named `latest`
    there when no local checkpoint is as new. CheckpointError when the storage cannot be read."""
    resume = spec.resume
    if resume is not None and is_url(resume):
        with _reading(resume):
            folder, name = remote_checkpoint(resume, spec.remote_options)
            return str(_download(folder, name, run_dir / DOWNLOADS))
    if resume == "latest" and spec.remote is not None:
        with _reading(spec.remote):
            folder = RemoteFolder(spec.remote, spec.remote_options)
            name, local = folder.latest(), complete_checkpoints(run_dir)
            if name is None:
                log.info("%s holds no complete checkpoint to resume from", spec.remote)
            elif not local or local[-1].name < name:
                log.info("%s: %s is newer than any checkpoint in %s", spec.remote, name, run_dir / CHECKPOINTS)
                point_latest(_download(folder, name, run_dir / CHECKPOINTS))
    return resume


def _download(folder: RemoteFolder, name: str, into: Path) -> Path:
    began = time.monotonic()
    log.info("downloading %s/%s into %s", folder.url, name, into)
    path = folder.download(name, into)
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    log.info("downloaded %s (%.1f MB in %.1f s)", name, size / 1e6, time.monotonic() - began)
    return path


class Uploads:
    """Rank 0's uploads of complete checkpoints into a `RemoteFolder`, one at a time on a background thread. A
    checkpoint completed while one uploads waits for it; a newer one completed meanwhile takes its place (the
    older is not uploaded: only the newest waits). A failed upload is a warning: the remote `latest` stays on the
    last checkpoint uploaded whole, and the next one is uploaded as usual."""

    def __init__(self, folder: RemoteFolder, keep: int):
        self.folder, self.keep = folder, keep
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-upload")
        self.pending: list[tuple[Future, Path]] = []
        self.failure: Optional[str] = None  # why the last upload failed; None once one succeeds

    def submit(self, checkpoint: Path) -> None:
        for future, waiting in self.pending:
            if future.cancel():
                log.info("%s is not uploaded: %s was completed before its upload began", waiting.name, checkpoint.name)
        self.pending = [(f, c) for f, c in self.pending if not f.done()]
        self.pending.append((self.executor.submit(self._upload, checkpoint), checkpoint))

    def uploading(self) -> set[Path]:
        """The local checkpoints still to be uploaded (which `keep` spares locally until then)."""
        return {checkpoint for future, checkpoint in self.pending if not future.done()}

    def _upload(self, checkpoint: Path) -> None:
        began = time.monotonic()
        try:
            self.folder.upload(checkpoint)
            self.folder.prune(self.keep)
        except Exception as exc:  # noqa: BLE001  (each backend fails in its own exception types)
            self.failure = f"{checkpoint.name} was not uploaded to {self.folder.url}: {error_line(exc)}"
            log.warning("%s; the remote latest stays the last checkpoint uploaded whole", self.failure)
            return
        self.failure = None
        log.info("uploaded %s to %s in %.1f s", checkpoint.name, self.folder.url, time.monotonic() - began)

    def wait(self) -> Optional[str]:
        """Wait for the uploads under way; why the last one failed, or None."""
        for future, _ in self.pending:
            if not future.cancelled():
                future.result()
        self.pending = []
        return self.failure

    def close(self) -> None:
        """Drop the uploads not begun; one under way ends before the process does."""
        self.executor.shutdown(wait=False, cancel_futures=True)
