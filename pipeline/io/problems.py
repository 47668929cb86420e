"""Collect every problem of a check, then fail once with all of them listed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, QshipError

MAX_JSON_BYTES = 64 * 1024 * 1024
SHOWN = 25  # problems listed in one message; the rest are counted


class Problems:
    """(relative file, message) pairs under `root`; `raise_if_any` raises `error` whose path
    is the first offending file and whose message lists them."""

    def __init__(self, root: Path, *, error: type[QshipError] = IntegrityError, hint: str = ""):
        self.root, self.error, self.hint = Path(root), error, hint
        self.items: list[tuple[str, str]] = []

    def add(self, rel: str, msg: str) -> None:
        self.items.append((rel, msg))

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self, what: str) -> None:
        if not self.items:
            return
        listing = "\n".join(f"  - {rel}: {msg}" for rel, msg in self.items[:SHOWN])
        if len(self.items) > SHOWN:
            listing += f"\n  … and {len(self.items) - SHOWN} more"
        raise self.error(
            f"{what} failed for {len(self.items)} problem(s):\n{listing}",
            path=str(self.root / self.items[0][0]),
            hint=self.hint or None,
        )


def read_json_object(path: Path, problems: Problems, rel: str) -> dict[str, Any] | None:
    """A JSON object from `path`, or None with the reason added to `problems`."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            problems.add(rel, f"larger than {MAX_JSON_BYTES} bytes")
            return None
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        problems.add(rel, f"not valid JSON ({type(e).__name__}: {str(e)[:120]})")
        return None
    if not isinstance(obj, dict):
        problems.add(rel, "not a JSON object")
        return None
    return obj
