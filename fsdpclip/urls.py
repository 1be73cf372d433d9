"""Shard URLs of a webdataset source: expansion, whether one names a local file, and whether the data
reader can open it at all (no torch)."""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Union
from urllib.parse import urlparse

_S3 = "pipe:aws s3 cp s3://BUCKET/shard.tar - (or pipe:s5cmd cat s3://...)"
_AZURE = "pipe:azcopy copy 'https://ACCOUNT.blob.core.windows.net/...' --to-stdout"
# How to read a cloud store the reader has no opener for, by URL scheme.
CLOUD_HINTS = {"s3": _S3, "s3a": _S3, "gcs": "gs://BUCKET/shard.tar (gsutil) or pipe:gcloud storage cat gs://...",
               "az": _AZURE, "abfs": _AZURE, "abfss": _AZURE, "wasb": _AZURE}


def shard_urls(urls: Union[str, list[str]]) -> list[str]:
    """Brace- and '::'-expanded shard list, as webdataset expands it."""
    from webdataset.shardlists import expand_urls

    items = [urls] if isinstance(urls, str) else urls
    return [url for item in items for url in expand_urls(item)]


def _scheme(url: str) -> str:
    return urlparse(url).scheme


def is_local(url: str) -> bool:
    """Whether a shard URL names a file on this machine (remote ones cannot be checked)."""
    return _scheme(url) in ("", "file")


def local_path(url: str) -> str:
    """The file a local shard URL names (a `file:` URL's path, or the URL itself)."""
    from urllib.request import url2pathname

    return url2pathname(urlparse(url).path) if _scheme(url) == "file" else url


@lru_cache(maxsize=1)
def reader_schemes() -> tuple[str, ...]:
    """The URL schemes webdataset's reader has an opener for (besides local paths and file:)."""
    import importlib
    import sys

    importlib.import_module("webdataset.gopen")  # the package re-exports a function under the module's name
    return tuple(sorted(k for k in sys.modules["webdataset.gopen"].gopen_schemes if not k.startswith("_")))


def scheme_problem(url: str) -> Optional[tuple[str, str]]:
    """(problem, hint) when webdataset's reader has no opener for the URL's scheme, else None."""
    schemes = reader_schemes()
    scheme = _scheme(url)
    if scheme in ("", "file", *schemes):
        return None
    hint = CLOUD_HINTS.get(scheme)
    return (f"the data reader cannot open '{scheme}:' URLs (it opens local paths, file: and "
            f"{', '.join(s + ':' for s in schemes)})", f"use {hint}" if hint else "stream it through pipe:COMMAND")
