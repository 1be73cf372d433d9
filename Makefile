# Set-up and the two entry points of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on this project's machines; override on others.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
DEMO_DATA ?= data/digits

.PHONY: venv demo test schema clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps clip_benchmark  # the reference the eval tests compare with
	touch $@

$(DEMO_DATA)/info.json: | venv
	$(BIN)/fsdpclip data digits $(DEMO_DATA)

# The main job: a tiny CLIP trained with FSDP on 2 CPU processes, then zero-shot on held-out digits.
demo: venv $(DEMO_DATA)/info.json
	$(BIN)/fsdpclip validate examples/tiny-cpu.json
	$(BIN)/fsdpclip launch examples/tiny-cpu.json
	$(BIN)/fsdpclip eval runs/tiny-cpu --zeroshot digits --data $(DEMO_DATA)/test --output runs/tiny-cpu/zeroshot-digits.json

test: venv
	$(BIN)/python -m pytest -q tests

schema: venv
	$(BIN)/fsdpclip schema > schemas/job.schema.json

clean:
	rm -rf $(VENV) $(DEMO_DATA) runs
