"""The Hub path through the real huggingface_hub client against tests/hub_server.py (a
thread on 127.0.0.1, ephemeral port).

First the server is checked against the client itself (model_info with files_metadata,
hf_hub_download through the LFS redirect, snapshot_download, offline reuse of the cache),
so the qship tests below exercise the protocol the real Hub speaks. Then `qship fetch
hf://...`: a good download verified against the LFS sha256 and a pin, a file corrupted
in transit, a revision that moves after it was pinned, and offline mode.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from factories import REPO  # the tiny repo conftest's hub and tiny_repo serve

from pipeline.io.hashing import Manifest, sha256_file
from tests.cli_run import qship

INTEGRITY = 3


def offline(monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


# ------------------------------------------------------------------ the server vs the client


def test_server_speaks_model_info_with_files_metadata(hub, tiny_repo, tiny_llama):
    from huggingface_hub import HfApi

    info = HfApi(endpoint=hub.endpoint).model_info(REPO, revision="main", files_metadata=True)
    assert info.id == REPO and info.sha == tiny_repo
    sib = {s.rfilename: s for s in info.siblings}
    assert set(sib) == {p.name for p in tiny_llama.iterdir()}
    st = sib["model.safetensors"]
    data = (tiny_llama / "model.safetensors").read_bytes()
    assert st.lfs is not None and st.lfs.sha256 == hashlib.sha256(data).hexdigest()
    assert st.lfs.size == st.size == len(data) and st.lfs.pointer_size > 0
    assert sib["config.json"].lfs is None
    assert sib["config.json"].size == (tiny_llama / "config.json").stat().st_size
    # by commit as well; unknown revision / repo are the client's own errors
    assert HfApi(endpoint=hub.endpoint).model_info(REPO, revision=tiny_repo).sha == tiny_repo
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    with pytest.raises(RevisionNotFoundError):
        HfApi(endpoint=hub.endpoint).model_info(REPO, revision="nope")
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.endpoint).model_info("qship-tests/none")


def test_server_speaks_resolve_and_snapshot_download(hub, tiny_repo, tiny_llama, monkeypatch):
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url, snapshot_download

    data = (tiny_llama / "model.safetensors").read_bytes()
    meta = get_hf_file_metadata(hf_hub_url(REPO, "model.safetensors", endpoint=hub.endpoint))
    assert meta.commit_hash == tiny_repo
    assert meta.etag == hashlib.sha256(data).hexdigest()  # X-Linked-Etag of an LFS file
    assert meta.size == len(data)
    assert meta.location.startswith(hub.cdn + "/cdn/")  # the "CDN" redirect is not followed

    path = Path(hf_hub_download(REPO, "model.safetensors", endpoint=hub.endpoint))
    assert path.read_bytes() == data
    assert path.parent.name == tiny_repo and path.is_symlink()
    assert path.resolve().name == hashlib.sha256(data).hexdigest()  # blobs/<sha256>
    assert hub.count("GET", "/cdn/") == 1

    snap = Path(snapshot_download(REPO, endpoint=hub.endpoint))
    assert snap.name == tiny_repo
    for p in tiny_llama.iterdir():
        assert (snap / p.name).read_bytes() == p.read_bytes(), p.name
    assert hub.count("GET", "/cdn/") == 1  # the cached blob was reused

    # offline: the filled cache answers without the server
    offline(monkeypatch)
    before = len(hub.requests)
    again = Path(hf_hub_download(REPO, "config.json", endpoint=hub.endpoint))
    assert again.read_bytes() == (tiny_llama / "config.json").read_bytes()
    assert len(hub.requests) == before


def test_server_corruption_and_moving_branch(hub, tiny_repo, tiny_llama):
    """Corruption is visible only in the bytes; a moved branch changes X-Repo-Commit."""
    from huggingface_hub import HfApi, hf_hub_download

    data = (tiny_llama / "model.safetensors").read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    hub.corrupt(sha)
    api = HfApi(endpoint=hub.endpoint)
    lfs = {s.rfilename: s for s in api.model_info(REPO, files_metadata=True).siblings}
    assert lfs["model.safetensors"].lfs.sha256 == sha  # still advertises the true hash
    path = Path(
        hf_hub_download(REPO, "model.safetensors", endpoint=hub.endpoint, force_download=True)
    )
    got = path.read_bytes()
    assert len(got) == len(data) and got != data
    assert hashlib.sha256(got).hexdigest() != sha

    changed = bytearray((tiny_llama / "config.json").read_bytes())
    changed[-2:-1] = b" "
    commit_b = hub.add_commit(
        REPO,
        {**{p.name: p.read_bytes() for p in tiny_llama.iterdir()}, "config.json": bytes(changed)},
    )
    assert commit_b != tiny_repo
    assert api.model_info(REPO, revision="main").sha == commit_b
    assert api.model_info(REPO, revision=tiny_repo).sha == tiny_repo  # A is still reachable


# ------------------------------------------------------------------ qship fetch hf://


def fetch_args(src: str, cache: Path, checksums: Path, *extra: str) -> list[str]:
    return ["fetch", src, "--cache-dir", str(cache), "--checksums", str(checksums), *extra]


def no_entries(cache: Path) -> bool:
    return not list((cache / "fetch").glob("*/stage.json")) if (cache / "fetch").is_dir() else True


@pytest.fixture
def dirs(tmp_path):
    checksums = tmp_path / "checksums"
    checksums.mkdir()
    return tmp_path / "qship-cache", checksums


def test_hub_good_download_lfs_verified_and_pinned(capsys, hub, tiny_repo, tiny_llama, dirs):
    cache, checksums = dirs
    rc, snap = qship(capsys, *fetch_args(f"hf://{REPO}@main", cache, checksums, "--pin"))
    assert rc == 0, snap
    assert snap["repo_id"] == REPO and snap["revision"] == tiny_repo  # resolved to the commit
    assert snap["pin_status"] == "pinned-now"
    pin = checksums / Manifest.filename(REPO, tiny_repo)
    assert Path(snap["manifest"]) == pin and pin.is_file()
    for p in tiny_llama.iterdir():
        d = sha256_file(p)
        assert snap["files"][p.name] == {"sha256": d.sha256, "size": d.size}, p.name
        assert sha256_file(Path(snap["path"]) / p.name) == d
    assert "lfs" in json.dumps(snap["checks"]).lower()
    assert hub.count("GET", "/cdn/") >= 1
    # fetch again by commit: verified against the pin
    rc, again = qship(capsys, *fetch_args(f"hf://{REPO}@{tiny_repo}", cache, checksums))
    assert rc == 0, again
    assert again["pin_status"] == "pinned" and again["model_hash"] == snap["model_hash"]


def test_hub_corrupted_in_transit(capsys, hub, tiny_repo, tiny_llama, dirs):
    cache, checksums = dirs
    true_sha = sha256_file(tiny_llama / "model.safetensors").sha256
    hub.corrupt(true_sha)
    rc, err = qship(capsys, *fetch_args(f"hf://{REPO}", cache, checksums))
    assert rc == INTEGRITY, err
    assert "model.safetensors" in err["message"] and true_sha in err["message"]
    assert no_entries(cache)


def test_hub_moved_revision_fails_closed_until_repinned(capsys, hub, tiny_repo, tiny_llama, dirs):
    cache, checksums = dirs
    rc, snap = qship(capsys, *fetch_args(f"hf://{REPO}@main", cache, checksums, "--pin"))
    assert rc == 0, snap
    changed = json.loads((tiny_llama / "config.json").read_text())
    changed["rms_norm_eps"] = 1e-5 if changed.get("rms_norm_eps") != 1e-5 else 1e-6
    files = {p.name: p.read_bytes() for p in tiny_llama.iterdir()}
    commit_b = hub.add_commit(REPO, {**files, "config.json": json.dumps(changed).encode()})
    rc, err = qship(capsys, *fetch_args(f"hf://{REPO}@main", cache, checksums))
    assert rc == INTEGRITY, err
    assert tiny_repo in err["message"] and commit_b in err["message"]
    # after checking why, re-pinning accepts the new commit
    rc, snap_b = qship(capsys, *fetch_args(f"hf://{REPO}@main", cache, checksums, "--pin"))
    assert rc == 0, snap_b
    assert snap_b["revision"] == commit_b


def test_hub_offline_from_filled_cache(capsys, hub, tiny_repo, dirs, monkeypatch):
    cache, checksums = dirs
    rc, snap = qship(capsys, *fetch_args(f"hf://{REPO}@main", cache, checksums, "--pin"))
    assert rc == 0, snap
    shutil.rmtree(cache)  # only the HF cache is left
    offline(monkeypatch)
    before = len(hub.requests)
    rc, off = qship(capsys, *fetch_args(f"hf://{REPO}@{tiny_repo}", cache, checksums))
    assert rc == 0, off
    assert off["model_hash"] == snap["model_hash"] and off["pin_status"] == "pinned"
    assert len(hub.requests) == before


def test_plan_and_run_read_the_hub_config_before_any_weight(hub, tiny_repo, tmp_path, capsys):
    """`qship plan --model hf://…` reads config.json alone (no weight is downloaded); `qship
    run` with an invalid recipe exits 2 the same way, before the fetch."""
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "gemma-mixed-w4.yaml"
    rc, plan = qship(capsys, "plan", "--model", f"hf://{REPO}", "--recipe", str(recipe))
    assert rc == 0, plan
    assert plan["architecture"] == "LlamaForCausalLM" and plan["roles"]["attention"] == 16
    assert hub.count("GET", "/cdn/") == 0  # no LFS (weight) file was fetched
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.read_text().replace("roles: [lm_head, router]", "roles: [router]"))
    rc, err = qship(capsys, "run", "--model", f"hf://{REPO}", "--recipe", str(bad),
                    "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c"))  # fmt: skip
    assert rc == 2 and "groups[2].roles" in err["message"]
    assert hub.count("GET", "/cdn/") == 0 and not (tmp_path / "c" / "fetch").exists()
    run = json.loads((tmp_path / "out.report" / "run.json").read_text())
    assert [s["stage"] for s in run["stages"]] == ["recipe"] and run["error"]["exit_code"] == 2
    assert "groups[2].roles" in run["stages"][0]["error"]  # the failed stage, with its error
