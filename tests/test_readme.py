"""README.md's commands run as written (after a short demo run), and the docs keep their limits.

Every line of the README's `sh` blocks is an `fsdpclip` command that runs here, in order, in a directory
laid out as the repository after `make demo` (examples/, data/digits, then runs/tiny-cpu from the README's
own launch, shortened to 20 steps), or a line that ends with a marker this machine cannot honour:
`# [setup]` (make, shell), `# [gpu]`, `# [slurm]`, `# [yours]` (files of your own: ImageNet, an
open_clip_train checkpoint), `# [hub]` (downloads). JSON blocks are specs that `validate` accepts.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, Cli
from ranks import run_group

README = REPO / "README.md"
MARKERS = {"setup", "gpu", "slurm", "yours", "hub"}
MARKER = re.compile(r"#\s*\[(\w+)\]")
DEMO_STEPS = 20


def blocks(language: str) -> list[tuple[int, str]]:
    """(line number, line) of every non-empty line in the README's ```language blocks."""
    found, inside = [], False
    for number, line in enumerate(README.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside = not inside and line.strip() == f"```{language}"
        elif inside and line.strip():
            found.append((number, line))
    return found


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, digits_dir):
    """The repository's layout after `make demo`: its examples (the demo's spec shortened) and the digits."""
    root = tmp_path_factory.mktemp("readme")
    (root / "examples").mkdir()
    for entry in (REPO / "examples").iterdir():
        (root / "examples" / entry.name).symlink_to(entry)
    demo = json.loads((REPO / "examples" / "tiny-cpu.json").read_text())
    demo["schedule"] = {"kind": "cosine", "warmup_steps": 5, "steps": DEMO_STEPS}
    demo["checkpoint"] = {"every_steps": 10, "keep": 2}
    demo["eval"]["every_steps"] = None
    demo["launch"]["collective_timeout_s"] = 60
    (root / "examples" / "tiny-cpu.json").unlink()
    (root / "examples" / "tiny-cpu.json").write_text(json.dumps(demo))
    (root / "data").mkdir()
    (root / "data" / "digits").symlink_to(digits_dir)
    return root


@pytest.mark.slow
def test_every_readme_command_runs(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    cli, ran = Cli(), []
    for number, line in blocks("sh"):
        marker = MARKER.search(line)
        if marker:
            assert marker.group(1) in MARKERS, f"README.md:{number}: unknown marker [{marker.group(1)}]"
            continue
        args = shlex.split(line, comments=True)
        assert args[0] == "fsdpclip", f"README.md:{number}: not an fsdpclip command; mark it: {line}"
        if args[1] == "launch" and "--dry-run" not in args:  # the ranks are processes: as a user starts them
            proc = run_group([sys.executable, "-m", "fsdpclip", *args[1:]], timeout=300, cwd=workdir)
            code, output = proc.returncode, proc.stdout
        else:
            result = cli(*args[1:])
            code, output = result.exit_code, result.output
        assert code == 0, f"README.md:{number}: `{line.strip()}` exited {code}:\n{output[-3000:]}"
        ran.append(args[1])
    assert {"validate", "plan", "launch", "report", "eval", "export"} <= set(ran)
    assert (workdir / "runs" / "tiny-cpu" / "checkpoints" / f"step-{DEMO_STEPS:08d}").is_dir()


def test_the_readme_specs_validate(tmp_path):
    cli = Cli()
    specs = "\n".join(line for _, line in blocks("json"))
    path = tmp_path / "job.json"
    path.write_text(specs)
    result = cli("validate", path, "--no-check-paths", "--world-size", "8")
    assert result.exit_code == 0, result.output


def test_make_clean_keeps_the_venv_and_distclean_says_it_removes_it():
    """`make clean` (the README's) removes the demo's data and runs only; `make distclean` the .venv too, saying so."""
    def planned(target: str) -> str:  # as a shell runs it, not under the make that may run the tests
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
        return subprocess.run(["make", "-n", target], cwd=REPO, env=env, capture_output=True, text=True,
                              check=True).stdout

    assert planned("clean").splitlines() == ["rm -rf data/digits runs"]
    assert planned("distclean").splitlines()[1:] == [
        'echo "== removing .venv, torch and the test extras with it, and .venv-floor"', "rm -rf .venv .venv-floor"]


def test_the_docs_keep_their_limits():
    limits = {"README.md": 200, "docs/benchmarks.md": 300, "docs/performance.md": 200}
    for name, most in limits.items():
        lines = len((REPO / name).read_text().splitlines())
        assert lines <= most, f"{name} has {lines} lines, more than {most}"
    for number, line in enumerate((REPO / "docs" / "performance.md").read_text().splitlines(), 1):
        long = [cell for cell in line.split("|") if len(cell.strip()) > 400]
        assert not long, f"docs/performance.md:{number}: a cell of {len(long[0].strip())} characters (at most 400)"


def test_the_repository_speaks_of_the_product_only():
    """No words about how the work was organised: numbered sessions or calls, machines lent."""
    words = re.compile(r"session [0-9]+|\bcall [0-9]+\b|this session|device session|\b(?:were|was) lent\b|\blent\b",
                       re.IGNORECASE)
    paths = [README, *[p for d in ("docs", "benchmarks", "fsdpclip", "tests") for p in (REPO / d).rglob("*")
                       if p.is_file() and p.suffix in (".md", ".py", ".json", ".jsonl", ".sh")]]
    found = [f"{path.relative_to(REPO)}:{number}: {match.group(0)!r}"
             for path in paths if path != REPO / "tests" / "test_readme.py"
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             for match in [words.search(line)] if match]
    assert not found, "\n".join(found[:20])
