"""SIGINT and SIGTERM end every command the same way: `Interrupted` is raised in the main
thread wherever it is (a blocked download read included), the cleanups run, and `main`
prints the error object and exits 130 (SIGINT) or 143 (SIGTERM).

Both handlers are installed and both signals unblocked whatever this process inherited: a
process started in the background by a non-interactive shell (a Makefile recipe, a CI
script's `cmd &`) inherits SIGINT *ignored*, and Python then leaves it ignored -- an
interrupt did nothing and the run went on to ship (issue 57, item 9); a thread that
forked us with SIGINT blocked hands on the mask the same way.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

from ..errors import Interrupted

HANDLED = (signal.SIGINT, signal.SIGTERM)
RECEIVED: list[int] = []  # this command's signals: typer hands main() only "130" back


def _raise(signum: int, frame: FrameType | None) -> None:
    RECEIVED.append(signum)
    raise Interrupted(signum)


def exit_code() -> int:
    """The code for the first signal this command got (130 when none: a bare
    KeyboardInterrupt)."""
    return 128 + RECEIVED[0] if RECEIVED else 130


def signal_name() -> str:
    return signal.Signals(RECEIVED[0]).name if RECEIVED else "SIGINT"


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """While active, SIGINT and SIGTERM raise `Interrupted` in the main thread; the
    previous handlers and mask come back after (main() also runs inside test processes)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; signals land there anyway
        return
    RECEIVED.clear()
    old = {s: signal.signal(s, _raise) for s in HANDLED}
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, h in old.items():
            signal.signal(s, h)
