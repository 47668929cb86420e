"""Nothing unverified reaches an artifact: a stage-cache entry altered after it was written
is not reused (rebuilt with a warning, or exit 3 under --require-pin)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_run import qship
from test_concurrency_disk import recipe

INTEGRITY = 3


def _entry(cache: Path, stage: str) -> Path:
    (d,) = [p for p in (cache / stage).iterdir() if not p.name.startswith(".")]
    return d


def _negate_head(entry: Path) -> None:
    from safetensors.torch import load_file, save_file

    (f,) = list(entry.rglob("model.safetensors"))
    sd = load_file(str(f))
    sd["lm_head.weight"] = -sd["lm_head.weight"]
    save_file(sd, str(f), metadata={"format": "pt"})


@pytest.fixture
def first_run(tiny_llama, tmp_path, capsys):
    cache, pins = tmp_path / "cache", tmp_path / "pins"
    pins.mkdir()
    rc, _ = qship(capsys, "fetch", str(tiny_llama), "--pin", "--checksums", str(pins),
                  "--cache-dir", str(cache))  # fmt: skip
    assert rc == 0
    r = recipe(tmp_path, "poison-rtn")
    args = ["run", "--model", str(tiny_llama), "--recipe", str(r), "--device", "cpu",
            "--cache-dir", str(cache), "--checksums", str(pins)]  # fmt: skip
    rc, rec = qship(capsys, *args, "--out", str(tmp_path / "a"))
    assert rc == 0, rec
    return tmp_path, cache, args


def _weights_sums(art: Path) -> list[str]:
    return sorted(ln for ln in (art / "SHA256SUMS").read_text().splitlines() if "safetensors" in ln)


def test_a_poisoned_quantize_entry_is_rebuilt_not_packaged(first_run, capsys):
    tmp, cache, args = first_run
    _negate_head(_entry(cache, "quantize"))
    capsys.readouterr()
    from pipeline.cli import main

    assert main([*args, "--out", str(tmp / "b"), "--json"]) == 0
    err = capsys.readouterr().err
    assert (
        "cache entry quantize/" in err and "fails its sha256" in err and "model.safetensors" in err
    )
    assert _weights_sums(tmp / "b") == _weights_sums(tmp / "a")  # rebuilt: the same weights


def test_a_poisoned_entry_under_require_pin_is_exit_3(first_run, capsys):
    tmp, cache, args = first_run
    _negate_head(_entry(cache, "quantize"))
    rc, err = qship(capsys, *args, "--out", str(tmp / "c"), "--require-pin")
    assert rc == INTEGRITY, err
    assert "cache entry quantize/" in err["message"] and not (tmp / "c").exists()


def test_an_altered_evaluation_record_is_not_reused(first_run, capsys):
    """The evaluate entry's figures live in its stage.json: altering them (a KL of 0) is
    caught as well, and the rerun measures again."""
    import json

    tmp, cache, args = first_run
    rec = _entry(cache, "evaluate") / "stage.json"
    data = json.loads(rec.read_text())
    true_kl = data["metrics"]["kl"]["mean"]
    data["metrics"]["kl"]["mean"] = 0.0
    rec.write_text(json.dumps(data, indent=2, sort_keys=True))
    rc, out = qship(capsys, *args, "--out", str(tmp / "d"))
    assert rc == 0, out
    ev = json.loads((tmp / "d" / "eval.json").read_text())
    assert ev["metrics"]["kl"]["mean"] == true_kl > 0
