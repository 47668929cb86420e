"""fetch from a local directory through the real CLI (`pipeline.cli.main`, and once the
installed `qship` script): a good folder is pinned and re-fetched as a verified cache hit;
a flipped byte, a truncated file, a missing or an extra shard, an escaping symlink and a
pickle file each fail closed with exit 3 and a message naming the file (and, for hash
mismatches, the expected and the actual sha256), leaving no cache entry behind."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from factories import entries

from pipeline.io.hashing import Manifest, sha256_file
from tests.cli_run import qship

INTEGRITY = 3


def fetch_args(model: Path, cache: Path, checksums: Path, *extra: str) -> list[str]:
    return ["fetch", str(model), "--cache-dir", str(cache), "--checksums", str(checksums), *extra]


def leftovers(cache: Path) -> list[str]:
    d = cache / "fetch"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def pin_path(checksums: Path, model: Path) -> Path:
    return checksums / Manifest.filename(f"local/{model.name}", "local")


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory, tiny_llama) -> Path:
    """tiny-llama re-sharded into 2 safetensors shards with a model.safetensors.index.json
    (the layout save_pretrained(max_shard_size=...) writes), tensors split by name."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("sharded") / "tiny-llama-2shards"
    shutil.copytree(tiny_llama, out, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map, total = {}, 0
    for shard, keys in shards.items():
        part = {k: tensors[k].contiguous() for k in keys}
        save_file(part, str(out / shard), metadata={"format": "pt"})
        for k in keys:
            weight_map[k] = shard
            total += part[k].numel() * part[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


@pytest.fixture
def work(tmp_path):
    cache, checksums = tmp_path / "cache", tmp_path / "checksums"
    checksums.mkdir()
    return tmp_path, cache, checksums


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def pinned_copy(capsys, src: Path, work) -> Path:
    tmp, cache, checksums = work
    model = copy_model(src, tmp / "model")
    pin_cache = tmp / "pin-cache"
    rc, snap = qship(capsys, *fetch_args(model, pin_cache, checksums, "--pin"))
    assert rc == 0, snap
    assert snap["pin_status"] == "pinned-now"
    assert Path(snap["manifest"]) == pin_path(checksums, model)
    shutil.rmtree(pin_cache)
    return model


def expect_integrity_failure(capsys, model, work, *names: str) -> str:
    _, cache, checksums = work
    rc, err = qship(capsys, *fetch_args(model, cache, checksums))
    assert rc == INTEGRITY, err
    assert err["exit_code"] == INTEGRITY and err["error"] == "IntegrityError"
    msg = err["message"]
    for name in names:
        assert name in msg, msg
    assert entries(cache) == [], "a failed fetch left a cache entry"
    assert [n for n in leftovers(cache) if not n.startswith(".")] == [], leftovers(cache)
    return msg


# ------------------------------------------------------------------ good folders


def test_good_dir_pin_then_verified_cache_hit(capsys, tiny_llama, work):
    tmp, cache, checksums = work
    model = copy_model(tiny_llama, tmp / "model")
    # unpinned first: consistent, hashes recorded, no manifest written
    rc, snap = qship(capsys, *fetch_args(model, tmp / "c0", checksums))
    assert rc == 0 and snap["pin_status"] == "unpinned" and snap["manifest"] is None
    assert not any(checksums.iterdir())

    rc, snap = qship(capsys, *fetch_args(model, cache, checksums, "--pin"))
    assert rc == 0, snap
    assert snap["pin_status"] == "pinned-now" and snap["cache_hit"] is False
    manifest = Manifest.load(pin_path(checksums, model))
    expected = {
        p.name: sha256_file(p) for p in model.iterdir() if p.is_file()
    }  # every file of the checkpoint is taken and pinned
    assert manifest.files == expected
    assert {k: (v["sha256"], v["size"]) for k, v in snap["files"].items()} == {
        k: (v.sha256, v.size) for k, v in expected.items()
    }
    text = "".join(f"{expected[r].sha256}  {r}\n" for r in sorted(expected))
    assert snap["model_hash"] == hashlib.sha256(text.encode()).hexdigest()
    snap_dir = Path(snap["path"])
    assert snap_dir.is_dir() and snap_dir.is_relative_to(cache / "fetch")
    for rel, d in expected.items():
        assert sha256_file(snap_dir / rel) == d
    assert len(entries(cache)) == 1

    # the same folder again: the pin now exists (it is part of the cache key, so the
    # entry written by --pin, recorded as "pinned-now", is not reused) -> checked against it
    rc, pinned = qship(capsys, *fetch_args(model, cache, checksums))
    assert rc == 0, pinned
    assert pinned["pin_status"] == "pinned" and pinned["cache_hit"] is False
    assert pinned["model_hash"] == snap["model_hash"]
    snap = pinned
    snap_dir = Path(snap["path"])
    # and once more: a cache hit (re-hashed), same snapshot
    rc, again = qship(capsys, *fetch_args(model, cache, checksums))
    assert rc == 0, again
    assert again["cache_hit"] is True and again["pin_status"] == "pinned"
    assert again["path"] == snap["path"] and again["model_hash"] == snap["model_hash"]

    # the cache hit is re-hashed: a cached file altered after verification fails closed
    victim = snap_dir / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    rc, err = qship(capsys, *fetch_args(model, cache, checksums))
    assert rc == INTEGRITY, err
    msg = err["message"]
    assert "altered after it was verified" in msg and "model.safetensors" in msg
    assert hashlib.sha256(bytes(data)).hexdigest() in msg
    assert expected["model.safetensors"].sha256 in msg


def test_installed_qship_script_exit_code(tiny_llama, work):
    """The console script maps the same failure to exit 3 (a real process)."""
    tmp, cache, checksums = work
    model = copy_model(tiny_llama, tmp / "model")
    (model / "model.safetensors").unlink()
    exe = Path(sys.executable).with_name("qship")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "pipeline.cli"]
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "300"}
    res = subprocess.run(
        [*cmd, *fetch_args(model, cache, checksums)], capture_output=True, text=True, env=env
    )
    assert res.returncode == INTEGRITY, res.stdout + res.stderr
    assert "no weight file" in res.stderr
    assert entries(cache) == []


def test_sharded_dir_pins_and_fetches(capsys, sharded_llama, work):
    tmp, cache, checksums = work
    model = pinned_copy(capsys, sharded_llama, work)
    rc, snap = qship(capsys, *fetch_args(model, cache, checksums))
    assert rc == 0 and snap["pin_status"] == "pinned", snap
    assert {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    } <= set(snap["files"])
    # the snapshot loads as a sharded checkpoint with the original weights
    from safetensors.torch import load_file

    snap_dir = Path(snap["path"])
    merged = {}
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        merged.update(load_file(str(snap_dir / shard)))
    index = json.loads((snap_dir / "model.safetensors.index.json").read_text())
    assert set(merged) == set(index["weight_map"])


# ------------------------------------------------------------------ failures (exit 3)


def test_flipped_byte_names_file_and_both_hashes(capsys, tiny_llama, work):
    model = pinned_copy(capsys, tiny_llama, work)
    victim = model / "model.safetensors"
    expected = sha256_file(victim).sha256
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x20  # inside the tensor data: the header stays valid
    victim.write_bytes(bytes(data))
    actual = hashlib.sha256(bytes(data)).hexdigest()
    msg = expect_integrity_failure(capsys, model, work, "model.safetensors", expected, actual)
    assert "pinned manifest" in msg


def test_flipped_byte_in_tokenizer_json(capsys, tiny_llama, work):
    model = pinned_copy(capsys, tiny_llama, work)
    victim = model / "tokenizer.json"
    expected = sha256_file(victim).sha256
    data = bytearray(victim.read_bytes())
    i = data.rindex(b"e")  # one letter inside the vocab/merges text: still valid JSON
    data[i] = ord("E")
    victim.write_bytes(bytes(data))
    actual = sha256_file(victim).sha256
    assert actual != expected
    expect_integrity_failure(capsys, model, work, "tokenizer.json", expected, actual)


def test_truncated_file(capsys, tiny_llama, work):
    model = pinned_copy(capsys, tiny_llama, work)
    victim = model / "model.safetensors"
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size - 4096)
    actual = sha256_file(victim).sha256
    msg = expect_integrity_failure(capsys, model, work, "model.safetensors", actual)
    assert "truncated" in msg


def test_truncated_shard_unpinned(capsys, sharded_llama, work):
    """Without any pin a truncated shard is still caught (its header no longer fits)."""
    tmp, cache, checksums = work
    model = copy_model(sharded_llama, tmp / "model")
    victim = model / "model-00002-of-00002.safetensors"
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size // 2)
    msg = expect_integrity_failure(capsys, model, work, "model-00002-of-00002.safetensors")
    assert "truncated" in msg


def test_missing_shard(capsys, sharded_llama, work):
    model = pinned_copy(capsys, sharded_llama, work)
    gone = model / "model-00002-of-00002.safetensors"
    expected = sha256_file(gone).sha256
    gone.unlink()
    msg = expect_integrity_failure(capsys, model, work, "model-00002-of-00002.safetensors")
    assert "missing" in msg and "model.safetensors.index.json" in msg
    # unpinned, the index alone catches it too
    shutil.rmtree(work[2])
    work[2].mkdir()
    msg = expect_integrity_failure(capsys, model, work, "model-00002-of-00002.safetensors")
    assert "missing" in msg
    assert expected  # (the pinned run also names the expected hash when the index is fine)


def test_extra_shard(capsys, sharded_llama, work):
    model = pinned_copy(capsys, sharded_llama, work)
    extra = model / "model-00003-of-00002.safetensors"
    shutil.copy(model / "model-00001-of-00002.safetensors", extra)
    msg = expect_integrity_failure(capsys, model, work, "model-00003-of-00002.safetensors")
    assert "extra" in msg and "not listed" in msg


def test_extra_file_against_pin(capsys, tiny_llama, work):
    """A file the pin does not know (a config next to the weights) fails closed too."""
    model = pinned_copy(capsys, tiny_llama, work)
    (model / "special_tokens_map.json").write_text('{"bos_token": "<s>"}\n')
    actual = sha256_file(model / "special_tokens_map.json").sha256
    msg = expect_integrity_failure(capsys, model, work, "special_tokens_map.json", actual)
    assert "extra" in msg


def test_symlink_escape(capsys, tiny_llama, work):
    tmp, _, _ = work
    model = pinned_copy(capsys, tiny_llama, work)
    outside = tmp / "outside" / "tokenizer.json"
    outside.parent.mkdir()
    shutil.move(model / "tokenizer.json", outside)
    (model / "tokenizer.json").symlink_to(outside)
    msg = expect_integrity_failure(capsys, model, work, "tokenizer.json", "outside")
    assert "points outside the snapshot" in msg
    # a relative ../ link is just as bad
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(Path("..") / "outside" / "tokenizer.json")
    expect_integrity_failure(capsys, model, work, "tokenizer.json", "points outside")


def test_symlink_inside_is_fine(capsys, tiny_llama, work):
    tmp, cache, checksums = work
    model = pinned_copy(capsys, tiny_llama, work)
    store = model / "blobs"
    store.mkdir()
    shutil.move(model / "tokenizer.json", store / "tok")
    (model / "tokenizer.json").symlink_to(Path("blobs") / "tok")
    rc, snap = qship(capsys, *fetch_args(model, cache, checksums))
    # blobs/tok is not a checkpoint file (not taken); the link dereferenced is the pinned file
    assert rc == 0, snap
    assert snap["pin_status"] == "pinned"
    assert not (Path(snap["path"]) / "tokenizer.json").is_symlink()


def test_pickle_file_refused_unless_allowed(capsys, tiny_llama, work):
    import torch

    tmp, cache, checksums = work
    model = copy_model(tiny_llama, tmp / "model")
    torch.save({"w": torch.zeros(2)}, model / "pytorch_model.bin")
    msg = expect_integrity_failure(capsys, model, work, "pytorch_model.bin")
    assert "pickle" in msg
    assert not any(checksums.iterdir())

    rc, snap = qship(capsys, *fetch_args(model, cache, checksums, "--allow-pickle", "--pin"))
    assert rc == 0, snap
    assert "pytorch_model.bin" in snap["files"]
    assert (
        snap["files"]["pytorch_model.bin"]["sha256"]
        == sha256_file(model / "pytorch_model.bin").sha256
    )
    assert (Path(snap["path"]) / "pytorch_model.bin").is_file()
    # still refused without the flag, even now that it is pinned
    shutil.rmtree(cache)
    expect_integrity_failure(capsys, model, work, "pytorch_model.bin", "pickle")


def test_pickle_only_checkpoint_with_allow_pickle(capsys, tiny_llama, work):
    """A .bin-only folder (no safetensors) is taken with --allow-pickle."""
    import torch
    from safetensors.torch import load_file

    tmp, cache, checksums = work
    model = copy_model(tiny_llama, tmp / "model")
    torch.save(load_file(str(model / "model.safetensors")), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    expect_integrity_failure(capsys, model, work, "pytorch_model.bin")
    rc, snap = qship(capsys, *fetch_args(model, cache, checksums, "--allow-pickle"))
    assert rc == 0, snap
    assert "pytorch_model.bin" in snap["files"]


def test_missing_config(capsys, tiny_llama, work):
    tmp, _, _ = work
    model = copy_model(tiny_llama, tmp / "model")
    (model / "config.json").unlink()
    expect_integrity_failure(capsys, model, work, "config.json")


def test_hf_cache_snapshot_layout(capsys, tiny_llama, work):
    """An HF cache snapshot folder (symlinks into blobs/) is a local source whose repo and
    commit come from the path; the links into blobs/ stay inside the repo folder."""
    tmp, cache, checksums = work
    commit = "a" * 40
    repo = tmp / "hub" / "models--org--tiny"
    snap_dir = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap_dir.mkdir(parents=True)
    for p in tiny_llama.iterdir():
        blob = repo / "blobs" / sha256_file(p).sha256
        shutil.copy(p, blob)
        (snap_dir / p.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    rc, snap = qship(capsys, *fetch_args(snap_dir, cache, checksums, "--pin"))
    assert rc == 0, snap
    assert snap["repo_id"] == "org/tiny" and snap["revision"] == commit
    assert (checksums / f"org--tiny@{commit}.json").is_file()


def test_dangling_and_looping_symlinks(capsys, tiny_llama, work):
    """Broken links are integrity failures naming the link (they used to escape as a
    FileNotFoundError / RuntimeError traceback with exit 1)."""
    tmp, _, _ = work
    model = copy_model(tiny_llama, tmp / "model")
    (model / "special_tokens_map.json").symlink_to("gone.json")
    expect_integrity_failure(capsys, model, work, "special_tokens_map.json", "broken")
    (model / "special_tokens_map.json").unlink()
    (model / "loop1.json").symlink_to("loop2.json")
    (model / "loop2.json").symlink_to("loop1.json")
    expect_integrity_failure(capsys, model, work, "loop1.json", "broken")


def test_missing_pinned_file(capsys, tiny_llama, work):
    model = pinned_copy(capsys, tiny_llama, work)
    expected = sha256_file(model / "tokenizer.json").sha256
    (model / "tokenizer.json").unlink()
    msg = expect_integrity_failure(capsys, model, work, "tokenizer.json", expected)
    assert "missing" in msg


def test_pin_refused_for_an_inconsistent_folder(capsys, sharded_llama, work):
    """--pin never records a broken folder: the consistency checks run first."""
    tmp, cache, checksums = work
    model = copy_model(sharded_llama, tmp / "model")
    (model / "model-00001-of-00002.safetensors").unlink()
    rc, err = qship(capsys, *fetch_args(model, cache, checksums, "--pin"))
    assert rc == INTEGRITY and "model-00001-of-00002.safetensors" in err["message"]
    assert not any(checksums.iterdir())
    assert entries(cache) == []
