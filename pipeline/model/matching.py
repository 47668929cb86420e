"""Module targets matched exactly as llm-compressor and compressed-tensors match them.

`re:<regex>` is `re.match` against the module name (anchored at the start only), anything
else is an exact module name or a module class name (`Linear`). Recipes, the plan, the
post-save check and `qship verify` all match through here, so they cannot disagree with
the engine that writes the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def matches(name: str, module: Any, targets: Iterable[str], ignore: Iterable[str] = ()) -> bool:
    from compressed_tensors.utils.match import is_match

    return bool(is_match(name, module, list(targets), list(ignore)))


def compact_targets(names: list[str], universe: list[str]) -> list[str]:
    """Targets that match exactly `names` among `universe` (all Linear module names): one
    regex with the layer and expert indices generalized when that is exact (a config group
    of 18,000 expert names becomes one line), else the names themselves."""
    import re

    if not names:
        return []
    shapes = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(n)) for n in names})
    pattern = "(?:" + "|".join(shapes) + ")$" if len(shapes) > 1 else shapes[0] + "$"
    rx = re.compile(pattern)
    if {n for n in universe if rx.match(n)} == set(names):
        return [f"re:{pattern}"]
    return sorted(names)
