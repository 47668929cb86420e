"""A checkpoint's config.json is read through one helper (pipeline.model.files): exit 2 for
a folder without one, exit 3 for one that is not a JSON object, and no other module parses
the file itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import pipeline
from pipeline.errors import IntegrityError, UsageError
from pipeline.evaluate.scoring import quantization_config
from pipeline.model.files import read_config_json
from pipeline.model.loading import _dequantized
from pipeline.model.moe import _model_type

# modules that still parse config.json themselves, and the work that will route them
# through read_config_json (their owners are changing them now)
KNOWN_READERS = {
    "evaluate/engines.py": "served work",
    "evaluate/perf.py": "served work",
    "evaluate/served.py": "served work",
    "artifact/package.py": "supply-chain work",
}


def test_read_config_json_returns_the_object(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 7}))
    assert read_config_json(tmp_path) == {"model_type": "llama", "vocab_size": 7}


def test_a_folder_without_config_json_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError) as e:
        read_config_json(tmp_path)
    assert e.value.exit_code == 2
    assert "no config.json" in e.value.message and e.value.hint


@pytest.mark.parametrize(
    ("text", "reason"), [("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object")]
)
def test_a_malformed_config_json_is_an_integrity_error(tmp_path, text, reason):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(IntegrityError) as e:
        read_config_json(tmp_path)
    assert e.value.exit_code == 3
    assert reason in e.value.message
    assert e.value.path == str(tmp_path / "config.json")


def test_readers_fail_with_the_helpers_error(tmp_path):
    """scoring's quantization_config used to raise a bare JSONDecodeError (exit 1)."""
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(IntegrityError):
        quantization_config(tmp_path)
    # the readers that tolerate an unreadable config still do
    assert _model_type(tmp_path) is None
    assert _dequantized(tmp_path) == {}


def test_no_other_module_parses_config_json():
    root = Path(pipeline.__file__).parent
    reads = re.compile(r"json\.loads?\([^\n]*config\.json")
    found = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if reads.search(p.read_text(encoding="utf-8"))
    )
    assert found == sorted(KNOWN_READERS), (
        "parse config.json with pipeline.model.files.read_config_json "
        "(and take a module routed through it off KNOWN_READERS)"
    )
