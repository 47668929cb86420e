"""Verdict: what the gate hands on -- each configured check, its value and limit."""

from __future__ import annotations

from typing import Literal

from pydantic import computed_field

from .base import Record


class Check(Record):
    name: str
    """The gate, e.g. kl_mean_max or tasks.hellaswag.max_drop."""
    value: float | None
    """The measured value (null when it could not be measured: the check fails)."""
    limit: float
    """The recipe's limit."""
    op: Literal["<=", ">="]
    """How value compares with limit."""
    passed: bool
    """The check held."""
    note: str | None = None
    """Why a value is missing, or what was compared."""


class Verdict(Record):
    passed: bool
    """True when every check passed (also when no gate is configured)."""
    checks: list[Check] = []
    """One per configured gate, in the recipe's order (metric gates, then tasks)."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def failed(self) -> list[str]:
        """Names of the failed checks."""
        return [c.name for c in self.checks if not c.passed]

    def summary(self) -> str:
        head = "gate PASSED" if self.passed else "gate FAILED"
        if not self.checks:
            head += " (no gates configured)"
        rows = [
            f"  {'ok  ' if c.passed else 'FAIL'} {c.name:<28} {_fmt(c.value):>10} "
            f"{c.op} {_fmt(c.limit)}" + (f"  ({c.note})" if c.note else "")
            for c in self.checks
        ]
        return "\n".join([head, *rows])


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"
