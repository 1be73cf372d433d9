"""Checkpoints in object storage (checkpoint.remote) against an S3-compatible server on localhost (moto's)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from conftest import PREEMPTIBLE_STEPS, logged_losses, preemptible_job, write_job
from ranks import run_group, torchrun


@pytest.fixture
def s3(monkeypatch):
    """An S3-compatible server (moto's, on a thread of this process) holding an empty bucket 'runs': the
    remote_options that reach it. Credentials come from the environment, as they would on a cluster. Moto keeps
    its buckets in the process, for every server it starts: emptied when the test ends."""
    import logging
    import urllib.request

    import fsspec
    from moto.server import ThreadedMotoServer

    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"endpoint_url": f"http://{host}:{port}"}
    fsspec.filesystem("s3", **options).mkdir("runs")
    yield options
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    server.stop()


@pytest.mark.slow
def test_a_fresh_machine_resumes_from_the_remote_copy(tmp_path, digits_dir, straight_losses, s3):
    """Checkpoints every 8 steps uploaded to s3://runs/remote. Rank 0 killed in its second upload (step 16's
    data files there, not its meta.json): the remote `latest` stays step 8, whose copy is complete. A launch
    into an empty run directory downloads step 8, says so, and trains on with the losses of a run never
    stopped; its exit 0 comes after its last checkpoint is uploaded, and `keep` 2 holds remotely: step 8 and
    the half upload of step 16 are gone."""
    from fsdpclip.checkpoint.remote import RemoteFolder

    url = "s3://runs/remote"
    job = preemptible_job(tmp_path / "first", digits_dir, "remote")
    job["checkpoint"] = {"every_steps": 8, "keep": 2, "remote": url, "remote_options": s3}
    first = torchrun(["tests/workers/faults.py", str(write_job(tmp_path, job)), "die-upload:2"], timeout=300)
    folder = RemoteFolder(url, s3)
    assert first.returncode != 0 and folder.latest() == "step-00000008", first.stdout[-4000:]
    assert folder.names() == ["step-00000008", "step-00000016"] and not folder.is_complete("step-00000016")

    job["run"]["output_dir"] = str(tmp_path / "fresh")
    second = run_group([sys.executable, "-m", "fsdpclip", "launch", str(write_job(tmp_path, job, "fresh.json"))],
                       timeout=300)
    assert second.returncode == 0, second.stdout[-4000:]
    assert f"downloading {url}/step-00000008" in second.stdout and "resumed from" in second.stdout
    losses = logged_losses(tmp_path / "fresh" / "remote")
    assert sorted(losses) == list(range(9, PREEMPTIBLE_STEPS + 1))
    for step, loss in losses.items():
        assert loss == pytest.approx(straight_losses[step], abs=1e-5), step
    assert folder.latest() == "step-00000024"
    assert folder.names() == ["step-00000016", "step-00000024"] and folder.is_complete("step-00000016")


def test_remote_storage_is_reached_only_when_asked(tmp_path, tiny_job, cli, monkeypatch):
    """`validate` checks checkpoint.remote's form and that its fsspec package is installed, without the network;
    `--check-remote` reaches it: an endpoint nobody listens on is one error, located."""
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tiny_job["checkpoint"] = {"remote": "s3://runs/t", "remote_options": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    path = write_job(tmp_path, tiny_job)
    code, out = cli.validate_json(path)
    assert code == 0, out
    code, out = cli.validate_json(path, "--check-remote")
    assert code == 2 and [e["location"] for e in out["errors"]] == ["checkpoint.remote"], out
    assert "cannot be listed" in out["errors"][0]["message"]

    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as where gcsfs is not installed
    for remote, message in (("runs/t", "must be a URL"), ("gs://runs/t", "needs the 'gcsfs' package")):
        tiny_job["checkpoint"] = {"remote": remote}
        code, out = cli.validate_json(write_job(tmp_path, tiny_job))
        assert code == 2 and [e["location"] for e in out["errors"]] == ["checkpoint.remote"], out
        assert message in out["errors"][0]["message"], out


def test_remote_urls_that_cannot_hold_a_run_are_refused(tmp_path, tiny_job, cli, monkeypatch):
    """`validate` refuses, each with one located error: memory:// (its files die with the process that wrote them),
    hdfs:// where pyarrow is missing (fsspec's class loads without it), and a key with a '..' or '.' folder or a
    NUL, in checkpoint.remote and in a resume URL."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as where pyarrow is not installed
    for checkpoint, message in (({"remote": "memory://runs/t"}, "memory:// keeps its files in the memory"),
                                ({"remote": "hdfs://namenode/runs/t"}, "needs the 'pyarrow' package for hdfs://"),
                                ({"remote": "s3://runs/../t"}, "has a '.' or '..' folder in its key"),
                                ({"resume": "s3://runs/t/step-00000008/.."}, "has a '.' or '..' folder in its key"),
                                ({"remote": "s3://runs/./t"}, "has a '.' or '..' folder in its key"),
                                ({"remote": "s3://runs/t\u0000x"}, "contains the control character '\\x00'"),
                                ({"resume": "s3://runs/t\u0000"}, "contains the control character '\\x00'")):
        tiny_job["checkpoint"] = checkpoint
        code, out = cli.validate_json(write_job(tmp_path, tiny_job))
        location = f"checkpoint.{next(iter(checkpoint))}"
        assert code == 2 and [e["location"] for e in out["errors"]] == [location], (checkpoint, out)
        assert message in out["errors"][0]["message"], out


def test_uploads_one_at_a_time_only_the_newest_waits_and_failures_are_warnings(tmp_path, caplog):
    """While an upload runs, a completed checkpoint waits, and a newer one takes its place (the skipped one is said);
    every checkpoint not yet uploaded is spared locally; a failed upload is a warning that `wait` returns."""
    import logging
    import threading

    from fsdpclip.checkpoint.remote import Uploads

    caplog.set_level(logging.INFO, logger="fsdpclip.checkpoint.remote")

    class Folder:
        url = "s3://runs/t"

        def __init__(self):
            self.release, self.uploaded = threading.Event(), []

        def upload(self, checkpoint):
            self.release.wait(10)
            if checkpoint.name == "step-4":
                raise OSError("the endpoint went away")
            self.uploaded.append(checkpoint.name)

        def prune(self, keep):
            return []

    folder = Folder()
    uploads = Uploads(folder, keep=2)
    names = [tmp_path / f"step-{step}" for step in (1, 2, 3)]
    for checkpoint in names:
        uploads.submit(checkpoint)
    assert uploads.uploading() == {names[0], names[2]} and "step-2 is not uploaded: step-3" in caplog.text
    folder.release.set()
    assert uploads.wait() is None and folder.uploaded == ["step-1", "step-3"] and uploads.uploading() == set()
    uploads.submit(tmp_path / "step-4")
    assert "step-4 was not uploaded to s3://runs/t: OSError: the endpoint went away" in uploads.wait()
    assert "the remote latest stays" in caplog.text
    uploads.close()


def test_a_remote_that_cannot_be_read_at_the_start_is_one_error(tmp_path):
    """A run that would resume from checkpoint.remote stops with one error naming it when the storage cannot be
    read, instead of starting fresh (its uploads would then replace the remote checkpoints)."""
    from fsdpclip.checkpoint.layout import CheckpointError
    from fsdpclip.checkpoint.remote import fetch_resume
    from fsdpclip.jobspec.job import CheckpointSpec

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spec = CheckpointSpec(remote="s3://runs/t", remote_options={"endpoint_url": f"http://127.0.0.1:{port}"})
    with pytest.raises(CheckpointError, match="cannot read s3://runs/t to resume from it: "):
        fetch_resume(tmp_path, spec)
    assert fetch_resume(tmp_path, CheckpointSpec()) == "latest"  # no remote: nothing read


def test_uploads_downloads_and_resume_urls(tmp_path, s3):
    """A checkpoint uploads whole (its hidden DCP metadata too) and `latest` names it; `prune` keeps the newest
    complete ones and drops incomplete ones; a resume URL, of a checkpoint or of a folder (its latest), is
    downloaded whole into RUN_DIR/downloads/; 'latest' downloads the remote copy into an empty run's checkpoints/
    and names it there, and leaves a run with a checkpoint as new alone; `--check-remote`'s probe leaves nothing."""
    from fsdpclip.checkpoint.layout import latest_checkpoint
    from fsdpclip.checkpoint.remote import RemoteFolder, fetch_resume
    from fsdpclip.jobspec.job import CheckpointSpec

    url = "s3://runs/urls"
    folder = RemoteFolder(url, s3)
    for step in (4, 8, 12):
        local = tmp_path / "saved" / f"step-{step:08d}"
        local.mkdir(parents=True)
        for name, text in ((".metadata", "index"), ("__0_0.distcp", f"shard {step}"), ("meta.json", "{}")):
            (local / name).write_text(text)
        folder.upload(local)
    died = local.rename(local.with_name("step-00000016"))  # an upload that died: its data, no meta.json
    folder.put([died / "__0_0.distcp"], died)
    assert folder.latest() == "step-00000012" and len(folder.names()) == 4
    assert folder.prune(keep=2) == ["step-00000004", "step-00000016"] and folder.access_problem() is None
    assert folder.names() == ["step-00000008", "step-00000012"]

    for resume in (f"{url}/step-00000008", url):
        path = fetch_resume(tmp_path / "other", CheckpointSpec(resume=resume, remote_options=s3))
        step = resume.rsplit("-", 1)[1] if resume != url else "00000012"
        assert path == str(tmp_path / "other" / "downloads" / f"step-{step}")
        assert sorted(p.name for p in Path(path).iterdir()) == [".metadata", "__0_0.distcp", "meta.json"]
        assert (Path(path) / "__0_0.distcp").read_text() == f"shard {int(step)}"
    spec = CheckpointSpec(remote=url, remote_options=s3)
    assert fetch_resume(tmp_path / "fresh", spec) == "latest"
    assert latest_checkpoint(tmp_path / "fresh") == tmp_path / "fresh" / "checkpoints" / "step-00000012"
    newer = tmp_path / "ahead" / "checkpoints" / "step-00000020"
    newer.mkdir(parents=True)
    (newer / "meta.json").write_text("{}")
    fetch_resume(tmp_path / "ahead", spec)
    assert [p.name for p in (tmp_path / "ahead" / "checkpoints").iterdir()] == ["step-00000020"]


def _saved(tmp_path: Path, step: int) -> Path:
    """A local checkpoint's files (what `RemoteFolder.upload` reads), without a model."""
    local = tmp_path / "saved" / f"step-{step:08d}"
    local.mkdir(parents=True)
    for name, text in ((".metadata", "index"), ("__0_0.distcp", f"shard {step}"), ("meta.json", "{}")):
        (local / name).write_text(text)
    return local


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def _written_in(folder: Path, new: set[Path]) -> bool:
    """Whether every path of `new` is `folder`, in it, or one of the folders made to hold it."""
    return all(path == folder or folder in path.parents or path in folder.parents for path in new)


def test_a_remote_latest_is_followed_only_to_a_checkpoint_of_its_folder(tmp_path, s3, caplog):
    """Whoever can write the bucket sets `latest` to a local directory, to '../../../x' or to a checkpoint elsewhere
    in the bucket, with a complete checkpoint's objects at each: a resume ignores it (a warning names it), downloads
    the folder's own newest complete checkpoint and writes nothing outside the run's checkpoints/ (the local
    directory survives); a folder with no checkpoint of its own is said to hold none, and nothing is downloaded; a
    checkpoint holding a key that climbs out of it is refused before anything is written."""
    import logging

    import fsspec

    from fsdpclip.checkpoint.layout import CheckpointError, latest_checkpoint, resume_candidates
    from fsdpclip.checkpoint.remote import RemoteFolder, fetch_resume
    from fsdpclip.jobspec.job import CheckpointSpec

    caplog.set_level(logging.INFO, logger="fsdpclip.checkpoint.remote")
    fs = fsspec.filesystem("s3", **s3)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("kept")
    folder, bare = RemoteFolder("s3://runs/bait", s3), RemoteFolder("s3://runs/bare", s3)
    folder.upload(_saved(tmp_path, 8))
    for i, named in enumerate((str(victim), "../../../x", "elsewhere/step-00000012")):
        for remote in (folder, bare):
            fs.pipe_file(remote._path(named, "meta.json"), b"{}")
            fs.pipe_file(remote._path(named, "__0_0.distcp"), b"bait")
            fs.pipe_file(remote._path("latest"), f"{named}\n".encode())
        run_dir = tmp_path / "a" / "b" / f"run{i}"
        before = _files(tmp_path)
        assert fetch_resume(run_dir, CheckpointSpec(remote=folder.url, remote_options=s3)) == "latest"
        assert sorted(victim.iterdir()) == [victim / "precious"], named
        assert _written_in(run_dir / "checkpoints", _files(tmp_path) - before), named
        assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step-00000008"
        assert f"s3://runs/bait/latest names {named!r}, which is not one of its checkpoints" in caplog.text

        caplog.clear()
        before = _files(tmp_path)
        fetch_resume(tmp_path / f"empty{i}", CheckpointSpec(remote=bare.url, remote_options=s3))
        assert "s3://runs/bare holds no complete checkpoint to resume from" in caplog.text, caplog.text
        assert resume_candidates(tmp_path / f"empty{i}", "latest") == ([], [])
        assert _written_in(tmp_path / f"empty{i}" / "checkpoints", _files(tmp_path) - before), named

    climbing = _saved(tmp_path, 16)
    folder.upload(climbing)
    fs.pipe_file(folder._path(climbing.name, "..", "..", "..", "escape"), b"bait")
    with pytest.raises(CheckpointError, match="refusing to download '../../../escape' into "):
        fetch_resume(tmp_path / "climbed", CheckpointSpec(remote=folder.url, remote_options=s3))
    assert not (tmp_path / "escape").exists() and not (tmp_path / "climbed" / "checkpoints").exists()
