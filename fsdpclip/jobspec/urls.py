"""Shard URLs of a webdataset source: expansion, whether one names a local file, and whether the data
reader can open it at all (no torch)."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Union
from urllib.parse import urlparse

_S3 = "pipe:aws s3 cp s3://BUCKET/shard.tar - (or pipe:s5cmd cat s3://...)"
_AZURE = "pipe:azcopy copy 'https://ACCOUNT.blob.core.windows.net/...' --to-stdout"
# How to read a cloud store the reader has no opener for, by URL scheme.
CLOUD_HINTS = {"s3": _S3, "s3a": _S3, "gcs": "gs://BUCKET/shard.tar (gsutil) or pipe:gcloud storage cat gs://...",
               "az": _AZURE, "abfs": _AZURE, "abfss": _AZURE, "wasb": _AZURE}


# Shards of one job: what every rank's list holds (~0.4 KB and ~10 µs to make each); larger sets go in larger shards.
MAX_SHARDS = 2 ** 20


def shard_urls(urls: Union[str, list[str]]) -> list[str]:
    """Brace- and '::'-expanded shard list, as webdataset expands it."""
    from webdataset.shardlists import expand_urls

    items = [urls] if isinstance(urls, str) else urls
    return [url for item in items for url in expand_urls(item)]


class ShardPatterns:
    """The shard URLs `shard_urls` would make, without making them: how many, and any one by its index.
    A range such as {0..999999999} expands to a billion strings (minutes and gigabytes); its count and a
    sample of it cost nothing. Unbalanced braces are a ValueError."""

    def __init__(self, urls: Union[str, list[str]]):
        from webdataset.shardlists import envsubst

        self.patterns = []
        for item in [urls] if isinstance(urls, str) else urls:
            for url in item.split("::"):
                for _ in range(10):  # as webdataset substitutes ${VAR} from WDS_VAR
                    url, last = envsubst(url), url
                    if url == last:
                        break
                self.patterns.append(_pattern(url))
        self.count = sum(p.count for p in self.patterns)

    def __getitem__(self, index: int) -> str:
        import braceexpand

        for pattern in self.patterns:
            if index < pattern.count:
                return braceexpand.escape_re.sub(r"\1", pattern.item(index))  # pyright: ignore[reportAttributeAccessIssue]  (its stub leaves them out)
            index -= pattern.count
        raise IndexError(index)

    def sample(self, size: int) -> list[str]:
        """Every URL when there are at most `size`, else `size` of them spread evenly, the first and last included."""
        if self.count <= size:
            return [self[i] for i in range(self.count)]
        return [self[(self.count - 1) * k // (size - 1)] for k in range(size)]


class _Choices:
    """A part of a brace pattern: `count` strings, the index-th made by `item`."""

    def __init__(self, count: int, item):
        self.count, self.item = count, item


def _literal(text: str) -> _Choices:
    return _Choices(1, lambda index: text)


def _product(parts: list[_Choices]) -> _Choices:
    """Every combination of the parts, the last varying fastest (itertools.product's order, as braceexpand)."""

    def item(index: int) -> str:
        pieces = []
        for part in reversed(parts):
            index, inner = divmod(index, part.count)
            pieces.append(part.item(inner))
        return "".join(reversed(pieces))

    return _Choices(math.prod(p.count for p in parts), item)


def _chain(members: list[_Choices]) -> _Choices:
    def item(index: int) -> str:
        for member in members:
            if index < member.count:
                return member.item(index)
            index -= member.count
        raise IndexError(index)

    return _Choices(sum(m.count for m in members), item)


def _pattern(pattern: str) -> _Choices:
    """braceexpand's parse_pattern, counting."""
    start = pos = depth = 0
    parts = []
    while pos < len(pattern):
        if pattern[pos] == "\\":
            pos += 2
            continue
        if pattern[pos] == "{":
            if depth == 0 and pos > start:
                parts.append(_literal(pattern[start:pos]))
                start = pos
            depth += 1
        elif pattern[pos] == "}":
            depth -= 1
            if depth == 0:
                expression = pattern[start + 1:pos]
                found = _expression(expression)
                parts += [found] if found is not None else [_literal("{"), _pattern(expression), _literal("}")]
                start = pos + 1
        pos += 1
    if depth != 0:
        raise ValueError(f"unbalanced braces in '{pattern}'")
    if start < pos:
        parts.append(_literal(pattern[start:]))
    return _product(parts)


def _expression(expression: str) -> Optional[_Choices]:
    """braceexpand's parse_expression and parse_sequence, counting: a number or letter range, or a
    comma-separated sequence; None for anything else (kept with its braces)."""
    import braceexpand

    if match := braceexpand.int_range_re.match(expression):  # pyright: ignore[reportAttributeAccessIssue]  (its stub leaves them out)
        first, last, step = match.groups()
        padding = max(len(first), len(last)) if any(
            s.startswith(("0", "-0")) for s in (first, last) if s not in ("0", "-0")) else 0
        step = (int(step) or 1) if step else 1
        first, last = int(first), int(last)
        numbers = range(first, last + 1, step) if first < last else range(first, last - 1, -step)
        return _Choices(len(numbers), lambda index: f"%0{padding}d" % numbers[index])
    if match := braceexpand.char_range_re.match(expression):  # pyright: ignore[reportAttributeAccessIssue]  (its stub leaves them out)
        letters = braceexpand.make_char_range(*match.groups())  # pyright: ignore[reportAttributeAccessIssue]  (its stub leaves them out)
        return _Choices(len(letters), lambda index: letters[index])
    start = pos = depth = 0
    members = []
    while pos < len(expression):
        if expression[pos] == "\\":
            pos += 2
            continue
        if expression[pos] == "{":
            depth += 1
        elif expression[pos] == "}":
            depth -= 1
        elif expression[pos] == "," and depth == 0:
            members.append(_pattern(expression[start:pos]))
            start = pos + 1
        pos += 1
    if depth != 0 or not members:
        return None
    return _chain(members + [_pattern(expression[start:])])


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
