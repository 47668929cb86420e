"""The one way qship replaces a library attribute: `patched(target, value)`, the target a
row of table.PATCHES, checked against the pinned signature first and restored on exit."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from importlib import metadata
from typing import Any

from ..errors import StageError
from .table import PATCHES, Patch

PINNED = "llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def row(target: str) -> Patch:
    """The table's row for `target` ("module:Owner.attr"); a target not in the table is a
    qship bug (every replacement is listed with why it exists and the test that holds it)."""
    for p in PATCHES:
        if p.target == target:
            return p
    raise StageError(f"{target} is not in pipeline/compat/table.py:PATCHES",
                     path=target, hint="add it there, with why and the test")  # fmt: skip


def owner(target: str) -> tuple[Any, str]:
    """(the object that holds the attribute, the attribute's name), imported now."""
    module, _, path = target.partition(":")
    *chain, attr = path.split(".")
    obj: Any = importlib.import_module(module)
    for name in chain:
        obj = getattr(obj, name)
    return obj, attr


def _refuse(p: Patch, what: str) -> StageError:
    dist = p.target.split(".")[0].replace("_", "-")
    return StageError(
        f"{dist} {_version(dist)}: {what}; qship's patch of it is written for the pinned version",
        path=p.target,
        hint=f"install the versions in constraints.txt ({PINNED}); qship's patches are "
        "written for those (pipeline/compat/table.py)",
    )


def check(target: str, obj: Any = None) -> Any:
    """The attribute as the pinned library has it: present and, for a function, taking
    exactly the table's parameters. Anything else is exit 1 naming the library and its
    version, instead of a patch that silently does nothing or breaks the library.
    `obj`: the holder when it is not importable by name (a test's stand-in)."""
    p = row(target)
    holder, attr = owner(target) if obj is None else (obj, p.attr)
    where = f"{getattr(holder, '__name__', type(holder).__name__)}.{attr}"
    private = getattr(holder, "__private_attributes__", {})
    if p.kind == "private" and attr in private:
        return private[attr]  # a pydantic private attribute: present on instances only
    if not hasattr(holder, attr):
        raise _refuse(p, f"has no {where}")
    own = getattr(holder, "__dict__", {})
    current = own[attr] if attr in own else getattr(holder, attr)
    if p.params is not None:
        got = tuple(inspect.signature(getattr(holder, attr)).parameters)
        if got != p.params:
            raise _refuse(p, f"{where} takes ({', '.join(got)}), expected "
                             f"({', '.join(p.params)})")  # fmt: skip
    return current


def original(target: str) -> Any:
    """The library's own value of a target, checked (what a replacement wraps)."""
    return check(target)


@contextlib.contextmanager
def patched(target: str, value: Any, *, obj: Any = None) -> Iterator[None]:
    """`target = value` inside the block, the library's own value put back after."""
    holder = owner(target)[0] if obj is None else obj
    attr = row(target).attr
    old = check(target, obj)
    setattr(holder, attr, value)
    try:
        yield
    finally:
        setattr(holder, attr, old)


def check_all() -> list[str]:
    """Every row checked against the installed libraries; -> the failures' messages."""
    bad = []
    for p in PATCHES:
        try:
            check(p.target)
        except StageError as e:
            bad.append(e.message)
    return bad
