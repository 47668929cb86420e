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
