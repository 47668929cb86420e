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
from .schema import Recipe


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The schema class whose field the last part of `loc` names (lists and unions seen
    through), or None."""
    model: type[BaseModel] | None = Recipe
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
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
        errs = sorted(e.errors(), key=lambda x: x.get("type") != "extra_forbidden")
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


def load_recipe(path: Path | str) -> Recipe:
    p = find_recipe(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise RecipeError(
            f"cannot read the recipe ({e.strerror})", path=str(p), hint="check the path"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"not valid YAML: {e}", path=str(p), hint="fix the YAML syntax") from None
    return parse_recipe(data, path=str(p))
