"""qship compare, qship sensitivity"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError
from .common import CacheOpt, DeviceOpt, JsonOpt, OneLineJson, cache_root


def compare_cmd(
    items: Annotated[
        list[Path] | None, typer.Argument(help="More recipes (or, with --collect, more dirs).")
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="Source model (as for run).")] = None,
    recipes: Annotated[
        list[Path] | None, typer.Option("--recipes", help="Recipe YAMLs: --recipes R1 R2 …")
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="Report directory.")] = Path("compare"),
    matrix: Annotated[
        bool, typer.Option("--matrix", help="Print a GitHub Actions matrix, one job per recipe.")
    ] = False,
    collect: Annotated[
        list[Path] | None,
        typer.Option("--collect", help="Merge eval.json files under DIR… (CI jobs' results)."),
    ] = None,
    device: DeviceOpt = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
) -> object:
    """Compare recipes on one model: md/json/csv/html report with plots; CI matrix/collect."""
    from ..compare import compare as cmp

    if matrix:
        return OneLineJson(cmp.matrix((recipes or []) + (items or [])))
    if collect:
        res = cmp.collect(collect + (items or []), out)
    else:
        if not model:
            raise UsageError("--model is required (or use --matrix / --collect)", path="--model")
        paths = cmp.recipe_paths((recipes or []) + (items or []))
        res = cmp.compare(model, paths, out, cache_dir=cache_root(cache_dir), device=device)
    return res.require_pass()


def sensitivity_cmd(
    model: Annotated[str, typer.Option("--model", help="Source model (as for run).")],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML (schemes, held-out set).")],
    sequences: Annotated[
        int | None, typer.Option("--sequences", help="Score only the first N held-out sequences.")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the result JSON here.")] = None,
    write_recipe: Annotated[
        Path | None,
        typer.Option(
            "--write-recipe", help="Write the recipe with the most sensitive modules at int8."
        ),
    ] = None,
    max_bits: Annotated[
        float | None, typer.Option("--max-bits", help="Bits-per-weight budget for --write-recipe.")
    ] = None,
    device: DeviceOpt = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
) -> object:
    """KL when each quantized module alone is rounded (RTN): where the bits matter."""
    from ..compare.sensitivity import run

    return run(model, recipe, cache_dir=cache_root(cache_dir), device=device, sequences=sequences,
               out=out, write_recipe=write_recipe, max_bits=max_bits)  # fmt: skip
