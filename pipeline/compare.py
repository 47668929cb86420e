"""`qship compare`: run several recipes on one model and report them side by side.

Three entry points, one report (pipeline.report):

* `compare(model, recipes, out)` -- in process: fetch once, then per recipe
  quantize -> evaluate -> gate through the shared stage cache, so the fetch, the token
  sets (cached by content hash) and the reference log-probs (one reference pass per
  model and held-out set) are computed once for all recipes. Each recipe's results go
  to `<out>/recipes/<name>/eval.json`; the report is built from those files, exactly as
  `--collect` builds it, so both give the same numbers.
* `matrix(recipes)` -- a GitHub Actions matrix, one job per recipe.
* `collect(paths, out)` -- merge the eval.json files that matrix jobs produced.

An eval.json carries evaluate's result, the gate's "verdict" and a "compare" block with
what the row needs from the quantize stage (see `compare_block`). Files written by other
commands lack that block; `collect` then takes the figures from a `quantize_report.json`
or `provenance.json` beside the eval.json, and leaves a figure empty when neither has it.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .devices import default_device
from .errors import GateFailed, UsageError
from .fsutil import atomic_write_text
from .report import REPORT_FILES, kl_histogram, row_from_eval, write_report

EVAL_FILE = "eval.json"


def _log(msg: str) -> None:
    print(f"qship compare: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ matrix


def recipe_paths(recipes: list[Path] | None, recipes_dir: Path = Path("recipes")) -> list[Path]:
    """The given recipe files, or every recipes/*.yaml when none is given."""
    if recipes:
        return [Path(r) for r in recipes]
    found = sorted(Path(recipes_dir).glob("*.yaml"))
    if not found:
        raise UsageError(
            "no recipes given and none found", path=str(recipes_dir), hint="pass --recipes R1 R2 …"
        )
    return found


def matrix(recipes: list[Path] | None) -> dict:
    """{"include": [{"recipe": path, "name": recipe name}, ...]} for `fromJSON` in a
    workflow. Every recipe is loaded (an invalid one fails here, exit 2, before any job
    starts) and names must be unique, as they name the jobs' artifacts."""
    from .recipe import load_recipe

    include = []
    seen: dict[str, str] = {}
    for p in recipe_paths(recipes):
        r = load_recipe(p)
        if r.name in seen:
            raise UsageError(
                f"recipes {seen[r.name]} and {p} are both named {r.name!r}",
                path=str(p),
                hint="give every recipe its own `name:`",
            )
        seen[r.name] = str(p)
        include.append({"recipe": p.as_posix(), "name": r.name})
    return {"include": include}


# ------------------------------------------------------------------ rows


def quantize_figures(report: dict | None) -> dict:
    """Row figures from quantize's report (QuantizeResult.report / quantize_report.json)."""
    if not isinstance(report, dict):
        return {}
    if isinstance(report.get("report"), dict):  # QuantizeResult.to_json()
        report = report["report"]
    ck = report.get("checkpoint") or {}
    peak = report.get("peak_memory") or {}
    t = report.get("timings") or {}
    return {
        k: v
        for k, v in {
            "name": report.get("recipe"),
            "recipe_hash": report.get("recipe_hash"),
            "bits_per_weight": ck.get("bits_per_weight_quantized"),
            "size_bytes": ck.get("bytes"),
            "quantize_s": t.get("total"),
            # GPU: peak allocated during this quantize; CPU: the process's peak RSS
            "peak_mem_bytes": peak.get("cuda_max_allocated_bytes", peak.get("peak_rss_bytes")),
            "peak_mem_kind": _peak_kind(peak),
        }.items()
        if v is not None
    }


def _peak_kind(peak: dict) -> str | None:
    if peak.get("cuda_max_allocated_bytes") is not None:
        return "cuda_max_allocated"
    return "process_peak_rss" if peak.get("peak_rss_bytes") is not None else None


def compare_block(
    *, name: str, recipe: str, quantize_report: dict | None, kl_tokens: Any = None
) -> dict:
    """The "compare" block stored in eval.json: everything the row needs besides evaluate's
    figures. `kl_tokens`: per-token KL values (any array-like) for the distribution plot."""
    block = {**quantize_figures(quantize_report), "name": name, "recipe": recipe}
    if kl_tokens is not None:
        block["kl_hist"] = kl_histogram(kl_tokens)
    return block


def _json(path: Path) -> dict | None:
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


REPORT_SUFFIX = ".report"  # `qship run --out X` writes the artifact X and the report X.report


def _pair(d: Path) -> Path:
    n = d.name
    return d.with_name(n[: -len(REPORT_SUFFIX)] if n.endswith(REPORT_SUFFIX) else n + REPORT_SUFFIX)


def _fallback_block(ev: dict, d: Path) -> dict:
    """Row figures for an eval.json without a "compare" block, from the files that
    `qship quantize` (quantize_report.json) and `qship run` (report dir: plan.json, run.json;
    artifact: provenance.json, recipe.yaml, *.safetensors) leave beside it."""
    dirs = [d] + ([_pair(d)] if _pair(d).is_dir() else [])

    def j(name: str) -> dict:
        for x in dirs:
            if (obj := _json(x / name)) is not None:
                return obj
        return {}

    block = quantize_figures(ev.get("quantize") or j("quantize_report.json"))
    plan, prov, run = j("plan.json"), j("provenance.json"), j("run.json")
    qprov = prov.get("quantize") if isinstance(prov.get("quantize"), dict) else {}
    peak = qprov.get("peak_memory") if isinstance(qprov.get("peak_memory"), dict) else {}
    stages = run.get("stages") if isinstance(run.get("stages"), list) else []
    qstage = next((s for s in stages if isinstance(s, dict) and s.get("stage") == "quantize"), {})
    recipe_name = None
    for x in dirs:
        if (x / "recipe.yaml").is_file():
            import yaml

            try:
                recipe_name = (yaml.safe_load((x / "recipe.yaml").read_text()) or {}).get("name")
            except yaml.YAMLError:
                pass
    weights = [p for x in dirs for p in x.glob("*.safetensors")]
    bpw = plan.get("bits_per_weight") if isinstance(plan.get("bits_per_weight"), dict) else {}
    fallback = {
        "name": plan.get("recipe_name")
        or qstage.get("recipe")
        or (prov["recipe"].get("name") if isinstance(prov.get("recipe"), dict) else None)
        or recipe_name,
        "recipe_hash": prov.get("recipe_sha256_resolved") or plan.get("recipe_hash"),
        "bits_per_weight": bpw.get("quantized"),
        # the artifact's weights when it exists (the gate passed), else the plan's estimate
        "size_bytes": sum(p.stat().st_size for p in weights)
        if weights
        else plan.get("expected_checkpoint_bytes"),
        "quantize_s": qprov.get("seconds"),
        "peak_mem_bytes": peak.get("cuda_max_allocated_bytes", peak.get("peak_rss_bytes")),
        "peak_mem_kind": _peak_kind(peak),
    }
    for k, v in fallback.items():
        if block.get(k) is None and v is not None:
            block[k] = v
    if not block.get("name"):
        n = d.name
        block["name"] = n[: -len(REPORT_SUFFIX)] if n.endswith(REPORT_SUFFIX) else n
    return block


def row_from_file(path: Path) -> dict:
    """A report row from one eval.json (its "compare" block, or the files beside it)."""
    path = Path(path)
    ev = _json(path)
    if ev is None:
        raise UsageError(
            f"{path} is not a readable JSON object",
            path=str(path),
            hint="pass eval.json files or the folders holding them",
        )
    if not isinstance(ev.get("compare"), dict):
        ev = {**ev, "compare": _fallback_block(ev, path.parent)}
    return row_from_eval(ev, source=None)


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


def _artifact_dir(eval_file: Path) -> str:
    """Where the recipe's checkpoint/artifact is: X for X.report/eval.json when X exists."""
    d = eval_file.parent
    if d.name.endswith(REPORT_SUFFIX) and _pair(d).is_dir():
        return str(_pair(d))
    return str(d)


@dataclass
class CompareResult:
    out: Path
    report: dict  # compare.json
    sources: dict[str, str] = field(default_factory=dict)  # recipe name -> folder of its eval.json

    @property
    def best(self) -> str | None:
        return self.report["best"]

    def to_json(self) -> dict:
        rows = self.report["rows"]
        return {
            "out": str(self.out),
            "files": [f for f in REPORT_FILES if (self.out / f).is_file()],
            "recipes": self.report["recipes"],
            "passed": [r["name"] for r in rows if r.get("passed") is True],
            "best": self.best,
            "best_dir": self.sources.get(self.best) if self.best else None,
            "pareto_bits_vs_kl": self.report["pareto_bits_vs_kl"],
        }

    def summary(self) -> str:
        j = self.to_json()
        return (
            f"compared {len(j['recipes'])} recipes ({len(j['passed'])} passed their gates); "
            f"best: {j['best'] or 'none'}"
            + (f" ({j['best_dir']})" if j["best_dir"] else "")
            + f"; report: {self.out / 'compare.html'}"
        )

    def require_pass(self) -> CompareResult:
        """GateFailed (exit 4) when no recipe passed: nothing to ship. The report is written."""
        if self.best is None:
            raise GateFailed(
                f"no recipe passed its quality gate ({', '.join(self.report['recipes'])})",
                path=str(self.out / "compare.md"),
                hint="read the gate column of the report; loosen a recipe or add a better one",
            )
        return self


def collect(paths: list[Path], out: Path) -> CompareResult:
    """Merge eval.json files (CI matrix jobs) into the report in `out`."""
    files = find_eval_files(paths)
    rows = [row_from_file(p) for p in files]
    sources = {r["name"]: _artifact_dir(f) for r, f in zip(rows, files, strict=True)}
    return CompareResult(Path(out), write_report(rows, out), sources)


# ------------------------------------------------------------------ in process


def _check_same_heldout(hashes: dict[str, str | None]) -> None:
    known = {n: h for n, h in hashes.items() if h}
    if len(set(known.values())) > 1:
        a, b = sorted(known)[:2]
        raise UsageError(
            "recipes are evaluated on different held-out tokens, so their KL figures do not "
            f"compare ({a}: {known[a][:12]}, {b}: {known[b][:12]})",
            path=b,
            hint="give every recipe the same `calibration.source` and `evaluation` "
            "sequences / seq_len",
        )


def _snapshot(model: str | Path, ctx):
    """The fetch stage (runner.fetch_stage: hashes checked, cached). Until pipeline/fetch.py
    lands, a local checkpoint directory stands in for a Snapshot."""
    from . import runner

    try:
        import pipeline.fetch  # noqa: F401
    except ImportError:
        from types import SimpleNamespace

        from .reference_cache import model_hash

        p = Path(model)
        if not (p / "config.json").is_file():
            raise UsageError(
                f"{model} is not a local checkpoint directory (no config.json), and the "
                "fetch stage is not available",
                path=str(model),
                hint="pass a folder with config.json and *.safetensors",
            ) from None
        return SimpleNamespace(path=p, source=str(model), model_hash=model_hash(p))
    return runner.fetch_stage(str(model), ctx)


def compare(
    model: str | Path,
    recipes: list[Path],
    out: Path,
    *,
    cache_dir: Path,
    device: str | None = None,
) -> CompareResult:
    """Quantize, evaluate and gate every recipe on one model; write the report to `out`.

    Shared work: the fetch (once), the token sets (stage cache, keyed by tokenizer, corpus
    and config: recipes with the same calibration/evaluation settings share them), the
    reference log-probs (one pass per model and held-out set) and every quantized
    checkpoint (a re-run with the same inputs quantizes nothing). A recipe whose gate
    fails is reported, not an error; `CompareResult.require_pass()` decides the exit code.
    """
    # llm-compressor's logger writes to stdout; `--json` stdout must hold only the result
    with contextlib.redirect_stdout(sys.stderr):
        return _compare(model, recipes, Path(out), cache_dir=Path(cache_dir), device=device)


def _compare(model, recipes, out: Path, *, cache_dir: Path, device) -> CompareResult:
    from . import evaluate as ev_mod
    from . import runner
    from .plan import load_meta_model
    from .recipe import load_recipe, validate_for_model

    device = device or default_device()
    loaded = [load_recipe(p) for p in recipes]
    matrix(list(recipes))  # unique names, before any compute
    ctx = runner.Context(cache_dir, device=device)
    snap = _snapshot(model, ctx)
    meta = load_meta_model(Path(snap.path))
    for r in loaded:  # every recipe checked against the model before the first quantize
        validate_for_model(r, meta)
    del meta
    tokens = {r.name: runner.tokens_stage(snap, r, ctx) for r in loaded}
    _check_same_heldout({n: t.heldout_hash for n, t in tokens.items()})

    files: list[Path] = []
    for path, r in zip(recipes, loaded, strict=True):
        ts = tokens[r.name]
        _log(f"{r.name}: quantize")
        q = runner.quantize_stage(snap, r, ts, ctx)
        _log(f"{r.name}: evaluate")
        evaluated = runner.evaluate_stage(snap, q, r, ts, ctx)
        rdir = out / "recipes" / r.name
        rdir.mkdir(parents=True, exist_ok=True)
        # eval.json + eval.md, as `qship evaluate` and `qship run` write them
        ev_mod.write_outputs(evaluated.eval_json, evaluated.verdict, rdir)
        ev = json.loads((rdir / EVAL_FILE).read_text())
        ev["compare"] = compare_block(
            name=r.name, recipe=Path(path).as_posix(), quantize_report=q.record
        )
        ev["compare"].update(model=str(model), quantized_dir=str(q.path))
        atomic_write_text(
            rdir / EVAL_FILE, json.dumps(ev, indent=2, sort_keys=True, default=str) + "\n"
        )
        files.append(rdir / EVAL_FILE)
        kl_mean = evaluated.eval_json["metrics"]["kl"]["mean"]
        _log(
            f"{r.name}: KL mean {kl_mean:.4g}, gate {'passed' if evaluated.verdict.passed else 'FAILED'}"
        )
    rows = [row_from_file(f) for f in files]
    sources = {row["name"]: str(f.parent) for row, f in zip(rows, files, strict=True)}
    return CompareResult(out, write_report(rows, out), sources)
