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
