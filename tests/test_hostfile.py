"""`fsdpclip launch --hostfile`: the hostfile and its filters as DeepSpeed reads them, the ssh commands of a dry run,
and real launches over a throw-away sshd on this machine (cluster/local-sshd.sh, installed with apt-get when sshd
is missing; those tests skip only when it cannot be), whose two "hosts" are `localhost` and `127.0.0.1`."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    REPO, assert_same_losses, hangs_fail_after, logged_losses, preemptible_job, synthetic_job, write_job,
)
from ranks import finish_launch, start_launch
from fsdpclip.launch.hostfile import pick_hosts, read_hostfile
from fsdpclip.jobspec.backend import LaunchError
from fsdpclip.run.lock import process_alive, start_ticks

SSHD = REPO / "cluster" / "local-sshd.sh"


def _hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def test_hostfile_and_filters_as_deepspeed_reads_them(tmp_path):
    text = "# the cluster\nnode-a slots=4\n\nnode-b slots=4  # spare\nnode-c slots=2\n"
    hosts = read_hostfile(_hostfile(tmp_path, text))
    assert hosts == {"node-a": [0, 1, 2, 3], "node-b": [0, 1, 2, 3], "node-c": [0, 1]}
    assert pick_hosts(hosts, None, None) == hosts
    assert pick_hosts(hosts, "node-c@node-a:1,3", None) == {"node-a": [1, 3], "node-c": [0, 1]}  # the file's order
    assert pick_hosts(hosts, None, "node-b@node-c:0") == {"node-a": [0, 1, 2, 3], "node-c": [1]}
    assert pick_hosts(hosts, None, "node-c:0,1") == {"node-a": [0, 1, 2, 3], "node-b": [0, 1, 2, 3]}
    for include, exclude, message in [("node-a", "node-b", "not both"), ("node-d", None, "'node-d' is not in the "
                                                                                        "hostfile"),
                                      (None, "node-a:4", "node-a has slots 0 to 3"), ("node-a:x", None, "slot numbers"),
                                      (None, "node-a@node-b@node-c", "leaves no host")]:
        with pytest.raises(LaunchError, match=message):
            pick_hosts(hosts, include, exclude)
    for text, message in [("node-a 4\n", ":1: 'node-a 4' is not 'HOST slots=N'"), ("node-a slots=0\n", "at least 1"),
                          ("node-a slots=²\n", "'node-a slots=²' is not 'HOST slots=N'"),  # a digit int() refuses
                          ("node-a slots=99999999999999\n", "at most 1,048,576"),
                          ("a slots=1\na slots=2\n", ":2: a is in the hostfile twice"),
                          ("node-a slots=1\nNODE-A slots=1\n", ":2: NODE-A is in the hostfile twice (as node-a: host "
                                                                "names ignore case)"),
                          ("-oProxyCommand=touch${IFS}/tmp/x slots=1\n",
                           ":1: '-oProxyCommand=touch${IFS}/tmp/x' is not a host name"),
                          ("user@node-a slots=1\n", "'user@node-a' is not a host name or IPv4 address"),
                          ("[::1] slots=1\n", "an IPv6 address goes in ~/.ssh/config"), ("# none\n", "names no host")]:
        with pytest.raises(LaunchError, match=re.escape(message)):
            read_hostfile(_hostfile(tmp_path, text))
    assert read_hostfile(_hostfile(tmp_path, "10.0.0.1 slots=2\nnode_b.cluster slots=2\n")) == {
        "10.0.0.1": [0, 1], "node_b.cluster": [0, 1]}


def test_a_hostfile_that_is_no_text_file_is_refused(cli, tmp_path):
    """A FIFO as the hostfile waited forever for a writer, /dev/zero was read until the memory ran out: the hostfile
    is read as the job file is, a regular UTF-8 file of bounded size."""
    fifo = tmp_path / "hosts.fifo"
    os.mkfifo(fifo)
    for hostfile, why in ((fifo, "not a regular file but a FIFO"), ("/dev/zero", "not a regular file but a character "
                                                                                 "device")):
        with hangs_fail_after(20):
            result = cli("launch", _job(tmp_path), "--hostfile", hostfile, "--dry-run")
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        assert f"cannot read the hostfile {hostfile}: {why}" in result.output


def _job(tmp_path: Path, **launch) -> Path:
    return write_job(tmp_path, synthetic_job(tmp_path, "ssh", **launch))


def test_a_dry_run_prints_one_ssh_command_per_host(cli, tmp_path):
    """The hosts and slots the flags pick are the job's nodes and processes per node; each host's slots are its
    visible GPUs; node 0's host is the rendezvous; nothing is written."""
    hostfile = _hostfile(tmp_path, "node-a slots=4\nnode-b slots=4\nnode-c slots=4\n")
    path = _job(tmp_path, device="cuda", ssh_options=["-p", "2222"])
    result = cli("launch", path, "--hostfile", hostfile, "--include", "node-a:0,2@node-c:1,3", "--dry-run")
    assert result.exit_code == 0, result.output
    nodes = [shlex.split(line.split(": ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("node ")]
    assert [command[:8] for command in nodes] == [["ssh", "-T", "-o", "BatchMode=yes", "-p", "2222", "--", host]
                                                  for host in ("node-a", "node-c")]  # no host is read as an option
    run_dir = tmp_path / "runs" / "ssh"
    for rank, (command, gpus) in enumerate(zip(nodes, ("0,2", "1,3"))):
        remote = shlex.split(command[8])
        assert remote[:4] == ["cd", os.getcwd(), "&&", "exec"] and f"CUDA_VISIBLE_DEVICES={gpus}" in remote
        assert remote[-6:] == [sys.executable, "-m", "fsdpclip.launch.hostfile", str(run_dir / "job.json"), str(rank),
                               "node-a"]
    assert not (tmp_path / "runs").exists()
    picked = ["--include", "node-a:0,2@node-c:1,3"]
    for flags, message in [([*picked, "--set", "batch.global_batch=32"], "world size 4"),  # 2 hosts × 2 slots
                           ([*picked, "--nodes", "3"], "--nodes 3: there are 2 host(s) to run on"),
                           (["--exclude", "node-b:0"], "as many slots (processes) as the others: node-a 4, node-b 3"),
                           (["--node-rank", "1"], "no --node-rank or --master-addr")]:
        refused = cli("launch", path, "--hostfile", hostfile, "--dry-run", *flags)
        assert refused.exit_code == 2 and message in refused.output, refused.output
    refused = cli("launch", path, "--include", "node-a", "--dry-run")
    assert refused.exit_code == 2 and "add --hostfile FILE" in refused.output


def test_a_single_host_that_ssh_cannot_reach_is_named(cli, tmp_path):
    """The only host of a hostfile does not resolve: its ssh ends before any other node could see it fail, and the
    launch still ends with the line naming the host and ssh's reason (it said "the job was killed (exit status
    255)")."""
    hostfile = _hostfile(tmp_path, "no-such-host.invalid slots=1\n")
    with hangs_fail_after(120):
        result = cli("launch", _job(tmp_path), "--hostfile", hostfile)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    line = "ssh to no-such-host.invalid (node 0) failed: ssh: Could not resolve hostname no-such-host.invalid"
    assert f"✗ {line}" in result.output and "Traceback" not in result.output
    assert json.loads((tmp_path / "runs" / "ssh" / "exit.json").read_text())["message"].startswith(line)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ssh_options(tmp_path_factory):
    """A throw-away sshd on 127.0.0.1 (cluster/local-sshd.sh), stopped by its pid file afterwards: the ssh options
    that reach it."""
    installed = subprocess.run([str(SSHD), "install"], capture_output=True, text=True, timeout=600)
    if installed.returncode != 0:
        pytest.skip(f"sshd cannot be installed here: {installed.stderr.strip()}")
    directory = tmp_path_factory.mktemp("sshd")
    started = subprocess.run([str(SSHD), "start", str(directory), str(_free_port())], capture_output=True, text=True,
                             timeout=60)
    try:
        assert started.returncode == 0, f"sshd did not start: {started.stderr}"
        yield started.stdout.split()
    finally:
        subprocess.run([str(SSHD), "stop", str(directory)], capture_output=True, timeout=60)


def _launch(path: Path, hostfile: Path, log: Path) -> subprocess.Popen:
    return start_launch(path, log, "--hostfile", str(hostfile))


def _finish(process: subprocess.Popen, log: Path, timeout: float = 240) -> tuple[int, str]:
    return finish_launch(process, log, timeout)


def _run_processes(run_dir: Path) -> dict[int, int]:
    """The run's processes on this machine, by pid and start ticks: every node's launcher, torchrun, the ranks and
    their data workers name RUN_DIR/job.json on their command line (forks keep their parent's)."""
    needle, found = str(run_dir / "job.json").encode(), {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                found[int(entry)] = start_ticks(int(entry))
        except OSError:
            continue
    return {pid: ticks for pid, ticks in found.items() if ticks is not None}


def _none_left(processes: dict[int, int], grace: float = 15) -> None:
    deadline = time.monotonic() + grace
    while running := [pid for pid, ticks in processes.items() if process_alive(pid, ticks)]:
        assert time.monotonic() < deadline, f"processes of the run outlived it: {running}"
        time.sleep(0.2)


@pytest.mark.slow
def test_two_hosts_over_ssh_stop_on_sigterm_and_resume_with_the_local_losses(ssh_options, tmp_path, digits_dir,
                                                                              straight_losses):
    """2 hosts × 1 slot, 2 data workers per rank: SIGTERM to the launcher's process group mid-run reaches every
    node's launcher over its ssh connection; every rank checkpoints, the launch exits 75 and leaves no process of
    the run; each node's output is in RUN_DIR/logs/node-R.log (node 0's on the console too). Launched again, the
    run resumes and ends with the losses of the same job run straight through by 2 local ranks."""
    job = preemptible_job(tmp_path / "runs", digits_dir, "ssh", master_port=_free_port(), ssh_options=ssh_options)
    path, hostfile = write_job(tmp_path, job), _hostfile(tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n")
    run_dir, log = tmp_path / "runs" / "ssh", tmp_path / "first.log"
    process = _launch(path, hostfile, log)
    deadline = time.monotonic() + 180
    while not ((run_dir / "metrics.jsonl").is_file() and max(logged_losses(run_dir), default=0) >= 2):
        assert process.poll() is None and time.monotonic() < deadline, f"no step 2:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)
    processes = _run_processes(run_dir)
    assert len(processes) >= 10, processes  # 2 × (node launcher, torchrun, rank, 2 data workers)
    os.killpg(process.pid, signal.SIGTERM)
    code, output = _finish(process, log)
    assert code == 75, output[-4000:]
    report = json.loads((run_dir / "exit.json").read_text())
    assert report["code"] == 75 and f"a stop was requested: stopped after step {report['step']}" in output
    assert "Traceback" not in output and f"resume: fsdpclip launch {path} --hostfile {hostfile}" in output
    _none_left(processes)
    node_logs = [(run_dir / "logs" / f"node-{rank}.log").read_text() for rank in (0, 1)]
    assert "--nnodes=2 --node-rank=1 --master-addr=localhost" in node_logs[1]
    assert "Traceback" not in node_logs[0]  # the stop is said once, by the launch (above)
    code, output = _finish(_launch(path, hostfile, tmp_path / "again.log"), tmp_path / "again.log")
    assert code == 0 and f"step-{report['step']:08d}" in output, output[-4000:]
    assert_same_losses(run_dir, straight_losses)


@pytest.mark.slow
def test_a_host_that_cannot_be_reached_is_named_and_nothing_is_left(ssh_options, tmp_path):
    """A host that does not resolve ends the launch at once: one line naming it and ssh's reason, exit 1, and the
    node started on the other host stopped (no process of the run is left)."""
    path = _job(tmp_path, master_port=_free_port(), ssh_options=ssh_options)
    hostfile = _hostfile(tmp_path, "localhost slots=2\nno-such-host.invalid slots=2\n")
    log = tmp_path / "launch.log"
    code, output = _finish(_launch(path, hostfile, log), log, timeout=120)
    assert code == 1, output[-4000:]
    line = "ssh to no-such-host.invalid (node 1) failed: ssh: Could not resolve hostname no-such-host.invalid"
    assert f"✗ {line}" in output and "Traceback" not in output
    run_dir = tmp_path / "runs" / "ssh"
    assert json.loads((run_dir / "exit.json").read_text())["message"].startswith(line)
    _none_left(_run_processes(run_dir))


def test_a_node_launcher_ends_only_once_its_kill_of_the_ranks_has(monkeypatch):
    """KILL kills torchrun and everything under it on the line's thread; torchrun's end ends `supervise` on the main
    thread at once, which then asks whether it was killed: the answer waits for the kill of the rest."""
    import threading

    from fsdpclip.launch import hostfile

    lines = hostfile.LauncherLines.__new__(hostfile.LauncherLines)  # without its thread on this process's stdin
    lines.guard, lines.torchrun, lines.forking, lines.killed, lines.pending = threading.Lock(), 4321, True, False, []
    killing, killed = threading.Event(), threading.Event()

    def kill_tree(pid: int) -> list[int]:
        killing.set()
        time.sleep(0.3)  # the ranks and data workers under torchrun ending
        killed.set()
        return []

    monkeypatch.setattr(hostfile, "kill_tree", kill_tree)
    follower = threading.Thread(target=lines._line, args=(hostfile.KILL,))
    follower.start()
    assert killing.wait(10)
    assert lines.kill_ended() and killed.is_set()
    follower.join(10)
