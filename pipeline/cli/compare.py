"""qship compare, qship sensitivity"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError
from .common import (
    CacheOpt,
    ChecksumsOpt,
    DeviceOpt,
    JsonOpt,
    OneLineJson,
    PaperDeviceOpt,
    VerboseOpt,
    cache_root,
)


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
    exact: Annotated[
        bool, typer.Option("--exact/--cached", help="Full-vocabulary KL (slower) or top-k + tail.")
    ] = False,
    serve: Annotated[
        str | None,
        typer.Option(
            "--serve",
            help="vllm: also serve each recipe (the served check) and "
            "measure its served speed and memory beside the 16-bit model with "
            "vLLM's benchmark, on the recipe's serve.workloads or the defaults.",
        ),
    ] = None,  # fmt: skip
    perf_raw: Annotated[
        Path | None,
        typer.Option(
            "--perf-raw", help="Keep each benchmark pass's raw JSON here (default: OUT/perf-raw)."
        ),
    ] = None,  # fmt: skip
    baseline: Annotated[
        list[str] | None,
        typer.Option(
            "--baseline",
            help="Also a row without a recipe, the model loaded with a transformers "
            "quantization config: bnb-nf4, bnb-int8 (repeatable; needs bitsandbytes, "
            "`pip install 'qship[bnb]'`; not servable by vLLM's fast kernels).",
        ),
    ] = None,  # fmt: skip
    baselines_only: Annotated[
        bool,
        typer.Option(
            "--baselines-only",
            help="Measure only the --baseline rows, on the recipes' held-out tokens "
            "(a CI matrix job; --matrix --baseline lists one).",
        ),
    ] = False,
    device: PaperDeviceOpt = None,  # --matrix only names it; a comparison needs it here
    checksums: ChecksumsOpt = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> object:
    """Compare recipes on one model: md/json/csv/html report with plots; CI matrix/collect."""
    from ..compare import compare as cmp
    from ..model.devices import check_device

    if matrix:
        return OneLineJson(
            cmp.matrix((recipes or []) + (items or []), device=device, baselines=baseline)
        )
    if collect:
        res = cmp.collect(collect + (items or []), out)
    else:
        if not model:
            raise UsageError("--model is required (or use --matrix / --collect)", path="--model")
        check_device(device)
        paths = cmp.recipe_paths((recipes or []) + (items or []))
        if serve not in (None, "vllm"):
            raise UsageError(f"--serve {serve}: served speed is measured with vllm",
                             path="--serve", hint="use --serve vllm")  # fmt: skip
        res = cmp.compare(model, paths, out, cache_dir=cache_root(cache_dir), device=device,
                          exact=exact, checksums_dir=checksums, serve=serve,
                          perf_raw=perf_raw, baselines=baseline,
                          baselines_only=baselines_only)  # fmt: skip
    return res if baselines_only else res.require_pass()


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
    checksums: ChecksumsOpt = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> object:
    """KL when each quantized module alone is rounded (RTN): where the bits matter."""
    from ..compare.sensitivity import run

    return run(model, recipe, cache_dir=cache_root(cache_dir), device=device, sequences=sequences,
               out=out, write_recipe=write_recipe, max_bits=max_bits,
               checksums_dir=checksums)  # fmt: skip


def tune_cmd(
    model: Annotated[str, typer.Option("--model", help="Source model (as for run).")],
    recipe: Annotated[
        Path, typer.Option("--recipe", help="Base recipe: methods, options, data, gates.")
    ],
    write_recipe: Annotated[
        Path, typer.Option("--write-recipe", help="Where the tuned recipe goes (a new file).")
    ],
    max_bits: Annotated[
        float | None, typer.Option("--max-bits", help="Bits per quantized weight, at most.")
    ] = None,
    max_kl: Annotated[
        float | None,
        typer.Option("--max-kl", help="Verified mean KL, at most: the fewest bits that reach it."),
    ] = None,
    options: Annotated[
        str | None,
        typer.Option(
            "--options",
            help="Schemes a module may take, e.g. w4g128,w8g128 (default: int4 g128, g64, "
            "g32 and int8 g128).",
        ),
    ] = None,
    sequences: Annotated[
        int, typer.Option("--sequences", help="Calibration windows the sensitivity is measured on.")
    ] = 16,
    out: Annotated[Path, typer.Option("--out", help="Report folder.")] = Path("tune"),
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Quantize and evaluate base and tuned.")
    ] = True,
    exact: Annotated[
        bool, typer.Option("--exact/--cached", help="Full-vocabulary KL in the verification.")
    ] = True,
    device: DeviceOpt = None,
    checksums: ChecksumsOpt = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> object:
    """Allocate bits and group sizes per module within a budget; write and verify the recipe."""
    from ..compare.tune import parse_options, run

    res = run(model, recipe, write_recipe=write_recipe, out=out, cache_dir=cache_root(cache_dir),
              device=device, max_bits=max_bits, max_kl=max_kl,
              options=parse_options(options) if options is not None else None,
              sequences=sequences, verify=verify, exact=exact, checksums_dir=checksums)  # fmt: skip
    return res.require_met()
