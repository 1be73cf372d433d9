# Set-up and the entry points of the README: `make demo`, `make test`, `make test-fast` and `make test-floor`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The torch that lies on this project's machines; override with another build, e.g. a CPU-only one.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
DEMO_DATA ?= data/digits

.PHONY: venv demo lint test test-fast test-floor schema clean distclean

venv: $(VENV)/.demo-installed

# What the demo needs: torch, fsdpclip, scikit-learn (the digits) and matplotlib (report). The long step prints its progress.
$(VENV)/.demo-installed: pyproject.toml
	@echo "== [1/3] creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "== [2/3] installing $(TORCH_SPEC): the largest step (several GB with a CUDA build of torch)"
	$(BIN)/pip install $(TORCH_SPEC)
	@echo "== [3/3] installing fsdpclip with its demo extra"
	$(BIN)/pip install --quiet -e '.[demo]'
	touch $@

# What the tests need besides: the Hugging Face, TensorBoard, W&B and report extras, CLIP_benchmark, ruff, pyright and
# import-linter.
$(VENV)/.installed: $(VENV)/.demo-installed
	@echo "== installing the test extras (transformers, tensorboard, wandb, matplotlib, pytest, ruff, pyright, import-linter)"
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --quiet --no-deps clip_benchmark  # the reference the eval tests compare with
	touch $@

$(DEMO_DATA)/info.json: | venv
	@echo "== writing the digits data to $(DEMO_DATA)"
	$(BIN)/fsdpclip data digits $(DEMO_DATA)

# The main job: a tiny CLIP trained with FSDP on 2 CPU processes, then zero-shot on held-out digits.
demo: venv $(DEMO_DATA)/info.json
	$(BIN)/fsdpclip validate examples/tiny-cpu.json
	$(BIN)/fsdpclip launch examples/tiny-cpu.json
	$(BIN)/fsdpclip eval runs/tiny-cpu --zeroshot digits --data $(DEMO_DATA)/test --output runs/tiny-cpu/zeroshot-digits.json
	@echo "== done. To run fsdpclip yourself: source $(VENV)/bin/activate (or call $(BIN)/fsdpclip)"

# The static checks of the package: ruff, pyright (basic mode) and import-linter's contract of the layers
# (docs/architecture.md), all configured in pyproject.toml.
lint: $(VENV)/.installed
	$(BIN)/ruff check fsdpclip
	$(BIN)/pyright --pythonpath $(BIN)/python fsdpclip
	$(BIN)/lint-imports --no-cache

# The static checks, then the whole suite on pytest-xdist workers that each take whole test modules (a module's
# fixtures are built once). fsdpclip is byte-compiled first: where PYTHONDONTWRITEBYTECODE is set, every interpreter
# the suite starts (launchers, torchrun scripts, ranks started anew, CLI subprocesses) would compile the ~80
# fsdpclip modules it imports again (~0.25 CPU-seconds each on 2 cores).
TEST_WORKERS ?= 2
test: $(VENV)/.installed lint
	$(BIN)/python -m compileall -q fsdpclip
	$(BIN)/python -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadscope tests

# The inner loop: every test but those marked slow (training runs, processes that import torch).
test-fast: $(VENV)/.installed
	$(BIN)/python -m compileall -q fsdpclip
	$(BIN)/python -m pytest -q -m "not slow" tests

# The fast tier on the lowest versions pyproject.toml allows of the pure-Python dependencies (.ci/lower_bounds.py
# reads them; FLOOR="pydantic==2.8.2" tries another), in a venv of their own. Its other packages, torch among them,
# are $(VENV)'s: a .pth file puts them after the floor venv's own, so nothing as large as torch is installed twice.
# import-linter (a test tool built on rich) comes in the version pip finds for the floor's rich.
FLOOR_VENV ?= .venv-floor
FLOOR ?=
test-floor: $(VENV)/.installed
	rm -rf $(FLOOR_VENV)
	$(BIN)/python -m venv $(FLOOR_VENV)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_path('purelib'))" \
		> "$$($(FLOOR_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/main-venv.pth"
	$(FLOOR_VENV)/bin/pip install --quiet --no-warn-conflicts $$($(BIN)/python .ci/lower_bounds.py $(FLOOR)) import-linter
	$(FLOOR_VENV)/bin/pip list 2>/dev/null | grep -iE '^(pydantic|pydantic.core|typer|rich|webdataset|open.clip.torch) '
	PYTHONPATH=$(CURDIR) $(FLOOR_VENV)/bin/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadscope tests

schema: venv
	$(BIN)/fsdpclip schema > schemas/job.schema.json

# What the demo wrote: its data and its runs. `distclean` also removes the virtual environment (`make demo` builds it
# again, minutes).
clean:
	rm -rf $(DEMO_DATA) runs

distclean: clean
	@echo "== removing $(VENV), torch and the test extras with it, and $(FLOOR_VENV)"
	rm -rf $(VENV) $(FLOOR_VENV)
