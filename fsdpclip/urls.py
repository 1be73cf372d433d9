"""Shard URLs of a webdataset source: expansion and whether one names a local file (no torch)."""

from __future__ import annotations

from typing import Union

REMOTE_PREFIXES = ("pipe:", "http://", "https://", "s3://", "gs://", "hf://", "ais://")


def shard_urls(urls: Union[str, list[str]]) -> list[str]:
    """Brace- and '::'-expanded shard list, as webdataset expands it."""
    from webdataset.shardlists import expand_urls

    items = [urls] if isinstance(urls, str) else urls
    return [url for item in items for url in expand_urls(item)]


def is_local(url: str) -> bool:
    """Whether a shard URL names a file on this machine (remote ones cannot be checked)."""
    return not url.startswith(REMOTE_PREFIXES)
