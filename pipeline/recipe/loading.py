"""Reading a recipe: the YAML file (found in the working directory or among qship's shipped
recipes), validated against the schema (schema.py), and a validation error turned into one
message naming the file, the field and the fix -- an unknown key first, with the closest
valid one."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import RecipeError
from .methods import METHODS, Method
from .schema import Recipe


def _is_tag(loc: tuple, i: int) -> bool:
    """Whether loc[i] is pydantic's union tag (a group's method), not a key of the YAML."""
    return i > 0 and isinstance(loc[i - 1], int) and loc[i] in METHODS


def _loc(loc: tuple) -> str:
    out = ""
    for i, part in enumerate(loc):
        if _is_tag(loc, i):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _method_error(err: Any) -> Any:
    """A group's unknown or missing `method` as the error of that key (the group union is
    told apart by it)."""
    allowed = [f"'{m}'" for m in typing.get_args(Method)]
    expected = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
    if err.get("type") == "union_tag_invalid":
        return {**err, "type": "literal_error", "loc": (*err["loc"], "method"),
                "msg": f"Input should be {expected}", "ctx": {"expected": expected}}  # fmt: skip
    if err.get("type") == "union_tag_not_found":
        return {**err, "type": "missing", "loc": (*err["loc"], "method"), "msg": "Field required"}
    return err


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The schema class whose field the last part of `loc` names (lists and unions seen
    through), or None."""
    model: type[BaseModel] | None = Recipe
    for i, part in enumerate(loc[:-1]):
        if isinstance(part, int) or model is None:
            continue
        if _is_tag(loc, i):
            model = METHODS[str(part)]
            continue
        f = model.model_fields.get(str(part))
        model = _inner_model(f.annotation) if f is not None else None
    return model


def _inner_model(tp: Any) -> type[BaseModel] | None:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _closest_key(loc: tuple) -> str | None:
    model = _model_at(loc)
    if model is None or not loc:
        return None
    keys = [f.alias or name for name, f in model.model_fields.items()]
    found = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    return found[0] if found else None


def _fix_for(err: Any) -> str:
    t = err.get("type", "")
    if t == "extra_forbidden":
        near = _closest_key(err["loc"])
        return (f"rename it to `{near}`, or delete this key" if near
                else "delete this key, or correct its spelling") + (
            " (the recipe keys: README.md, \"Recipes\", and pipeline/recipe/schema.py)")  # fmt: skip
    if t == "missing":
        return "add this required field"
    if t in ("less_than_equal", "less_than"):
        return ("use a value within the bound: it is set far above what a real run needs, so "
                "that a typo cannot exhaust memory or run for days")  # fmt: skip
    if t == "finite_number":
        return "write a finite number (NaN and infinity pass no comparison)"
    if t in ("greater_than", "greater_than_equal"):
        return "correct the value to one within the bound (outside it a limit means nothing)"
    if t.startswith("literal_error"):
        return f"use one of the allowed values ({err.get('ctx', {}).get('expected', '')})"
    return "correct the value as the message says"


def parse_recipe(data: Any, *, path: str = "<recipe>") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(
            "a recipe must be a YAML mapping at the top level",
            path=path,
            hint="start from recipes/gemma-mixed-w4.yaml",
        )
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        # an unknown key first: a typo (`group:`) also makes the real key look missing
        errs = sorted(map(_method_error, e.errors()),
                      key=lambda x: x.get("type") != "extra_forbidden")  # fmt: skip
        first = errs[0]
        field = _loc(first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            near = _closest_key(first["loc"])
            msg = "unknown key" + (f" (did you mean `{near}`?)" if near else "")
        more = f" (and {len(errs) - 1} more problem(s))" if len(errs) > 1 else ""
        raise RecipeError(
            f"field `{field}`: {msg}{more}",
            path=path,
            hint=_fix_for(first),
        ) from None
    recipe._path = path
    return recipe


# qship's own source tree (a checkout or an editable install): its shipped recipes/
SOURCE_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_RECIPES = SOURCE_ROOT / "recipes"


def find_recipe(path: Path | str) -> Path:
    """`path` as given when it exists; else a shipped recipe by the same relative path
    (`recipes/gptq-w4.yaml` from any working directory) or name (`gptq-w4`)."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    for cand in (SOURCE_ROOT / p, SHIPPED_RECIPES / p.name,
                 SHIPPED_RECIPES / f"{p.name}.yaml"):  # fmt: skip
        if cand.is_file():
            return cand
    return p


# A recipe is a page of text: bounds far above any real one (the shipped ones: < 8 KB, depth
# < 8), so that a wrong or hostile file is refused before the parser spends memory or stack
MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_ALIASES = 64  # YAML anchors re-used: each may expand a whole subtree (billion laughs)


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing what it would silently accept or crash on: a key
    written twice in one mapping (the last would win), nesting deeper than MAX_DEPTH
    (RecursionError) and more than MAX_ALIASES alias uses."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise yaml.MarkedYAMLError(None, None, f"more than {MAX_ALIASES} alias uses",
                                           self.peek_event().start_mark)  # fmt: skip
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise yaml.MarkedYAMLError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                       self.peek_event().start_mark)  # fmt: skip
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.MarkedYAMLError(
                    None, None, f"key {key!r} is written twice in this mapping (first on line "
                    f"{seen[key].line + 1}); the last value would silently win",
                    key_node.start_mark,
                )  # fmt: skip
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def read_recipe_yaml(p: Path) -> Any:
    """The YAML data of the recipe file `p`, read within the bounds above: exit 2 naming the
    file (and the line) for a file too large, not UTF-8, not YAML, or a key written twice."""
    try:
        size = p.stat().st_size
        if size > MAX_BYTES:
            raise RecipeError(f"the recipe is {size:,} bytes, more than the {MAX_BYTES:,} a "
                              "recipe may have", path=str(p), hint="a recipe is a page of "
                              "YAML: check that this is the file you meant")  # fmt: skip
        raw = p.read_bytes()
    except OSError as e:
        raise RecipeError(
            f"cannot read the recipe ({e.strerror})", path=str(p), hint="check the path"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise RecipeError(f"line {line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                          f"{e.start})", path=str(p), hint="save the recipe as UTF-8"
                          ) from None  # fmt: skip
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise RecipeError(f"{where}not valid YAML: {getattr(e, 'problem', None) or e}",
                          path=str(p), hint="fix the YAML at that line") from None  # fmt: skip


def load_recipe(path: Path | str) -> Recipe:
    p = find_recipe(path)
    return parse_recipe(read_recipe_yaml(p), path=str(p))
