"""SIGINT and SIGTERM inside qship: `Interrupted` in the main thread wherever it waits,
with the exit code of the signal, and a child process stopped with SIGTERM first (vLLM,
lm-eval: they clean up on it) rather than killed. The run as a CI job meets it is in
test_cli.py (test_a_signal_mid_download_exits_with_the_error_object)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline import log
from pipeline.cli.signals import interrupts_raise
from pipeline.errors import Interrupted

CHILD = """
import pathlib, signal, sys, time
got, ready = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def on(signum, frame):
    got.write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, on)
ready.write_text("ready")
while True:
    time.sleep(0.1)
"""


def _signal_us_when(ready: Path, sig: int) -> threading.Thread:
    """Send `sig` to this process once the child has written `ready` (no timer to race)."""

    def wait_then_signal() -> None:
        while not ready.exists():
            time.sleep(0.02)
        os.kill(os.getpid(), sig)

    t = threading.Thread(target=wait_then_signal, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupted_child_gets_sigterm_and_the_parent_raises(sig, code, tmp_path):
    got, ready = tmp_path / "got", tmp_path / "ready"
    t = _signal_us_when(ready, sig)
    with interrupts_raise(), pytest.raises(Interrupted) as e:
        log.run_child([sys.executable, "-c", CHILD, str(got), str(ready)], label="child")
    t.join()
    assert e.value.exit_code == code and e.value.name == sig.name
    assert got.read_text() == "SIGTERM"  # passed on, not SIGKILL: it ran its handler


def test_the_handlers_are_put_back_and_an_inherited_ignore_is_overridden():
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts_raise():
            with pytest.raises(Interrupted):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler raises at the next bytecode
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


def test_an_interrupt_while_files_hash_in_threads_stops_the_workers(tmp_path):
    """The main thread waits for the pool; the interrupt lands there, and the workers stop
    at their next chunk instead of hashing their files to the end first."""
    from pipeline.io.hashing import CHUNK, hash_files

    chunks = 16
    for name in ("a.bin", "b.bin"):
        (tmp_path / name).write_bytes(b"\0" * (chunks * CHUNK))
    seen: list[int] = []

    def slow(n: int) -> None:  # the first chunk sends the signal; each takes 50 ms
        if not seen:
            os.kill(os.getpid(), signal.SIGINT)
        seen.append(n)
        time.sleep(0.05)

    with interrupts_raise(), pytest.raises(Interrupted):
        hash_files(tmp_path, ["a.bin", "b.bin"], workers=2, on_bytes=slow, readahead=False)
    assert len(seen) < chunks, f"{len(seen)} of {2 * chunks} chunks hashed after the interrupt"
