"""qship's own output on the terminal, and where every library's output goes instead.

qship prints a line per stage with its time, short summaries, and during a long step a live
bar with what it is doing and an ETA (at a terminal) or a plain line at most once a minute
(CI logs: no carriage returns). Everything else -- Python warnings, library loggers, tqdm
bars, llm-compressor's loguru records, C++ warnings written to fd 2, a child process's
stderr -- goes to a log file while `third_party_to(path)` is active, unless verbose (`-v`),
in which case it all stays on the terminal. `detail()` lines are qship's own debugging
lines: in the log file, or on the terminal when verbose.

stdout is never written here: it is reserved for the `--json` result.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.text import Text

_console = Console(stderr=True, highlight=False, soft_wrap=True)
_detail = logging.getLogger("qship")
_detail.addHandler(logging.NullHandler())
_detail.propagate = False
_detail.setLevel(logging.INFO)
# without a terminal: a progress line at most this often, and a "still running" line at
# least this often in any stage or child process that prints nothing of its own
PLAIN_EVERY_S = float(os.environ.get("QSHIP_PROGRESS_EVERY", "60"))
_last_line = time.monotonic()  # when qship last printed a line of its own
_beating: list[object] = []  # the heartbeats running, innermost last
CHILD_GRACE_S = 10.0  # how long an interrupted child may take to exit after SIGTERM


def console() -> Console:
    return _console


def info(text: str | Text, style: str | None = None) -> None:
    """One line of qship's own output (stderr)."""
    global _last_line
    _last_line = time.monotonic()
    _console.print(text if isinstance(text, Text) else Text(text, style=style or ""))


@contextlib.contextmanager
def heartbeat(label: str) -> Iterator[None]:
    """Without a terminal, `  label: still running (3m00s)` whenever qship has printed no
    line for PLAIN_EVERY_S, so that a CI log shows a long step is alive (a terminal has
    its live bars)."""
    if _console.is_terminal:
        yield
        return
    stop = threading.Event()
    t0 = time.monotonic()
    me = object()
    _beating.append(me)

    def beat() -> None:
        while not stop.wait(min(PLAIN_EVERY_S / 4, 5.0)):
            # the innermost step speaks: "lm-eval …", not the stage around it
            if _beating[-1] is me and time.monotonic() - _last_line >= PLAIN_EVERY_S:
                info(f"  {label}: still running ({_fmt_s(time.monotonic() - t0)})")

    t = threading.Thread(target=beat, name=f"heartbeat {label}", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        _beating.remove(me)


def run_child(cmd: list[str], *, label: str, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, timeout: float | None = None,
              ) -> tuple[int, str]:  # fmt: skip
    """Run a child process with its output (stdout and stderr) copied line by line to this
    process's stderr -- the log file while `third_party_to` is active, the terminal with -v
    -- and a heartbeat while it runs. -> (exit code, the last 200 lines of its output).
    subprocess.TimeoutExpired after `timeout` seconds; then, or when this process is
    interrupted (SIGINT, SIGTERM), the child is stopped (`stop_child`) before it raises."""
    import collections
    import subprocess

    tail: collections.deque[str] = collections.deque(maxlen=200)
    with heartbeat(label):
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")  # fmt: skip
        assert proc.stdout is not None

        def copy() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line)
                sys.stderr.write(line)

        reader = threading.Thread(target=copy, name=f"output of {label}", daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except BaseException:  # interrupted (SIGINT/SIGTERM), timed out: the child goes too
            stop_child(proc)
            raise
        finally:
            reader.join(timeout=10)
    sys.stderr.flush()
    return rc, "".join(tail)


def stop_child(proc: Any, grace_s: float = CHILD_GRACE_S) -> None:
    """SIGTERM to a child (vLLM frees its GPU memory and its own workers on it), SIGKILL
    after `grace_s` seconds if it is still there."""
    import subprocess

    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def detail(text: str) -> None:
    """A line for the log file (the terminal only with -v)."""
    _detail.info(text)


def _fmt_s(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    m, s = divmod(int(round(s)), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


# ------------------------------------------------------------------ stages


class StageLine:
    """What a stage says when it ends: `note` (one line) and whether it came from the cache."""

    def __init__(self, name: str):
        self.name = name
        self.note = ""
        self.cached = False
        self.t0 = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0


@contextlib.contextmanager
def stage(name: str) -> Iterator[StageLine]:
    """`✓ name  note  (12.3 s)` when the block ends, `✗ name failed after …` when it raises."""
    line = StageLine(name)
    try:
        with heartbeat(name):
            yield line
    except BaseException:
        info(Text.assemble(("✗ ", "red bold"), f"{name:<9} failed after {_fmt_s(line.seconds)}"))
        raise
    when = "cached" if line.cached else _fmt_s(line.seconds)
    info(
        Text.assemble(
            ("✓ ", "green bold"), (f"{name:<9} ", "bold"), line.note, (f"  ({when})", "dim")
        )
    )


# ------------------------------------------------------------------ progress


class Progress:
    """A live bar at a terminal, a plain line at most every PLAIN_EVERY_S seconds elsewhere.

    `update(done, note)` / `advance(n)` from any thread; `close()` (or `with`) ends it.
    With `nbytes=True` the counts are bytes and the bar shows MB/s."""

    def __init__(self, label: str, total: int | None, *, unit: str = "", nbytes: bool = False):
        self.label, self.total, self.unit, self.nbytes = label, total, unit, nbytes
        self.done = 0
        self._lock = threading.Lock()
        self._t0 = self._last = time.perf_counter()
        self._rich: Any = None
        if _console.is_terminal:
            from rich import progress as rp

            cols: list[Any] = [rp.TextColumn("  {task.description}"), rp.BarColumn()]
            if nbytes:
                cols += [rp.DownloadColumn(), rp.TransferSpeedColumn()]
            else:
                cols += [rp.MofNCompleteColumn(), rp.TextColumn(unit)]
            cols += [rp.TimeRemainingColumn(), rp.TextColumn("{task.fields[note]}", style="dim")]
            self._rich = rp.Progress(*cols, console=_console, transient=True)
            self._rich.start()
            self._task = self._rich.add_task(label, total=total, note="")

    def update(self, done: int, note: str = "") -> None:
        with self._lock:
            self.done = done
            if self._rich is not None:
                self._rich.update(self._task, completed=done, note=note)
                return
            now = time.perf_counter()
            if now - self._last < PLAIN_EVERY_S:
                return
            self._last = now
            info(self._plain(now, note))

    def advance(self, n: int) -> None:
        self.update(self.done + n)

    def _plain(self, now: float, note: str) -> str:
        el = now - self._t0
        if self.nbytes:
            mb = self.done / 1e6
            of = f" of {self.total / 1e6:.0f}" if self.total else ""
            text = f"{mb:.0f}{of} MB, {mb / max(el, 1e-9):.0f} MB/s"
        else:
            text = f"{self.done}/{self.total} {self.unit}".rstrip()
        eta = ""
        if self.total and 0 < self.done < self.total:
            eta = f", ETA {_fmt_s(el * (self.total - self.done) / self.done)}"
        return f"  {self.label}: {text} ({_fmt_s(el)}{eta})" + (f" {note}" if note else "")

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ third-party output


def _stream_handlers() -> list[logging.StreamHandler[Any]]:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    return [
        h
        for lg in loggers
        if lg is not _detail
        for h in lg.handlers
        if type(h) is logging.StreamHandler
    ]


@contextlib.contextmanager
def third_party_to(log_path: Path | None, *, verbose: bool = False) -> Iterator[Path | None]:
    """Send every library's output to `log_path` for the duration of the block (qship's own
    lines keep the terminal). Verbose, or no path: leave it all on the terminal and show
    `detail()` lines there too."""
    global _console
    if verbose or log_path is None:
        h: logging.Handler = logging.StreamHandler(_ConsoleWriter())
        _detail.addHandler(h)
        # stdout stays reserved for --json: what libraries print there (llm-compressor's
        # loguru sink is sys.stdout when it is set up) goes to stderr instead
        old_out = sys.stdout
        saved_fd1 = _redirect_fd(1, 2)
        sys.stdout = sys.stderr
        try:
            yield None
        finally:
            sys.stdout = old_out
            _restore_fd(1, saved_fd1)
            _detail.removeHandler(h)
        return
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(log_path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    fh.write(f"--- qship {' '.join(sys.argv[1:])} ({time.strftime('%Y-%m-%d %H:%M:%S')})\n")
    file_handler: logging.Handler = logging.StreamHandler(fh)
    outer_handlers = list(_detail.handlers)  # an outer capture's log gets none of ours
    for h in outer_handlers:
        _detail.removeHandler(h)
    _detail.addHandler(file_handler)
    old_out, old_err, old_console = sys.stdout, sys.stderr, _console
    ours = old_console.file  # where qship's lines go now (a terminal, or an outer capture's)
    term: IO[str] | None = None
    try:  # a real fd 2 is about to point at the log: keep a copy of it for our own lines
        if ours.fileno() == 2:
            term = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    except (AttributeError, OSError, ValueError):  # an in-memory stream (tests): keep it
        term = None
    _console = Console(file=term or ours, highlight=False, soft_wrap=True)
    saved_fd2 = os.dup(2)
    swapped: list[tuple[logging.StreamHandler[Any], Any]] = []
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fh.fileno(), 2)
        sys.stdout = sys.stderr = fh
        for h in _stream_handlers():
            if h.stream in (old_out, old_err, sys.__stdout__, sys.__stderr__):
                swapped.append((h, h.setStream(fh)))
        yield log_path
    finally:
        for h, stream in swapped:
            h.setStream(stream)
        sys.stdout, sys.stderr = old_out, old_err
        os.dup2(saved_fd2, 2)
        os.close(saved_fd2)
        _console = old_console
        if term is not None:
            term.close()
        _detail.removeHandler(file_handler)
        for h in outer_handlers:
            _detail.addHandler(h)
        fh.close()


@contextlib.contextmanager
def traceback_to_log(expected: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """An unexpected error's traceback goes where library output goes now (inside
    `third_party_to`: its log file), once: the exception is marked as logged. `expected`
    ones (qship's own errors, usage errors) carry their message and need none."""
    import traceback

    try:
        yield
    except Exception as e:
        if not isinstance(e, expected) and not getattr(e, "_qship_logged", False):
            traceback.print_exc()
            e._qship_logged = True  # type: ignore[attr-defined]
        raise


def _redirect_fd(fd: int, to: int) -> int | None:
    """Point `fd` at `to` (a copy of the old one returned), or None when the streams are not
    real descriptors (pytest's capture)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(fd)
        os.dup2(to, fd)
        return saved
    except (OSError, ValueError):
        return None


def _restore_fd(fd: int, saved: int | None) -> None:
    if saved is not None:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


class _ConsoleWriter:
    """A file-like that writes `detail()` lines through the rich console (dimmed)."""

    def write(self, s: str) -> int:
        if s.strip():
            _console.print(Text(s.rstrip("\n"), style="dim"))
        return len(s)

    def flush(self) -> None:
        pass
