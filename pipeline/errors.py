"""Exception types, one per exit-code class of the CLI contract (README.md, "Exit codes").

    0 success · 1 unexpected error · 2 usage error or invalid recipe/config
    3 integrity failure (checksum, signature, unsafe or malformed file)
    4 quality gate failed
    5 transient failure (network unreachable, timeout, HTTP 429/5xx after retries, a lock
      held too long, the disk full): the same command may succeed later -- CI jobs retry on it
    130 interrupted (SIGINT, Ctrl-C) · 143 terminated (SIGTERM: a CI job cancelled or timed out)

Messages name the file, the field or module, expected vs actual, and the fix.
"""

from __future__ import annotations

from typing import Any


class QshipError(Exception):
    """Base class; `exit_code` is what the CLI returns for it."""

    exit_code = 1

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        hint: str | None = None,
        result: Any = None,
    ):
        self.message = message
        self.path = str(path) if path is not None else None
        self.hint = hint
        # what the command produced before it failed (a record with to_json()): the CLI's
        # one --json object carries it under "result"
        self.result = result
        super().__init__(str(self))

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        if self.hint:
            text += f"\n  fix: {self.hint}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "error": type(self).__name__,
            "exit_code": self.exit_code,
            "message": self.message,
            "path": self.path,
            "hint": self.hint,
        }


class StageError(QshipError):
    """Unexpected failure inside a stage (a library crashed, a check after saving failed)."""

    exit_code = 1


class UsageError(QshipError):
    """Bad command line, recipe or config."""

    exit_code = 2


class RecipeError(UsageError):
    """The recipe YAML is invalid (schema, overlap, unmatched target, dtype ...)."""


class IntegrityError(QshipError):
    """A checksum, size, signature or file-safety check failed: fail closed."""

    exit_code = 3


class GateFailed(QshipError):
    """The quality gate rejected the candidate."""

    exit_code = 4


class TransientError(QshipError):
    """The network or the host failed in a way that may pass: retrying later can succeed."""

    exit_code = 5


class DiskFull(TransientError):
    """No space (or quota, or file-size limit) left while writing a result; what was being
    written is removed, so the same command can pass once space is freed."""


class Interrupted(KeyboardInterrupt):
    """A signal that ends the command (`pipeline.cli` raises it from its handlers): SIGINT
    exits 130, SIGTERM 143 (the shell's 128 + signal). A KeyboardInterrupt, so every
    cleanup that a Ctrl-C runs (temp folders removed, children terminated) runs for both,
    and no `except Exception` can turn it into a retry."""

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(self.name)


def interrupt_exit_code(err: BaseException) -> int:
    """130 for a plain KeyboardInterrupt, else its signal's code."""
    return getattr(err, "exit_code", 130)
