"""`qship compare`: several recipes on one model, side by side.

Three entry points, one report (report.py, plots.py, html.py, output.py):

* `compare(model, recipes, out)` -- in process: the recipe check, fetch and token sets
  once, then per recipe the runner's quantize -> evaluate -> gate stages through the
  shared stage cache, so the fetch, the token sets and the reference log-probs (one
  reference pass per model and held-out set) are computed once for all recipes. Each
  recipe's eval.json goes to `<out>/recipes/<name>/`; the report is built from those
  files exactly as `--collect` builds it, so both give the same numbers.
* `matrix(recipes)` -- a GitHub Actions matrix, one job per recipe.
* `collect(paths, out)` -- merge the eval.json files that matrix jobs produced.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import GateFailed, UsageError
from ..io.pins import checksums_dir as pin_folder
from ..records.base import Record
from ..records.evaluation import EvalFile
from . import baseline
from .output import REPORT_FILES, write_report
from .report import SUPPORT_HEADROOM
from .rows import EVAL_FILE, row_from_file, unavailable_row

REPORT_SUFFIX = ".report"  # `qship run --out X` writes the artifact X and its report X.report


# ------------------------------------------------------------------ matrix


def recipe_paths(recipes: list[Path] | None, recipes_dir: Path | None = None) -> list[Path]:
    """The given recipe files, or every shipped recipe (./recipes when there is one, else
    qship's own) when none is given."""
    from ..recipe import SHIPPED_RECIPES

    if recipes:
        return [Path(r) for r in recipes]
    if recipes_dir is None:
        recipes_dir = Path("recipes") if Path("recipes").is_dir() else SHIPPED_RECIPES
    found = sorted(Path(recipes_dir).glob("*.yaml"))
    if not found:
        raise UsageError(
            "no recipes given and none found", path=str(recipes_dir), hint="pass --recipes R1 R2 …"
        )
    return found


def matrix(
    recipes: list[Path] | None, *, device: str | None = None, baselines: list[str] | None = None
) -> dict:
    """{"include": [{"recipe": path, "name": recipe name}, ...]} for `fromJSON` in a
    workflow. Every recipe is loaded (an invalid one fails here, exit 2, before any job
    starts) and names must be unique, as they name the jobs' artifacts. Without recipes:
    every shipped recipe the runner's device can afford (AutoRound only with --device
    cuda). Each baseline is one more job, {"recipe": the first recipe (its held-out
    tokens and evaluation), "name": baseline, "baseline": baseline}, for `qship compare
    --baselines-only`."""
    from ..recipe import load_recipe

    include = []
    seen: dict[str, str] = {}
    gpu = (device or "cpu").startswith("cuda")
    for p in recipe_paths(recipes):
        r = load_recipe(p)
        if not recipes and r.needs_gpu() and not gpu:
            continue
        if r.name in seen:
            raise UsageError(
                f"recipes {seen[r.name]} and {p} are both named {r.name!r}",
                path=str(p),
                hint="give every recipe its own `name:`",
            )
        seen[r.name] = str(p)
        include.append({"recipe": p.as_posix(), "name": r.name})
    for b in baselines or []:
        baseline.get(b)
        if not include:
            raise UsageError(f"baseline {b} is measured on a recipe's held-out tokens, and "
                             "there is no recipe", path="--baseline",
                             hint="pass at least one recipe beside --baseline")  # fmt: skip
        if b in seen:
            raise UsageError(f"{b} is named twice ({seen[b]})", path="--baseline",
                             hint="name each baseline once; no recipe may take its name")  # fmt: skip
        seen[b] = b
        include.append({"recipe": include[0]["recipe"], "name": b, "baseline": b})
    return {"include": include}


def find_eval_files(paths: list[Path]) -> list[Path]:
    """eval.json files: each path is a file, or a folder searched recursively (a download of
    several CI artifacts is one folder per artifact). Of an artifact X and its report
    folder X.report (both hold the evaluation), only X.report/eval.json is taken."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found = sorted(p.rglob(EVAL_FILE))
            if not found:
                raise UsageError(
                    f"no {EVAL_FILE} under {p}",
                    path=str(p),
                    hint="point --collect at the downloaded job artifacts",
                )
            out += found
        else:
            raise UsageError(f"{p} does not exist", path=str(p), hint="check the path")
    have = {f.resolve() for f in out}
    return [
        f
        for f in out
        if f.parent.name.endswith(REPORT_SUFFIX)
        or (_pair(f.parent) / EVAL_FILE).resolve() not in have
    ]


def _pair(d: Path) -> Path:
    n = d.name
    return d.with_name(n[: -len(REPORT_SUFFIX)] if n.endswith(REPORT_SUFFIX) else n + REPORT_SUFFIX)


class CompareResult(Record):
    out: Path
    files: list[str]
    recipes: list[str]
    passed: list[str]
    """Recipes whose gate passed."""
    best: str | None
    """Lowest mean KL among the passing recipes (tie: fewer bits per weight)."""
    best_dir: str | None
    """Where the best recipe's artifact or checkpoint is."""
    best_by_width: dict[str, str] = {}
    pareto_bits_vs_kl: list[str] = []
    supported_limits: dict[str, dict[str, float]] = {}
    """Per recipe, the gate limits its measurement on this model supports
    (`report.supported_limits`): set gates from these, not another model's."""

    def summary(self) -> str:
        limits = [f"\n  {name}: " + ", ".join(f"{g} {v:g}" for g, v in lim.items())
                  for name, lim in self.supported_limits.items() if lim]  # fmt: skip
        return (
            f"compared {len(self.recipes)} recipes ({len(self.passed)} passed their gates); "
            f"best: {self.best or 'none'}"
            + (f" ({self.best_dir})" if self.best_dir else "")
            + f"; report: {self.out / 'compare.html'}"
            + (f"\nlimits these rows support on this model ({SUPPORT_HEADROOM:.0%} more loss "
               "than measured):"
               + "".join(limits) if limits else "")
        )  # fmt: skip

    def require_pass(self) -> CompareResult:
        """GateFailed (exit 4) when no recipe passed: nothing to ship. The report is written."""
        if self.best is None:
            raise GateFailed(
                f"no recipe passed its quality gate ({', '.join(self.recipes)})",
                path=str(self.out / "compare.md"),
                hint="read the gate column of the report; loosen a recipe or add a better one",
                result=self,
            )
        return self


def _result(out: Path, rows: list[dict], sources: dict[str, str]) -> CompareResult:
    report = write_report(rows, out)
    best = report["best"]
    return CompareResult(
        out=out,
        files=[f for f in REPORT_FILES if (out / f).is_file()],
        recipes=report["recipes"],
        passed=[r["name"] for r in report["rows"] if r.get("passed") is True],
        best=best,
        best_dir=sources.get(best) if best else None,
        best_by_width=report["best_by_width"],
        pareto_bits_vs_kl=report["pareto_bits_vs_kl"],
        supported_limits=report["supported_limits"],
    )


def _artifact_dir(eval_file: Path) -> str:
    """Where the recipe's checkpoint/artifact is: X for X.report/eval.json when X exists."""
    d = eval_file.parent
    if d.name.endswith(REPORT_SUFFIX) and _pair(d).is_dir():
        return str(_pair(d))
    return str(d)


def collect(paths: list[Path], out: Path) -> CompareResult:
    """Merge eval.json files (CI matrix jobs) into the report in `out`."""
    files = find_eval_files(paths)
    rows = [row_from_file(p) for p in files]
    sources = {r["name"]: _artifact_dir(f) for r, f in zip(rows, files, strict=True)}
    return _result(Path(out), rows, sources)


# ------------------------------------------------------------------ in process


def _check_same_heldout(hashes: dict[str, str]) -> None:
    if len(set(hashes.values())) > 1:
        a, b = sorted(hashes)[:2]
        raise UsageError(
            "recipes are evaluated on different held-out tokens, so their KL figures do not "
            f"compare ({a}: {hashes[a][:12]}, {b}: {hashes[b][:12]})",
            path=b,
            hint="give every recipe the same `calibration.source` and `evaluation` "
            "sequences / seq_len",
        )


def compare(
    model: str | Path,
    recipes: list[Path],
    out: Path,
    *,
    cache_dir: Path,
    device: str | None = None,
    exact: bool = False,
    checksums_dir: Path | None = None,
    serve: str | None = None,
    perf_raw: Path | None = None,
    baselines: list[str] | None = None,
    baselines_only: bool = False,
) -> CompareResult:
    """Quantize, evaluate and gate every recipe on one model; write the report to `out`.
    `baselines` (baseline.BASELINES: bnb-nf4, bnb-int8): rows without a recipe, measured by
    the same evaluator on the first recipe's held-out tokens (the same for every recipe);
    without bitsandbytes each says why instead. `baselines_only`: the recipes give their
    held-out tokens and evaluation settings only (a CI matrix job for a baseline).
    `serve="vllm"`: each recipe also served (its served check) and its served speed and
    memory measured beside the 16-bit model (the reference measured once).

    A recipe whose gate fails is reported, not an error; `CompareResult.require_pass()`
    decides the exit code. A re-run with the same inputs quantizes nothing. `exact`: the
    full-vocabulary KL (slower) instead of the cached top-k + tail bound.
    """
    from .. import runner
    from ..evaluate import write_outputs
    from ..recipe import load_recipe

    out = Path(out)
    loaded = [load_recipe(p) for p in recipes]
    for b in baselines or []:
        baseline.get(b)  # an unknown name is exit 2 before any compute
    matrix(list(recipes))  # unique names, before any compute
    ctx = runner.Context(Path(cache_dir), device=device, exact_kl=exact,
                         checksums_dir=pin_folder(checksums_dir), perf=serve is not None,
                         serve_engine=serve,
                         perf_raw=perf_raw or (Path(out) / "perf-raw" if serve else None))  # fmt: skip
    for r in loaded:  # every recipe against the model's config, before any download
        runner.check_recipe(str(model), r, ctx, show_plan=False)
    snap = runner.fetch_stage(str(model), ctx)
    tokens = {r.name: runner.tokens_stage(snap, r, ctx) for r in loaded}
    _check_same_heldout({n: t.heldout_hash for n, t in tokens.items()})
    evdata = {r.name: runner.eval_data_stage(snap, r, tokens[r.name], ctx) for r in loaded}

    files: list[Path] = []
    for path, r in [] if baselines_only else zip(recipes, loaded, strict=True):
        ts = tokens[r.name]
        qc, _key, report, verdict = runner.measure(snap, r, ts, evdata[r.name], ctx)
        rdir = out / "recipes" / r.name
        ev = EvalFile.of(report, verdict=verdict, quantize=qc.brief(Path(path).as_posix()))
        write_outputs(ev, rdir)
        files.append(rdir / EVAL_FILE)
    first = loaded[0]
    why = baseline.unavailable()
    missing = [unavailable_row(b, why) for b in baselines or []] if why else []
    for b in [] if why else baselines or []:
        ev = baseline.measure(b, snap, first, tokens[first.name], evdata[first.name], ctx)
        write_outputs(ev, out / "baselines" / b)
        files.append(out / "baselines" / b / EVAL_FILE)
    rows = [row_from_file(f) for f in files]
    sources = {row["name"]: str(f.parent) for row, f in zip(rows, files, strict=True)}
    return _result(out, rows + missing, sources)
