"""Nothing unverified reaches an artifact: a stage-cache entry altered after it was written
is not reused (rebuilt with a warning, or exit 3 under --require-pin)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_run import qship
from factories import recipe

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


def test_a_reused_out_whose_weights_were_altered_and_resummed_is_exit_3(first_run, capsys):
    """The same `qship run` again on its own --out reuses it only when the artifact's
    records agree: lm_head negated and SHA256SUMS rewritten is exit 3 naming the weight
    file, not a reuse that ships it."""
    from factories import negate_head, resum

    tmp, cache, args = first_run
    shard = negate_head(tmp / "a")
    resum(tmp / "a")
    rc, err = qship(capsys, *args, "--out", str(tmp / "a"))
    assert rc == INTEGRITY, err
    assert err["path"].endswith(shard) and "quantized_model_hash" in err["message"]
    assert err["result"]["artifact"] is None


def _tiny_with(tmp: Path, tiny: Path, **config) -> Path:
    import json
    import shutil

    d = shutil.copytree(tiny, tmp / "model")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(config)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(("config", "said"), [
    ({"num_hidden_layers": 100_000}, "num_hidden_layers 100,000 (at most 1,024)"),
    ({"intermediate_size": 2**31}, "intermediate_size 2,147,483,648"),
    ({"vocab_size": 10**10}, "vocab_size 10,000,000,000"),
    ({"num_hidden_layers": 8}, "weights hold 4 decoder layers but num_hidden_layers is 8"),
    ({"intermediate_size": 1024}, "config.json says intermediate_size 1024"),
])  # fmt: skip
def test_a_config_that_disagrees_with_its_weights_is_refused_before_loading(
    tiny_llama, tmp_path, capsys, config, said
):
    """Exit 3 from the safetensors headers in seconds, before transformers builds a model
    (a 100,000-layer config used to run for more than 10 minutes)."""
    import time

    model = _tiny_with(tmp_path, tiny_llama, **config)
    r = recipe(tmp_path, "absurd")
    t0 = time.monotonic()
    for args in (["plan", "--model", str(model), "--recipe", str(r)],
                 ["run", "--model", str(model), "--recipe", str(r), "--out", str(tmp_path / "o"),
                  "--cache-dir", str(tmp_path / "c")]):  # fmt: skip
        rc, err = qship(capsys, *args)
        assert rc == INTEGRITY, err
        assert said in err["message"], err["message"]
    assert time.monotonic() - t0 < 60 and not (tmp_path / "o").exists()


def test_recipe_numbers_beyond_any_real_run_are_exit_2(tiny_llama, tmp_path, capsys):
    import json

    for where, value, field in ((("groups", 0, "options", "n_grid"), 10**9, "n_grid"),
                                (("calibration", "num_samples"), 10**8, "num_samples"),
                                (("calibration", "batch_size"), 10**6, "batch_size"),
                                (("groups", 0, "options", "iters"), 10**7, "iters")):  # fmt: skip
        d = json.loads(recipe(tmp_path, "big").read_text())
        d["groups"][0]["method"] = "autoround" if field == "iters" else "awq"
        d["groups"][0]["scheme"]["symmetric"] = False
        node = d
        for k in where[:-1]:
            node = node.setdefault(k, {}) if isinstance(k, str) else node[k]
        node[where[-1]] = value
        p = tmp_path / "big.yaml"
        p.write_text(json.dumps(d))
        rc, err = qship(capsys, "plan", "--model", str(tiny_llama), "--recipe", str(p))
        assert rc == 2 and field in err["message"] and "less than or equal" in err["message"], err


def test_a_run_the_machine_cannot_hold_is_refused_before_fetch(tiny_llama, tmp_path, capsys,
                                                               monkeypatch):  # fmt: skip
    from pipeline.model import devices

    r = recipe(tmp_path, "fits")
    args = ["run", "--model", str(tiny_llama), "--recipe", str(r), "--device", "cpu",
            "--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c")]  # fmt: skip
    monkeypatch.setattr(devices, "free_cpu_bytes", lambda: 10**8)  # 0.1 GB of host memory
    rc, err = qship(capsys, *args)
    assert rc == 2 and "GB of host memory" in err["message"] and "0.1 GB are free" in err["message"]
    assert not (tmp_path / "c" / "fetch").exists()
