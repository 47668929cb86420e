"""Progress lines on stderr for long loops, at most one every few seconds and one at the
end: CI logs show them where a terminal progress bar would not (fetch's byte bars are
rich, for people at a terminal)."""

from __future__ import annotations

import sys
import time


class Every:
    """`step(done)` after each unit of work prints `<prefix> done/total <unit> (t s)` when
    `seconds` have passed since the last line, and always when done == total."""

    def __init__(self, prefix: str, total: int, *, unit: str = "sequences", seconds: float = 10):
        self.prefix, self.total, self.unit, self.seconds = prefix, total, unit, seconds
        self.t0 = self.last = time.perf_counter()

    def step(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last > self.seconds or done >= self.total:
            self.last = now
            print(
                f"{self.prefix} {done}/{self.total} {self.unit} ({now - self.t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
