"""Network faults on the Hub path, against tests/hub_server.py: refused connections,
a stalled server, 503, 429 with Retry-After, a truncated body. Transient failures are
retried with backoff and either pass (the snapshot verified as usual) or end in exit 5
with a message naming the host and the fix, leaving no cache entry."""

from __future__ import annotations

import socket
import time

import pytest
from factories import REPO

from tests.cli_run import qship

TRANSIENT = 5


@pytest.fixture
def fast_retries(monkeypatch, tmp_path):
    monkeypatch.setenv("QSHIP_NET_RETRIES", "3")
    monkeypatch.setenv("QSHIP_NET_BACKOFF", "0.05")
    checksums = tmp_path / "checksums"
    checksums.mkdir()
    return tmp_path / "cache", checksums


def fetch(src: str, cache, checksums) -> list[str]:
    return ["fetch", src, "--cache-dir", str(cache), "--checksums", str(checksums)]


def no_entries(cache) -> bool:
    return not (cache / "fetch").is_dir() or not any((cache / "fetch").iterdir())


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: connections are refused


def test_refused_connection_is_transient_with_a_clear_message(
    capsys,
    hub,  # noqa: F811
    tiny_repo,  # noqa: F811
    fast_retries,
    monkeypatch,
    repo_root,
):
    from huggingface_hub import constants

    cache, checksums = fast_retries
    dead = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}"
    )
    rc, err = qship(capsys, *fetch(f"hf://{REPO}@main", cache, checksums))
    assert rc == TRANSIENT, err
    assert "cannot connect" in err["message"] and dead in err["message"], err
    assert "3 attempt" in err["message"] and "HF_HUB_OFFLINE=1" in err["hint"]
    assert no_entries(cache)
    # the recipe check of `qship run` reads config.json first: the same exit 5, not a
    # traceback, after huggingface_hub's own retries (their sleeps skipped here)
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda s: None)
    recipe = str(repo_root / "recipes" / "gemma-mixed-w4.yaml")
    rc, err = qship(capsys, "plan", "--model", f"hf://{REPO}@main", "--recipe", recipe)
    assert rc == TRANSIENT and "config.json" in err["message"], err
    assert "retried by huggingface_hub" in err["message"], err


def test_503_then_success(capsys, hub, tiny_repo, fast_retries):  # noqa: F811
    cache, checksums = fast_retries
    hub.fault(f"/api/models/{REPO}", "status", times=2, status=503)
    rc, snap = qship(capsys, *fetch(f"hf://{REPO}@main", cache, checksums))
    assert rc == 0 and snap["revision"] == tiny_repo, snap
    assert hub.count("GET", f"/api/models/{REPO}") == 3


def test_503_for_good_leaves_nothing(capsys, hub, tiny_repo, fast_retries):  # noqa: F811
    cache, checksums = fast_retries
    hub.fault("/cdn/", "status", times=99, status=503)
    rc, err = qship(capsys, *fetch(f"hf://{REPO}@main", cache, checksums))
    assert rc == TRANSIENT and "HTTP 503" in err["message"], err
    assert "model.safetensors" in err["message"] + err["path"]
    assert no_entries(cache)


def test_429_waits_for_retry_after(capsys, hub, tiny_repo, fast_retries):  # noqa: F811
    cache, checksums = fast_retries
    hub.fault(f"/api/models/{REPO}", "status", times=1, status=429, retry_after=1)
    t0 = time.monotonic()
    rc, snap = qship(capsys, *fetch(f"hf://{REPO}@main", cache, checksums))
    assert rc == 0, snap
    assert time.monotonic() - t0 >= 1.0  # the server's Retry-After, not the 0.05 s backoff


def test_stalled_server_times_out_and_retries(
    capsys,
    hub,  # noqa: F811
    tiny_repo,  # noqa: F811
    fast_retries,
    monkeypatch,
):
    cache, checksums = fast_retries
    monkeypatch.setenv("QSHIP_NET_TIMEOUT", "0.5")
    hub.fault(f"/api/models/{REPO}", "stall", times=1, seconds=3.0)
    t0 = time.monotonic()
    rc, snap = qship(capsys, *fetch(f"hf://{REPO}@main", cache, checksums))
    assert rc == 0, snap
    assert time.monotonic() - t0 < 3.0  # gave up on the stalled answer, did not wait it out


def test_truncated_body_is_resumed_and_verified(capsys, hub, tiny_repo, fast_retries):  # noqa: F811
    cache, checksums = fast_retries
    hub.fault("/cdn/", "truncate", times=1)
    rc, snap = qship(capsys, *fetch(f"hf://{REPO}@main", cache, checksums))
    assert rc == 0, snap
    assert "match the Hub's sha256" in snap["checks"]["lfs"]["status"]
    assert hub.count("GET", "/cdn/") >= 2
