"""Pins by content and --require-pin (pip's --require-hashes for models): a copy of a
pinned file under another name is still pinned; an input no manifest pins is exit 3
before any download, dequantization or quantization, leaving no cache entry."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from factories import REPO, cli, entries

from pipeline.io.hashing import Manifest
from tests.cli_run import qship

INTEGRITY, USAGE = 3, 2


def fetch(src, cache: Path, checksums: Path, *extra: str) -> list[str]:
    return ["fetch", str(src), "--cache-dir", str(cache), "--checksums", str(checksums), *extra]


@pytest.fixture
def work(tmp_path):
    checksums = tmp_path / "checksums"
    checksums.mkdir()
    return tmp_path, tmp_path / "cache", checksums


def test_local_gguf_copy_is_pinned_by_content(capsys, tiny_gguf, work):
    """Pinned under one name, fetched from a copy under another: both the GGUF and its
    dequantized checkpoint are reported pinned against the original's manifests (the
    dequantized bytes must not depend on the copy's file name)."""
    tmp, cache, checksums = work
    rc, first = qship(capsys, *fetch(tiny_gguf, cache, checksums, "--pin"))
    assert rc == 0, first
    copy = tmp / "elsewhere" / "renamed-model.gguf"
    copy.parent.mkdir()
    shutil.copy(tiny_gguf, copy)
    rc, snap = qship(capsys, *fetch(copy, tmp / "cache2", checksums, "--require-pin"))
    assert rc == 0, snap
    assert snap["pin_status"] == "pinned" and snap["manifest"] == first["manifest"]
    assert snap["model_hash"] == first["model_hash"]
    assert snap["checks"]["gguf"]["manifest"] == str(
        checksums / Manifest.filename(f"gguf/{tiny_gguf.stem}", "local")
    )
    assert len(list(checksums.glob("*.json"))) == 2  # nothing pinned anew


def test_require_pin_refuses_an_unpinned_gguf_before_dequantizing(
    capsys,
    tiny_gguf,
    work,
    monkeypatch,
):
    tmp, cache, checksums = work
    from pipeline.fetch import gguf

    def boom(*a, **k):
        raise AssertionError("dequantized an unpinned GGUF under --require-pin")

    monkeypatch.setattr(gguf, "dequantize", boom)
    rc, err = qship(capsys, *fetch(tiny_gguf, cache, checksums, "--require-pin"))
    assert rc == INTEGRITY and "is not pinned" in err["message"], err
    assert "--pin" in err["hint"]
    assert entries(cache) == []


def test_require_pin_on_a_folder_and_pin_by_content(capsys, tiny_llama, work):
    """An unpinned folder: exit 3, no entry. Pinned once from another path, a copy of it
    is pinned by content (same names, same bytes); one changed byte is not."""
    tmp, cache, checksums = work
    a = shutil.copytree(tiny_llama, tmp / "a" / "tiny")
    rc, err = qship(capsys, *fetch(a, cache, checksums, "--require-pin"))
    assert rc == INTEGRITY and "not pinned" in err["message"], err
    assert entries(cache) == []
    rc, pinned = qship(capsys, *fetch(a, cache, checksums, "--pin"))
    assert rc == 0 and pinned["pin_status"] == "pinned-now", pinned
    b = shutil.copytree(tiny_llama, tmp / "b" / "other-name")
    rc, snap = qship(capsys, *fetch(b, cache, checksums, "--require-pin"))
    assert rc == 0 and snap["pin_status"] == "pinned", snap
    assert snap["manifest"] == pinned["manifest"]
    cfg = json.loads((b / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5 + 1e-9
    (b / "config.json").write_text(json.dumps(cfg))
    rc, err = qship(capsys, *fetch(b, cache, checksums, "--require-pin"))
    assert rc == INTEGRITY and "not pinned" in err["message"], err


def test_require_pin_on_the_hub_downloads_nothing(capsys, hub, tiny_repo, work):  # noqa: F811
    tmp, cache, checksums = work
    rc, err = qship(capsys, *fetch(f"hf://{REPO}@main", cache, checksums, "--require-pin"))
    assert rc == INTEGRITY and tiny_repo in err["path"] + err["message"] + err["hint"], err
    assert hub.count("GET", "/cdn/") == 0 and hub.count("GET", f"/{REPO}/resolve") == 0
    rc, ok = qship(capsys, *fetch(f"hf://{REPO}@main", cache, checksums, "--pin"))
    assert rc == 0, ok
    rc, again = qship(capsys, *fetch(f"hf://{REPO}@main", cache, checksums, "--require-pin"))
    assert rc == 0 and again["pin_status"] == "pinned", again


def test_pin_and_require_pin_together_is_a_usage_error(capsys, tiny_llama, work):
    tmp, cache, checksums = work
    rc, err = qship(capsys, *fetch(tiny_llama, cache, checksums, "--pin", "--require-pin"))
    assert rc == USAGE and "contradict" in err["message"], err


def test_run_require_pin_stops_before_any_compute(capsys, tiny_llama, tmp_path):
    checksums = tmp_path / "checksums"
    checksums.mkdir()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "name": "rtn", "others": "keep",
        "groups": [{"name": "all", "targets": ["re:.*_proj$"], "method": "rtn",
                    "scheme": {"bits": 4, "group_size": 32}}],
    }))  # fmt: skip
    out = tmp_path / "art"
    rc, err = qship(
        capsys, "run", "--model", str(tiny_llama), "--recipe", str(recipe), "--out", str(out),
        "--cache-dir", str(tmp_path / "cache"), "--require-pin",
    )  # fmt: skip
    assert rc == INTEGRITY and "not pinned" in err["message"], err
    run = json.loads((Path(f"{out}.report") / "run.json").read_text())
    assert not {"tokens", "quantize"} & {s["stage"] for s in run["stages"]}
    assert not out.exists()


def test_pins_hold_from_any_working_directory(gemma_snapshot, qship_test_cache, tmp_path):
    """The shipped pins are found from a folder without checksums/: the pinned Gemma passes
    --require-pin there, and a tampered copy of its GGUF is refused (exit 3), also with a
    pin folder of the user's (--checksums, $QSHIP_CHECKSUMS) that holds other pins."""
    from tests.conftest import GEMMA_PKG

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    mine = tmp_path / "my-pins"
    mine.mkdir()
    base = ["--require-pin", "--cache-dir", str(qship_test_cache), "--json"]
    for extra, env in (
        ([], {}),
        (["--checksums", str(mine)], {}),
        ([], {"QSHIP_CHECKSUMS": str(mine)}),
    ):
        p = cli("fetch", GEMMA_PKG, *base, *extra, cwd=elsewhere, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        assert json.loads(p.stdout)["pin_status"] == "pinned"
    gguf = next(qship_test_cache.rglob("gemma-3-270m-q4_k_m.gguf"))
    tampered = elsewhere / gguf.name
    shutil.copyfile(gguf, tampered)
    with open(tampered, "r+b") as fh:
        fh.seek(gguf.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    for extra in (["--require-pin"], []):  # an altered copy of a pinned file: exit 3 either way
        args = [a for a in base if a != "--require-pin"] + extra
        p = cli("fetch", str(tampered), *args, cwd=elsewhere)
        assert p.returncode == INTEGRITY, p.stdout + p.stderr
        assert "named like the pinned gemma-3-270m-q4_k_m.gguf" in json.loads(p.stdout)["message"]


@pytest.mark.parametrize("how", ["--checksums", "QSHIP_CHECKSUMS"])
@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_named_pin_folder_must_be_a_folder(capsys, tiny_llama, tmp_path, monkeypatch, how,
                                             kind):  # fmt: skip
    """A pin folder the user named that does not exist, or is a file, is exit 2 naming it
    (before, it read as "no pin" and took any model, or crashed under --pin), and nothing
    is fetched or pinned."""
    folder = tmp_path / "my-pins"
    if kind == "file":
        folder.write_text("not a folder")
    cache = tmp_path / "cache"
    args = ["fetch", str(tiny_llama), "--cache-dir", str(cache), "--pin"]
    if how == "--checksums":
        args += ["--checksums", str(folder)]
    else:
        monkeypatch.setenv("QSHIP_CHECKSUMS", str(folder))
    rc, err = qship(capsys, *args)
    assert rc == USAGE, err
    assert str(folder) in err["message"] and how in err["message"], err
    assert ("does not exist" if kind == "missing" else "not a folder") in err["message"]
    assert entries(cache) == [] and (kind == "file") == folder.exists()
