"""The webdataset stream: broken samples, equal batches per epoch on every rank and worker over uneven
shards, exact positions that resume by (shard, offset), the validation of shard counts."""

from __future__ import annotations

import io
import json
import multiprocessing
import shutil
import sys
from collections import Counter
from contextlib import closing
from dataclasses import asdict

import pytest
import torch
import webdataset as wds

from conftest import TINY_CONFIG, write_job
from ranks import run_group
from fsdpclip.checkpoint.layout import CheckpointError
from fsdpclip.data import stream as data_module
from fsdpclip.data.batches import StreamPosition, WebDatasetBatches
from fsdpclip.jobspec.webdataset_spec import WebDatasetSpec
from fsdpclip.data.stream import ShardStream
from fsdpclip.data.digits import CLASSNAMES, load_sklearn_digits, to_jpeg


def write_shards(directory, sizes: list[int], broken: dict[int, str] | None = None,
                 damaged: dict[int, str] | None = None, first: int = 0) -> str:
    """Shards of digit pairs with the given sizes, each caption ending in the sample's global index
    (counted from `first`); `broken` maps a global sample index to a defect ('image', 'caption'),
    `damaged` a shard to one ('garbage': not a tar at all, 'truncated': cut after about 60% of its bytes)."""
    images, labels = load_sklearn_digits()
    index = first
    for shard, size in enumerate(sizes):
        path = directory / f"s-{shard:03d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for _ in range(size):
                sample = {"__key__": f"{index:06d}", "jpg": to_jpeg(images[index]),
                          "txt": f"the digit {CLASSNAMES[labels[index]]}, sample {index}."}
                defect = (broken or {}).get(index)
                if defect == "image":
                    sample["jpg"] = b"this is not a jpeg"
                elif defect == "caption":
                    del sample["txt"]
                sink.write(sample)
                index += 1
        damage = (damaged or {}).get(shard)
        if damage == "garbage":
            path.write_bytes(b"no tar here " * 100)
        elif damage == "truncated":
            path.write_bytes(path.read_bytes()[: int(path.stat().st_size * 0.6)])
    return str(directory / f"s-{{000..{len(sizes) - 1:03d}}}.tar")


def index_tokens(captions: list[str]) -> torch.Tensor:
    """A 'tokenizer' that gives each caption one token: the index of its sample."""
    return torch.tensor([[int(c.rsplit(" ", 1)[-1].rstrip("."))] for c in captions])


def _stream(urls: str | None, batch: int, workers: int = 0, rank: int = 0, world_size: int = 1, samples: int = 100,
            tokenize=None, **spec) -> WebDatasetBatches:
    import torchvision.transforms as T

    spec = WebDatasetSpec(urls=urls, samples=samples, workers=workers, **spec)
    tokenize = tokenize or (lambda texts: torch.zeros(len(texts), 4, dtype=torch.long))  # noqa: E731
    stream = ShardStream(spec, T.ToTensor(), tokenize, batch, rank=rank, world_size=world_size, seed=0)
    return WebDatasetBatches(stream, workers, pin_memory=False)


def _saved(batches: WebDatasetBatches) -> dict:
    """The position as a checkpoint keeps it: torch.save of the state dict, loaded again."""
    saved = io.BytesIO()
    torch.save(batches.state_dict(), saved)
    saved.seek(0)
    return torch.load(saved, weights_only=False)


def test_broken_samples_are_skipped_and_counted(tmp_path):
    urls = write_shards(tmp_path, [10, 10], broken={3: "image", 14: "caption"})
    batches = _stream(urls, batch=6, shuffle_buffer=0)
    iterator = iter(batches)
    images = [next(iterator)[0] for _ in range(3)]  # 18 good samples in epoch 0
    assert all(b.shape == (6, 3, 32, 32) for b in images)
    assert batches.position.epoch == 0
    assert batches.position.broken == 2


def test_a_batchs_captions_are_tokenised_as_each_alone(tmp_path):
    """The workers tokenise a batch's captions in one call: each row is what OpenCLIP's tokenizer gives its
    caption alone, in the batch's order, a broken sample's caption left out (captions longer than the
    context cut alike)."""
    from open_clip.tokenizer import SimpleTokenizer

    tokenizer = SimpleTokenizer(context_length=8)  # "the digit seven, sample 12." is longer
    urls = write_shards(tmp_path, [13], broken={4: "image"})
    _, labels = load_sklearn_digits()
    iterator = iter(_stream(urls, batch=6, shuffle_buffer=0, samples=12, tokenize=tokenizer))
    texts = torch.cat([next(iterator)[1] for _ in range(2)])
    iterator.close()
    alone = [tokenizer([f"the digit {CLASSNAMES[labels[i]]}, sample {i}."]) for i in range(13) if i != 4]
    assert torch.equal(texts, torch.cat(alone))


@pytest.mark.parametrize("batch", [6, 1])
def test_a_caption_the_tokenizer_refuses_is_a_broken_sample(tmp_path, monkeypatch, batch):
    """Where a batch's tokenising raises, its captions are tokenised one by one: a caption that still raises
    makes its sample broken (counted, left out, the batch filled up from the next samples), whatever the
    batch size; only data.UNUSABLE_IN_A_ROW refused in a row stop the stream, with an error that says so."""
    urls = write_shards(tmp_path, [14])

    def picky(captions: list[str]) -> torch.Tensor:
        if any(caption.endswith("sample 3.") for caption in captions):
            raise ValueError("no sample 3")
        return index_tokens(captions)

    batches = _stream(urls, batch=batch, shuffle_buffer=0, samples=12, tokenize=picky)
    iterator = iter(batches)
    texts = torch.cat([next(iterator)[1] for _ in range(12 // batch)])
    iterator.close()
    assert texts[:, 0].tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12] and batches.position.broken == 1

    class Runaway(BaseException):
        """Raised past the point where the stream should have stopped (instead of a test that never ends)."""

    calls = []

    def refuses(captions: list[str]) -> torch.Tensor:
        calls.append(captions)
        if len(calls) > 500:
            raise Runaway
        raise ValueError("no captions today")

    monkeypatch.setattr(data_module, "UNUSABLE_IN_A_ROW", 20)
    with pytest.raises(RuntimeError, match="captions in a row could not be tokenised .*no captions today"):
        next(iter(_stream(urls, batch=batch, shuffle_buffer=0, samples=12, tokenize=refuses)))


def test_image_and_text_keys(tmp_path, monkeypatch):
    """data.image_key (';'-separated, first found) and data.text_key choose the sample's members; a
    stream whose samples all lack them stops with an error that says so (it would never yield)."""
    images, labels = load_sklearn_digits()
    with wds.TarWriter(str(tmp_path / "k-000.tar")) as sink:
        for i in range(6):
            sink.write({"__key__": f"{i:04d}", "png": to_jpeg(images[i]), "caption": f"digit {labels[i]}"})
    urls = str(tmp_path / "k-000.tar")
    taken = _stream(urls, batch=6, shuffle_buffer=0, image_key="webp;png", text_key="caption")
    batch_images, batch_texts = next(iter(taken))
    assert batch_images.shape == (6, 3, 32, 32) and taken.position.broken == 0
    monkeypatch.setattr(data_module, "UNUSABLE_IN_A_ROW", 50)
    default = _stream(urls, batch=1, shuffle_buffer=0)  # jpg/txt: every sample lacks them
    with pytest.raises(RuntimeError, match="50 samples in a row could not be used .* check data.image_key"):
        next(iter(default))


def test_position_continues_exactly(tmp_path):
    urls = write_shards(tmp_path, [9, 12, 7, 11])
    full = _stream(urls, batch=4, workers=2, samples=39, shuffle_buffer=5)  # 9 batches an epoch
    iterator = iter(full)
    reference = [next(iterator)[0] for _ in range(12)]  # crosses into the second epoch
    first = _stream(urls, batch=4, workers=2, samples=39, shuffle_buffer=5)
    iterator = iter(first)
    head = [next(iterator)[0] for _ in range(5)]
    resumed = _stream(urls, batch=4, workers=2, samples=39, shuffle_buffer=5)
    resumed.load_state_dict(_saved(first))
    iterator = iter(resumed)
    tail = [next(iterator)[0] for _ in range(7)]
    for got, want in zip(head + tail, reference):
        assert torch.equal(got, want)


def test_workers_started_early_give_the_same_stream_and_stop_on_close(tmp_path):
    """`start` runs the workers before the first batch is asked for; the batches are those of a stream
    iterated without it (into the second epoch); a started stream no longer takes a position, and
    `close` stops workers that no iteration took over."""
    urls = write_shards(tmp_path, [9, 12, 7, 11])
    reference = _stream(urls, batch=4, workers=2, samples=39, shuffle_buffer=5)
    iterator = iter(reference)
    want = [next(iterator)[0] for _ in range(12)]
    iterator.close()
    before = len(multiprocessing.active_children())
    early = _stream(urls, batch=4, workers=2, samples=39, shuffle_buffer=5)
    early.start()
    assert len(multiprocessing.active_children()) == before + 2
    with pytest.raises(RuntimeError, match="after the data workers were started"):
        early.load_state_dict(_saved(reference))
    iterator = iter(early)
    got = [next(iterator)[0] for _ in range(12)]
    iterator.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)
    unused = _stream(urls, batch=4, workers=2, samples=39)
    unused.start()
    assert len(multiprocessing.active_children()) == before + 2
    unused.close()
    assert len(multiprocessing.active_children()) == before



def test_the_next_epochs_workers_start_before_it_begins(tmp_path):
    """With the last workers × PREFETCH batches of an epoch left, the next epoch's workers are started
    (their batches are those of that epoch started afresh), and closing the iteration there stops them
    with the current ones."""
    urls = write_shards(tmp_path, [9, 12, 7, 11])
    before = len(multiprocessing.active_children())
    stream = _stream(urls, batch=2, workers=1, samples=39, shuffle_buffer=5)  # 19 batches an epoch
    iterator = iter(stream)
    try:
        children, first = [], []
        for _ in range(19):
            first.append(next(iterator)[0])
            children.append(len(multiprocessing.active_children()) - before)
        assert children == [1] * 14 + [2] * 5  # from batch 15 on, 19 - 15 = 4 = 1 worker × PREFETCH left
        second = [next(iterator)[0] for _ in range(19)]
        assert len(multiprocessing.active_children()) - before == 2  # epoch 2's tail: epoch 3's worker started
        iterator.close()
        assert len(multiprocessing.active_children()) == before
    finally:  # no worker outlives a failed assertion
        iterator.close()
        stream.close()
    fresh = _stream(urls, batch=2, workers=1, samples=39, shuffle_buffer=5)
    fresh.load_state_dict(asdict(StreamPosition(epoch=1)))
    iterator = iter(fresh)
    want = [next(iterator)[0] for _ in range(19)]
    iterator.close()
    assert all(torch.equal(a, b) for a, b in zip(second, want)) and len(second) == len(want)
    assert not all(torch.equal(a, b) for a, b in zip(first, second))  # another epoch, another order
    in_process = iter(_stream(urls, batch=2, workers=0, samples=39, shuffle_buffer=5))  # no early start
    want = [next(in_process)[0] for _ in range(38)]
    in_process.close()
    assert all(torch.equal(a, b) for a, b in zip(first + second, want))

UNEVEN = [3, 25, 7, 14, 30, 2, 9, 18]  # 108 samples in 8 shards: 2 ranks × 2 workers × 2 shards each


def test_every_rank_and_worker_yields_its_quota_each_epoch(tmp_path):
    """2 ranks × 2 workers over shards of 2 to 30 samples, 108 samples an epoch, batch 4: every rank
    yields 13 batches an epoch (108 // 8), its workers 7 and 6, for several epochs; a worker whose
    shards run out reads them again, and only then does a sample come twice in a rank's epoch. The
    rank's stream (real DataLoader workers) takes the workers' batches in turn and turns the epoch
    after exactly 13."""
    urls = write_shards(tmp_path, UNEVEN)
    offsets = [sum(UNEVEN[:i]) for i in range(len(UNEVEN) + 1)]
    shard_of = {index: shard for shard in range(len(UNEVEN)) for index in range(offsets[shard], offsets[shard + 1])}
    again, once = 0, 0
    for rank in range(2):
        batches = _stream(urls, batch=4, workers=2, rank=rank, world_size=2, samples=108, shuffle_buffer=6,
                          tokenize=index_tokens)
        stream = batches.stream
        assert stream.batches_per_epoch == 13 and [stream.quota(w, 2) for w in (0, 1)] == [7, 6]
        expected = []
        for epoch in range(3):
            stream.epoch, stream.resume = epoch, {}
            ids = Counter()
            per_worker = {w: list(stream.worker_batches(w, 2)) for w in (0, 1)}
            for worker, got in per_worker.items():
                assert len(got) == stream.quota(worker, 2)
                mine = set(stream._pass_shards(worker, 2, 0))  # indices into the URL list
                samples = torch.cat([b["texts"][:, 0] for b in got]).tolist()
                assert {shard_of[i] for i in samples} <= mine  # its own shards only
                passes = got[-1]["position"].readings[0].passes
                if passes == 0:
                    assert len(set(samples)) == len(samples), (rank, epoch, worker)
                    once += 1
                else:  # more samples wanted than its shards hold: it read them again
                    assert sum(UNEVEN[s] for s in mine) < len(samples) + stream.spec.shuffle_buffer
                    again += 1
                ids.update(samples)
            twice = {i for i, n in ids.items() if n > 1}
            repeating = {shard for w, got in per_worker.items() if got[-1]["position"].readings[0].passes
                         for shard in stream._pass_shards(w, 2, 0)}
            assert {shard_of[i] for i in twice} <= repeating
            expected += [per_worker[j % 2][j // 2]["texts"] for j in range(13)]
        iterator = iter(batches)
        for j, want in enumerate(expected):
            assert torch.equal(next(iterator)[1], want), j
            assert (batches.position.epoch, batches.position.batches) == (j // 13, j % 13 + 1)
        iterator.close()
    assert again and once  # both kinds of worker were seen


def _cases(tmp_path, **spec):
    """Uneven shards with broken samples, a shard that is no tar and a truncated one, on rank 1 of 2."""
    urls = write_shards(tmp_path, UNEVEN, broken={30: "image", 47: "caption", 80: "image"},
                        damaged={5: "garbage", 7: "truncated"})
    return lambda: _stream(urls, batch=4, rank=1, world_size=2, samples=108, tokenize=index_tokens, **spec)


@pytest.mark.parametrize("workers,buffer,resampled", [(0, 0, False), (0, 6, False), (2, 6, False), (2, 6, True)])
def test_resume_gives_the_batches_of_the_uninterrupted_stream(tmp_path, workers, buffer, resampled):
    """Stopped after a batch of the first 2 epochs (every other one; with 2 workers: a few) and resumed
    from its saved position, the stream gives exactly the batches of one never stopped, and counts the
    same broken samples and shards; the positions cover a shard left half-read, a full shuffle
    buffer and a worker in its second pass over its shards (resampled: none ends)."""
    make = _cases(tmp_path, workers=workers, shuffle_buffer=buffer, resampled=resampled)
    full = make()
    iterator = iter(full)
    reference, broken = [], []
    for _ in range(30):
        reference.append(next(iterator))
        broken.append(full.position.broken)
    iterator.close()
    assert broken[-1] > 0
    cuts = range(1, 29, 2) if workers == 0 else (3, 9, 14, 22)
    seen = set()
    for cut in cuts:
        first = make()
        iterator = iter(first)
        for _ in range(cut):
            next(iterator)
        iterator.close()
        state = _saved(first)
        for worker in state["workers"].values():
            reading = worker["readings"][0]
            seen.add("inside a shard" if reading["offset"] else "shard start")
            seen.add("full buffer" if buffer and len(worker["buffer"]) == buffer - 1 else "no buffer")
            seen.add("another pass" if reading["passes"] else "first pass")
        resumed = make()
        resumed.load_state_dict(state)
        iterator = iter(resumed)
        for j in range(cut, 30):
            images, texts = next(iterator)
            assert torch.equal(images, reference[j][0]) and torch.equal(texts, reference[j][1]), (cut, j)
            assert resumed.position.broken == broken[j], (cut, j)
        iterator.close()
    assert {"inside a shard", "first pass" if resampled else "another pass",
            "full buffer" if buffer else "no buffer"} <= seen, seen


def test_resume_reads_only_the_shards_it_needs(tmp_path, monkeypatch):
    """Resumed deep into an epoch (the 40th of 50 batches, in the 9th of 10 shards), the stream reads the
    bytes of the samples its shuffle buffer holds and of those it goes on with, and nothing else: the
    current shard's samples before its offset and those before a buffered one are found from the tar
    headers alone, and no other shard is opened (a replay would read every shard from the epoch's start)."""
    urls = write_shards(tmp_path, [20] * 10)
    make = lambda: _stream(urls, batch=4, samples=200, shuffle_buffer=8)  # noqa: E731
    first = make()
    iterator = iter(first)
    for _ in range(40):
        next(iterator)
    iterator.close()
    state = _saved(first)

    read = []
    samples = data_module.shard_samples

    def counting(url, handler, wanted=None):
        for sample in samples(url, handler, wanted):
            if len(sample) > 2:  # its files' bytes were read, not only its key
                read.append((url, sample["__key__"]))
            yield sample

    monkeypatch.setattr(data_module, "shard_samples", counting)
    resumed = make()
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    next(iterator)
    iterator.close()
    worker = state["workers"][0]
    reading = worker["readings"][0]
    assert reading["offset"] > 0 and len(worker["buffer"]) > 0
    assert len(read) == len(worker["buffer"]) + 4, len(read)  # 160 samples lie before; the batch takes 4 new
    needed = {index for index, _ in worker["buffer"]} | {int(reading["cursor"])}
    assert {url for url, _ in read} <= {resumed.stream.urls[i] for i in needed} | {resumed.stream.urls[reading["cursor"] + 1]}


def test_an_old_position_is_a_clear_error(tmp_path):
    """A checkpoint's data position from the version that replayed (samples emitted per worker)."""
    batches = _stream(write_shards(tmp_path, [10, 10]), batch=4)
    with pytest.raises(CheckpointError, match="older version"):
        batches.load_state_dict({"epoch": 0, "emitted": {0: 12}, "next_worker": 1, "broken": 0})


def test_validate_wants_a_shard_for_every_worker(cli, tiny_job, tmp_path):
    """8 shards for 2 ranks: 4 workers each can have their own, 5 cannot (unless shards are drawn with
    replacement); an epoch must hold a micro batch for every rank."""
    def validate(**data):
        job = dict(tiny_job, data={**tiny_job["data"], **data})
        return cli.validate_json(write_job(tmp_path, job), "--no-check-paths")

    assert validate(workers=4)[0] == 0
    code, out = validate(workers=5)
    assert code == 2 and out["errors"][0]["location"] == "data.urls"
    assert "8 shards for 2 ranks × 5 workers" in out["errors"][0]["message"]
    assert "shards must be ≥ world size × data.workers" in out["errors"][0]["message"]
    assert "≥ 10 shards" in out["errors"][0]["hint"]
    assert validate(workers=5, resampled=True)[0] == 0
    code, out = validate(samples=31)
    assert code == 2 and out["errors"][0]["location"] == "data.samples"
    assert "fewer samples than one micro batch on every rank" in out["errors"][0]["message"]


def test_auto_workers_are_the_ranks_cores_less_one_and_no_more_than_its_shards():
    """data.workers 'auto': a rank's share of the cores less one for itself (at least 1), capped by the shards each
    rank has of its smallest source unless shards are drawn with replacement; a number stays as written."""
    spec = WebDatasetSpec(urls="s-{000..063}.tar", samples=1000)
    assert spec.workers == "auto"
    assert spec.settled_workers(world_size=1, local_ranks=1, cores=16) == 15
    assert spec.settled_workers(world_size=8, local_ranks=8, cores=128) == 8  # 64 shards: 8 a rank
    assert spec.settled_workers(world_size=2, local_ranks=2, cores=2) == 1
    assert spec.model_copy(update={"resampled": True}).settled_workers(8, 8, 128) == 15
    mixture = WebDatasetSpec(sources=[{"urls": "a-{0..99}.tar", "samples": 10}, {"urls": "b-{0..5}.tar",
                                                                                  "samples": 10}])
    assert mixture.settled_workers(world_size=2, local_ranks=2, cores=64) == 3  # b: 6 shards over 2 ranks
    assert WebDatasetSpec(urls="s.tar", samples=10, workers=6).settled_workers(1, 1, 2) == 6


def test_auto_workers_resume_with_the_count_the_checkpoint_was_saved_with(tmp_path):
    """A run whose 'auto' settles another count on the node it resumes on (other cores) keeps the count its data
    position was saved with, so the stream carries on exactly as the uninterrupted one; a number written in the
    spec is applied as written (its change restarts the epoch, as `jobspec.resume` says)."""
    urls = write_shards(tmp_path, [9, 12, 7, 11])
    with closing(iter(_stream(urls, batch=4, workers=2, samples=39, shuffle_buffer=5))) as reference:
        want = [next(reference)[0] for _ in range(12)]
    first = _stream(urls, batch=4, workers=2, samples=39, shuffle_buffer=5)
    with closing(iter(first)) as iterator:
        head = [next(iterator)[0] for _ in range(5)]
    saved = _saved(first)
    assert saved["worker_count"] == 2
    stream = _stream(urls, batch=4, workers=3, samples=39, shuffle_buffer=5).stream
    resumed = WebDatasetBatches(stream, 3, pin_memory=False, settled=True)
    resumed.load_state_dict(saved)
    assert resumed.workers == 2
    with closing(iter(resumed)) as iterator:
        tail = [next(iterator)[0] for _ in range(7)]
    assert all(torch.equal(got, expected) for got, expected in zip(head + tail, want))
    written = WebDatasetBatches(stream, 3, pin_memory=False)
    written.load_state_dict(saved)
    assert written.workers == 3
    # A position saved before 'auto' (no count of its own) goes on with the count its spec wrote.
    from fsdpclip.data.batches import with_worker_count
    from fsdpclip.jobspec.resume import Change, keeps_data_position

    old = {key: value for key, value in saved.items() if key != "worker_count"}
    assert with_worker_count(old, {"data": {"workers": 2}})["worker_count"] == 2
    assert with_worker_count({"streams": {"0": old}}, {"data": {"workers": 2}})["streams"]["0"]["worker_count"] == 2
    assert keeps_data_position([Change("data.workers", 4, "auto")])
    assert not keeps_data_position([Change("data.workers", 4, 2)])
    hosted = WebDatasetBatches(stream, 3, pin_memory=False, settled=True)
    hosted.load_state_dict(with_worker_count(old, {"data": {"workers": 2}}))
    assert hosted.workers == 2


# ------------------------------------------------------------------- mixtures
MIXTURE = {"a": ([20, 20, 20, 20], 5.0), "b": ([15, 15, 15, 15], 3.0), "c": ([8, 8, 8, 8], 2.0)}  # shards, weight


def write_mixture(tmp_path, broken: dict[int, str] | None = None) -> tuple[list[dict], dict[int, str]]:
    """MIXTURE's sources as `data.sources` (each in its own directory, its samples numbered on from the
    last source's), and the source of every sample index."""
    sources, source_of, first = [], {}, 0
    for name, (sizes, weight) in MIXTURE.items():
        (tmp_path / name).mkdir()
        urls = write_shards(tmp_path / name, sizes, broken=broken, first=first)
        sources.append({"name": name, "urls": urls, "weight": weight})
        source_of.update({index: name for index in range(first, first + sum(sizes))})
        first += sum(sizes)
    return sources, source_of


def test_a_mixture_draws_its_sources_by_their_weights(tmp_path):
    """10,000 samples of three sources weighted 5:3:2, of 80, 60 and 32 samples: each source's share
    of the samples given out lies within 2% of its weight's (not of its size's), as counted from the
    captions and as the stream counts them for metrics.jsonl; every source was read again and again.
    (Images are not decoded: the captions say all.)"""
    sources, source_of = write_mixture(tmp_path)
    batches = _stream(None, batch=50, samples=10_000, shuffle_buffer=20, sources=sources, tokenize=index_tokens)
    batches.stream._decode = lambda sample, seed: (torch.zeros(1), sample["txt"].decode())
    with closing(iter(batches)) as iterator:
        drawn = Counter(source_of[index] for _ in range(200) for index in next(iterator)[1][:, 0].tolist())
    assert sum(drawn.values()) == 10_000
    total = sum(weight for _, weight in MIXTURE.values())
    for name, (_, weight) in MIXTURE.items():
        assert abs(drawn[name] / 10_000 - weight / total) < 0.02, (name, drawn)
    assert batches.source_samples == dict(drawn)
    assert all(reading.passes > 5 for reading in batches.position.workers[0].readings)


@pytest.mark.parametrize("resampled", [False, True])
def test_a_resumed_mixture_continues_its_stream(tmp_path, resampled):
    """A mixture on rank 1 of 2 with 2 data workers, broken samples in every source, stopped late in its
    first epoch (15 batches) and resumed from its saved position: into the second epoch, the batches,
    broken samples and per-source counts of a stream never stopped."""
    sources, _ = write_mixture(tmp_path, broken={5: "image", 90: "caption", 150: "image"})
    make = lambda: _stream(None, batch=4, workers=2, rank=1, world_size=2, samples=120,  # noqa: E731
                           shuffle_buffer=6, sources=sources, resampled=resampled, tokenize=index_tokens)
    full = make()
    with closing(iter(full)) as iterator:
        reference = [(*next(iterator), full.position.broken, full.source_samples) for _ in range(24)]
    assert reference[-1][2] > 0 and all(reference[-1][3].values())
    first = make()
    with closing(iter(first)) as iterator:
        for _ in range(12):
            next(iterator)
    resumed = make()
    resumed.load_state_dict(_saved(first))
    with closing(iter(resumed)) as iterator:  # no worker outlives a failed assertion
        for j in range(12, 24):
            images, texts = next(iterator)
            assert torch.equal(images, reference[j][0]) and torch.equal(texts, reference[j][1]), j
            assert (resumed.position.broken, resumed.source_samples) == reference[j][2:], j


def test_a_position_saved_before_mixtures_resumes(tmp_path):
    """A checkpoint's position from before mixtures (a worker's one reading in its own fields, no
    per-source counts) continues the stream as the position of today does."""
    urls = write_shards(tmp_path, [9, 12, 7, 11])
    make = lambda: _stream(urls, batch=4, samples=39, shuffle_buffer=5)  # noqa: E731
    with closing(iter(make())) as iterator:
        reference = [next(iterator)[0] for _ in range(8)]
    first = make()
    with closing(iter(first)) as iterator:
        for _ in range(3):
            next(iterator)
    state = _saved(first)
    del state["sources"]
    for worker in state["workers"].values():
        worker.update(worker.pop("readings")[0])
        del worker["mixer"]
    resumed = make()
    resumed.load_state_dict(state)
    with closing(iter(resumed)) as iterator:
        assert all(torch.equal(next(iterator)[0], want) for want in reference[3:])


def test_validate_checks_each_source(cli, tiny_job, tmp_path, digits_dir):
    """`sources` instead of `urls`, not with them; `samples` from the sources' where each gives its own;
    each source's URLs checked and located (here: a missing one, too few shards for the workers), names
    given once; the summary names each source with its share, shards and passes an epoch."""
    shards = str(digits_dir / "train-{000000..000007}.tar")

    def validate(*sources, **data):
        data = {"sources": list(sources), "samples": 1438, "workers": 1, **data}
        return cli.validate_json(write_job(tmp_path, dict(tiny_job, data=data)))

    code, out = validate({"urls": shards, "weight": 3, "samples": 1000, "name": "digits"},
                         {"urls": str(digits_dir / "train-00000{0,1}.tar"), "samples": 350}, samples=None,
                         resampled=True, workers=4)
    assert code == 0, out["errors"]
    assert out["summary"]["data"] == ("2 sources mixed by weight: 'digits' 75.0% (8 shards, 1 passes an "
                                      "epoch), '1' 25.0% (2 shards, 0.96 passes an epoch)")
    code, out = validate({"urls": shards}, urls=shards)
    assert code == 2 and out["errors"][0]["location"] == "data" and "exactly one of `urls`" in out["errors"][0]["message"]
    code, out = validate({"urls": shards, "samples": 10}, {"urls": shards}, samples=None)
    assert code == 2 and out["errors"][0]["location"] == "data" and "`samples` is missing" in out["errors"][0]["message"]
    code, out = validate({"urls": shards, "name": "x"}, {"urls": str(tmp_path / "none-{0..3}.tar")},
                         {"urls": str(digits_dir / "train-00000{0,1}.tar"), "name": "x"}, workers=2)
    assert [(e["location"], e["message"]) for e in out["errors"]] == [
        ("data.sources[1].urls", "4 of 4 shards not found"),
        ("data.sources[2].urls", "2 shards for 2 ranks × 2 workers: some workers would get none (shards must be ≥ "
                                 "world size × data.workers, as OpenCLIP requires)"),
        ("data.sources[2].name", "a second source named 'x'")], out["errors"]


def _two_rank_job(tmp_path, name: str, data: dict, schedule: dict, per_gpu: int, every_steps: int) -> dict:
    """A tiny fp32 job of webdataset `data` on 2 CPU ranks, run in `tmp_path`/runs."""
    return {
        "run": {"name": name, "output_dir": str(tmp_path / "runs")},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32"},
        "schedule": schedule,
        "data": data,
        "batch": {"per_gpu": per_gpu},
        "logging": {"every_steps": every_steps},
        "launch": {"gpus_per_node": 2, "device": "cpu", "collective_timeout_s": 60},
    }


def _step_records(run_dir) -> list[dict]:
    """metrics.jsonl's step records (not the checkpoints')."""
    return [record for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in (record := json.loads(line))]


@pytest.mark.slow
def test_a_mixture_logs_its_samples_by_source(tmp_path, digits_dir):
    """A mixture of two halves of the digits shards, 3:1, trained on 2 CPU ranks: metrics.jsonl counts
    each source's samples over all ranks, together the samples seen."""
    data = {"sources": [{"urls": str(digits_dir / "train-{000000..000003}.tar"), "weight": 3, "name": "a"},
                        {"urls": str(digits_dir / "train-{000004..000007}.tar"), "name": "b"}],
            "samples": 1438, "workers": 1, "shuffle_buffer": 10}
    job = _two_rank_job(tmp_path, "mixed", data, {"steps": 6}, per_gpu=16, every_steps=3)
    proc = run_group([sys.executable, "-m", "fsdpclip", "launch", str(write_job(tmp_path, job))], timeout=240)
    assert proc.returncode == 0, proc.stdout[-5000:]
    records = _step_records(tmp_path / "runs" / "mixed")
    assert [r["step"] for r in records] == [3, 6]
    for record in records:
        assert set(record["source_samples"]) == {"a", "b"}
        assert sum(record["source_samples"].values()) == record["samples_seen"] == record["step"] * 32
    assert records[-1]["source_samples"]["a"] > records[-1]["source_samples"]["b"] > 0


@pytest.mark.slow
def test_sample_counts_go_on_after_a_resume_on_another_world_size(tmp_path):
    """A 2-rank mixture run of 3 steps (global batch 32), a broken sample at the start of every shard, lengthened
    to 6 steps on one rank: once going on with both ranks' data streams (grad_accum 2), once with per_gpu 32 (the
    data stream restarts its epoch). Either way metrics.jsonl's `source_samples` count on from the checkpoint's
    (together the samples seen) and `broken_samples` is the checkpoint's plus those the streams counted since."""
    for name, first in (("a", 0), ("b", 64)):
        (tmp_path / name).mkdir()
        urls = write_shards(tmp_path / name, [16] * 4, broken={first + 16 * shard: "image" for shard in range(4)},
                            first=first)
    data = {"sources": [{"urls": urls.replace("/b/", "/a/"), "weight": 3, "name": "a"}, {"urls": urls, "name": "b"}],
            "samples": 128, "workers": 1, "shuffle_buffer": 4}
    job = _two_rank_job(tmp_path, "mixed", data, {"kind": "constant", "steps": 3}, per_gpu=16, every_steps=3)
    path = write_job(tmp_path, job)
    first = run_group([sys.executable, "-m", "fsdpclip", "launch", str(path)], timeout=240)
    assert first.returncode == 0, first.stdout[-5000:]
    shutil.copytree(tmp_path / "runs", tmp_path / "restarted")
    for runs, extra in (("runs", ()), ("restarted", ("--set", "batch.per_gpu=32"))):
        proc = run_group([sys.executable, "-m", "fsdpclip", "launch", str(path), "--nproc-per-node", "1", "--set",
                          "schedule.steps=6", "--set", f"run.output_dir={tmp_path / runs}", *extra], timeout=240)
        assert proc.returncode == 0, proc.stdout[-5000:]
        assert ("the data stream restarts" in proc.stdout) == bool(extra), proc.stdout[-5000:]
        run_dir = tmp_path / runs / "mixed"
        records = _step_records(run_dir)
        assert [r["step"] for r in records] == [3, 6], runs
        assert sum(records[-1]["source_samples"].values()) == records[-1]["samples_seen"] == 6 * 32, runs
        data = torch.load(run_dir / "checkpoints" / "step-00000006" / "rank-00000.pt", weights_only=False)["data"]
        counted = sum(p["broken"] for p in data["streams"].values()) if "streams" in data else data["broken"]
        assert records[0]["broken_samples"] >= 1 and counted >= 1
        assert records[-1]["broken_samples"] == counted + (records[0]["broken_samples"] if extra else 0), runs


@pytest.mark.slow
def test_uneven_shards_several_epochs_on_two_ranks(tmp_path):
    """Shards of 3, 60, 5 and 40 samples over 2 ranks, 108 samples an epoch, 4 per rank and step: both
    ranks run 13 steps an epoch, 39 in 3 epochs, the one whose shards hold fewer than its 52 samples
    an epoch reading them again; the broken sample is skipped and counted each time a rank reads it,
    and the logged total is the sum of the ranks' counts."""
    urls = write_shards(tmp_path, [3, 60, 5, 40], broken={70: "image"})
    data = {"urls": urls, "samples": 108, "workers": 1, "shuffle_buffer": 10}
    path = write_job(tmp_path, _two_rank_job(tmp_path, "uneven", data, {"epochs": 3}, per_gpu=4, every_steps=5))
    proc = run_group([sys.executable, "-m", "fsdpclip", "launch", str(path)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-5000:]
    records = _step_records(tmp_path / "runs" / "uneven")
    steps = 3 * (108 // 8)  # 3 epochs of 13 micro batches on each rank, 1 per step
    assert records[-1]["step"] == steps
    final = tmp_path / "runs" / "uneven" / "checkpoints" / f"step-{steps:08d}"
    positions = [torch.load(final / f"rank-{rank:05d}.pt", weights_only=False)["data"] for rank in (0, 1)]
    assert all((p["epoch"], p["batches"]) == (2, 13) for p in positions), positions
    assert any(p["workers"][0]["readings"][0]["passes"] >= 1 for p in positions), positions  # its shards hold < 52 samples
    assert records[-1]["broken_samples"] == sum(p["broken"] for p in positions) >= 1
