"""`qship tune`: bits and group sizes where they buy the most KL, within a budget.

1. **measure** (cached under `tune-sensitivity/<key>`): every module the base recipe
   quantizes, alone, rounded to its own scheme and to each option (default 4-bit g128, g64,
   g32 and 8-bit g128, same symmetry) -- KL against the unquantized model on the first
   calibration windows (the held-out windows stay unseen until the verification). A second
   run with another budget reuses the measurement.
2. **allocate**: a multiple-choice knapsack (knapsack.py) -- one option per item, least
   predicted KL (the sum of the modules' KL) with stored bits per weight within
   `--max-bits`. With `--max-kl` the predicted KL is scaled by verified/predicted of the
   last verified recipe, and the least bits meeting it are taken, verified again if needed.
   An item is a module, or the set a serving engine fuses into one layer (q/k/v, gate/up,
   an MoE block's experts: `model.roles.fused_sets`), which must share one scheme.
3. **write** the recipe (recipe_writer.py): the base recipe, each moved module set as its
   own group whose targets are layer-index regexes on the module path (no model prefix, so
   the recipe fits the family's other checkpoints of the same depth); planned again on the
   model to prove every module gets the chosen scheme.
4. **verify** the base and the tuned recipe end to end (`compare`: quantize with the real
   method, evaluate on the held-out windows, exact full-vocabulary KL by default), then
   `tune.json` and `tune.png` (predicted frontier, verified points).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import log
from ..errors import GateFailed, UsageError
from ..io.pins import checksums_dir as pin_folder
from ..model.roles import fused_sets
from ..records.base import Record
from ..records.plan import ModuleScheme, Plan
from . import knapsack
from .recipe_writer import check_written, label, tune_header, tuned_moves, tuned_recipe

DEFAULT_OPTIONS: list[tuple[int, int | None]] = [(4, 128), (4, 64), (4, 32), (8, 128)]
RESOLUTION = 1e-4  # bits per weight: the knapsack's unit
MAX_ROUNDS = 3  # verifications when searching for --max-kl


def parse_options(text: str) -> list[tuple[int, int | None]]:
    """ "w4g128,w4g64,w8g128,w8ch" -> [(4, 128), (4, 64), (8, 128), (8, None)]."""
    out: list[tuple[int, int | None]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"w(4|8)(?:g(\d+)|(ch))", part)
        if not m or (m.group(2) and int(m.group(2)) <= 0):
            raise UsageError(
                f"--options: {part!r} is not w<bits>g<group size> or w<bits>ch",
                path="--options",
                hint="e.g. --options w4g128,w4g64,w4g32,w8g128 (bits 4 or 8)",
            )
        out.append((int(m.group(1)), int(m.group(2)) if m.group(2) else None))
    if not out:
        raise UsageError("--options is empty", path="--options", hint="e.g. w4g128,w8g128")
    return out


class TuneResult(Record):
    recipe_path: str
    """The recipe written."""
    max_bits: float | None
    max_kl: float | None
    bits_per_weight: float
    """Of the written recipe, as planned on the model."""
    predicted_kl: float
    """Sum of the modules' measured KL at their chosen options (RTN, calibration windows)."""
    moved: dict[str, list[str]]
    """New group -> its modules."""
    measurement_cached: bool
    verified: list[dict[str, Any]] = []
    """Per verified recipe: name, bits_per_weight, kl_mean, kl_stderr, kl_mode, passed."""
    report: str | None = None
    met: bool | None = None
    """Whether the verified KL is within --max-kl (None without --max-kl or verification)."""

    def summary(self) -> str:
        lines = [
            f"wrote {self.recipe_path}: {self.bits_per_weight:.4f} bits per weight, "
            + ", ".join(f"{g} ({len(n)})" for g, n in self.moved.items())
        ]
        for v in self.verified:
            lines.append(
                f"  {v['name']:<32} {v['bits_per_weight']:.4f} bpw  mean KL {v['kl_mean']:.4f}"
                f" ± {v['kl_stderr']:.4f} ({v['kl_mode']})"
            )
        if self.report:
            lines.append(f"report: {self.report}")
        return "\n".join(lines)

    def require_met(self) -> TuneResult:
        if self.met is False:
            raise GateFailed(
                f"no recipe within the budget reached --max-kl {self.max_kl} (verified "
                f"{self.verified[-1]['kl_mean']:.4f} at {self.bits_per_weight:.4f} bits)",
                path=self.recipe_path,
                hint="raise --max-bits, add options (w8g64, w4g32), or try a stronger base "
                "method (gptq with mse scales, autoround)",
                result=self,
            )
        return self


# ------------------------------------------------------------------ allocation


def _options(rows: list[dict], plan: Plan) -> tuple[list[list[str]], list[list[dict]]]:
    """(the knapsack's items: sets of modules a serving engine fuses, which move together;
    each set's options, its own scheme first, stored bits and KL summed over the set)."""
    by = {r["name"]: r for r in rows}
    names = [m.name for m in plan.modules if m.scheme is not None]
    missing = [n for n in names if n not in by or "options" not in by[n]]
    if missing:
        raise UsageError(f"no measurement for {missing[0]} (and {len(missing) - 1} more)")
    sets = fused_sets(names)
    out = []
    for members in sets:
        per = [by[n]["options"] for n in members]
        kinds = [[(o["bits"], o["group_size"]) for o in os] for os in per]
        if any(k != kinds[0] for k in kinds):  # same width, same scheme: the same options
            raise UsageError(f"{members[0]} and {members[1]} were measured at other options")
        out.append([
            {**o, "stored_bits": sum(p[k]["stored_bits"] for p in per),
             "kl_mean": sum(p[k]["kl_mean"] for p in per)}
            for k, o in enumerate(per[0])
        ])  # fmt: skip
    return sets, out


def solve(
    rows: list[dict], plan: Plan, top_bits: float
) -> tuple[list[list[str]], list[list[dict]], knapsack.Table, int]:
    """The knapsack table up to `top_bits` bits per weight; (sets, options, table, weights)."""
    sets, opts = _options(rows, plan)
    n_weights = sum(m.in_features * m.out_features for m in plan.modules if m.scheme)
    unit = max(1, int(n_weights * RESOLUTION))
    items = [[knapsack.Option(o["stored_bits"], o["kl_mean"]) for o in os] for os in opts]
    return sets, opts, knapsack.solve(items, int(top_bits * n_weights), unit), n_weights


def chosen_schemes(
    plan: Plan, sets: list[list[str]], opts: list[list[dict]], pick: list[int]
) -> dict[str, ModuleScheme]:
    """{module: ModuleScheme} for the modules whose pick differs from their group's scheme."""
    out: dict[str, ModuleScheme] = {}
    own = {m.name: m.scheme for m in plan.modules}
    for members, os, k in zip(sets, opts, pick, strict=True):
        for n in members:
            s = own[n]
            assert s is not None
            v = s.model_copy(update={"bits": os[k]["bits"], "group_size": os[k]["group_size"]})
            if v != s:
                out[n] = v
    return out


def log_choice(picks: dict[str, ModuleScheme], bpw: float, predicted: float) -> None:
    counts: dict[str, int] = {}
    for s in picks.values():
        counts[label(s)] = counts.get(label(s), 0) + 1
    log.detail(f"tune: {bpw:.4f} bits/weight, predicted KL {predicted:.4f}, moved {counts}")


# ------------------------------------------------------------------ the command


@dataclass(frozen=True)
class TuneOptions:
    """What `qship tune` is asked for: the budget, the options it chooses among, the windows
    it measures on and how it verifies (`run`'s keywords, checked once by `check`)."""

    max_bits: float | None = None
    max_kl: float | None = None
    options: tuple[tuple[int, int | None], ...] = tuple(DEFAULT_OPTIONS)
    sequences: int = 16
    verify: bool = True
    exact: bool = True
    device: str | None = None
    checksums_dir: Path | None = None

    def check(self) -> None:
        """Exit 2 for a request no run can answer, before any compute."""
        if self.max_bits is None and self.max_kl is None:
            raise UsageError(
                "give a budget", path="--max-bits", hint="--max-bits 4.25 and/or --max-kl 0.1"
            )
        if self.max_kl is not None and not self.verify:
            raise UsageError("--max-kl is judged on verified KL", path="--no-verify",
                             hint="drop --no-verify, or give --max-bits alone")  # fmt: skip
        if self.sequences <= 0:
            raise UsageError("--sequences must be positive", path="--sequences", hint="e.g. 16")


def run(
    model: str,
    recipe_path: Path,
    *,
    write_recipe: Path,
    out: Path,
    cache_dir: Path,
    device: str | None = None,
    checksums_dir: Path | None = None,
    max_bits: float | None = None,
    max_kl: float | None = None,
    options: list[tuple[int, int | None]] | None = None,
    sequences: int = 16,
    verify: bool = True,
    exact: bool = True,
) -> TuneResult:
    """Measure (cached), allocate, write `write_recipe`, verify into `out` (the CLI's
    keywords; `tune` takes them as one TuneOptions)."""
    opts = TuneOptions(
        max_bits=max_bits, max_kl=max_kl, options=tuple(options or DEFAULT_OPTIONS),
        sequences=sequences, verify=verify, exact=exact, device=device,
        checksums_dir=checksums_dir,
    )  # fmt: skip
    return tune(model, recipe_path, opts, write_recipe=write_recipe, out=out,
                cache_dir=cache_dir)  # fmt: skip


@dataclass
class _Measured:
    """The measure step's result: the fetched snapshot, the base plan, the rows."""

    snap: Any
    recipe: Any
    plan: Plan
    rows: list[dict]
    cached: bool


def tune(
    model: str, recipe_path: Path, opts: TuneOptions, *, write_recipe: Path, out: Path,
    cache_dir: Path,
) -> TuneResult:  # fmt: skip
    """Measure (cached), allocate, write `write_recipe`, verify into `out`."""
    opts.check()
    write_recipe, out, cache_dir = Path(write_recipe), Path(out), Path(cache_dir)
    from .recipe_writer import refuse_overwrite

    refuse_overwrite(write_recipe)
    m = _measure(model, recipe_path, opts, cache_dir)
    base_bpw = m.plan.bits_per_weight.quantized
    sets, opts_kl, table, n_w = solve(m.rows, m.plan, max(opts.max_bits or 0.0, base_bpw) + 0.5)
    top = _top_capacity(table, n_w, opts.max_bits)
    predicted_base = sum(os[0]["kl_mean"] for os in opts_kl)
    verifier = _Verifier(model, out / "runs", cache_dir, opts)
    scale = 1.0  # verified / predicted KL: the verified base calibrates the prediction
    if opts.verify:
        scale = verifier(Path(recipe_path))["kl_mean"] / max(predicted_base, 1e-12)
    found = _search(m, recipe_path, opts, (sets, opts_kl, table, top), scale, verifier, out)
    from ..io.atomic import atomic_write_text

    atomic_write_text(write_recipe, found.text)
    report = None
    if opts.verify:
        from .compare import collect

        report = str(collect([out / "runs"], out / "report").out / "compare.html")
    moved = {new: ns for g in tuned_moves(m.plan, found.picks).values()
             for new, (_c, ns) in g.items()}  # fmt: skip
    result = TuneResult(
        recipe_path=str(write_recipe), max_bits=opts.max_bits, max_kl=opts.max_kl,
        bits_per_weight=found.bpw, predicted_kl=float(table.best[found.cap]), moved=moved,
        measurement_cached=m.cached, verified=verifier.verified, report=report, met=found.met,
    )  # fmt: skip
    front = [(b / n_w, kl) for b, kl in knapsack.frontier(table)]
    _write_tune_files(out, result, front, found.scale, predicted_base)
    return result


def _measure(model: str, recipe_path: Path, opts: TuneOptions, cache_dir: Path) -> _Measured:
    """Fetch, tokens, plan and each module's KL at each option (cached under
    `tune-sensitivity/<key>`, on the first calibration windows)."""
    from .. import runner
    from ..io.cache import stage_key
    from ..model.devices import device_kind
    from ..quantize.plan import plan_for_dir
    from ..recipe import load_recipe
    from ..records.evaluation import ModelRef
    from .sensitivity import MeasureOptions, measure

    device = opts.device
    recipe = load_recipe(recipe_path)
    ctx = runner.Context(cache_dir, device=device, checksums_dir=pin_folder(opts.checksums_dir))
    runner.check_recipe(model, recipe, ctx, show_plan=False)
    snap = runner.fetch_stage(model, ctx)
    tokens = runner.tokens_stage(snap, recipe, ctx)
    plan = plan_for_dir(Path(snap.path), recipe)
    ids = tokens.calib_ids[: opts.sequences]
    key = stage_key("tune-sensitivity", {
        "model": snap.model_hash, "calib": tokens.calib_hash, "sequences": int(ids.shape[0]),
        "schemes": [[m.name, m.scheme.to_json() if m.scheme else None] for m in plan.modules],
        "options": [list(o) for o in opts.options], "batch": recipe.evaluation.batch_size,
        "device": device_kind(device),
    })  # fmt: skip
    measure_opts = MeasureOptions(
        device=device, model_label=model, recipe_label=str(recipe_path),
        options=tuple(opts.options), ids_name="calibration",
    )  # fmt: skip

    def build(_tmp: Path) -> dict:
        ref = ModelRef(path=snap.path, model_hash=snap.model_hash)
        res, _ = measure(ref, recipe, heldout_ids=ids, cache_dir=cache_dir, opts=measure_opts)
        return res.to_json()

    with ctx.stage("measure", key) as line:
        entry = ctx.cache.get_or_build("tune-sensitivity", key, build)
        rows = entry.record["modules"]
        line.cached = entry.hit
        n = len(opts.options)
        line.note = f"{len(rows)} modules x {n} options on {ids.shape[0]} windows"
    return _Measured(snap, recipe, plan, rows, entry.hit)


def _top_capacity(table: knapsack.Table, n_w: int, max_bits: float | None) -> int:
    """The largest knapsack capacity the bit budget allows (exit 2 below the cheapest)."""
    if max_bits is None:
        return len(table.best) - 1
    if int(max_bits * n_w) < table.floor_bits:
        raise UsageError(
            f"--max-bits {max_bits} is below {table.floor_bits / n_w:.4f}, every module at "
            "its cheapest option", path="--max-bits", hint="raise it or add cheaper options",
        )  # fmt: skip
    return table.capacity(int(max_bits * n_w))


class _Verifier:
    """Verifies a recipe end to end (`compare` into `runs/<name>`) and keeps each verified
    point: name, bits_per_weight, kl_mean, kl_stderr, top1, ppl_ratio, passed, kl_mode, dir."""

    def __init__(self, model: str, runs: Path, cache_dir: Path, opts: TuneOptions):
        self.model, self.runs, self.cache_dir, self.opts = model, runs, cache_dir, opts
        self.verified: list[dict[str, Any]] = []

    def __call__(self, path: Path) -> dict:
        from ..recipe import load_recipe
        from .compare import compare
        from .rows import EVAL_FILE, read_eval_file, row

        r = load_recipe(path)
        o, runs = self.opts, self.runs
        res = compare(self.model, [path], runs / r.name, cache_dir=self.cache_dir,
                      device=o.device, exact=o.exact, checksums_dir=o.checksums_dir)  # fmt: skip
        ev = read_eval_file(runs / r.name / "recipes" / r.name / EVAL_FILE)
        f = row(ev)
        v = {k: f[k] for k in ("name", "bits_per_weight", "kl_mean", "kl_stderr", "top1",
                               "ppl_ratio", "passed")}  # fmt: skip
        v["kl_mode"] = ev.metrics.kl_mode
        v["dir"] = res.best_dir or str(runs / r.name)
        self.verified.append(v)
        return v


@dataclass
class _Found:
    """The recipe the search settled on."""

    picks: dict[str, ModuleScheme]
    bpw: float
    text: str
    cap: int
    met: bool | None
    scale: float


def _search(
    m: _Measured, recipe_path: Path, opts: TuneOptions, solved: tuple, scale: float,
    verifier: _Verifier, out: Path,
) -> _Found:  # fmt: skip
    """Write the least-KL recipe within the budget; with --max-kl, the least bits whose
    scaled prediction meets it, verified and recalibrated up to MAX_ROUNDS times."""
    import yaml

    sets, opts_kl, table, top = solved
    data = yaml.safe_load(Path(recipe_path).read_text())
    max_kl = opts.max_kl
    cap, met = top, None
    stem = f"{m.recipe.name}-tune"
    for _round in range(MAX_ROUNDS if max_kl is not None else 1):
        if max_kl is not None:
            ok = [c for c in range(top + 1) if table.best[c] * scale <= max_kl]
            cap = ok[0] if ok else top
        picks = chosen_schemes(m.plan, sets, opts_kl, table.pick(cap))
        tuned = tuned_recipe(data, m.plan, picks, stem)
        bpw = check_written(Path(m.snap.path), tuned, picks, m.plan).bits_per_weight.quantized
        tuned["name"] = f"{stem}{bpw:.3f}"
        text = tune_header(recipe_path, opts.max_bits, max_kl, verifier.model) + yaml.safe_dump(
            tuned, sort_keys=False, width=100
        )
        cand = out / "recipes" / f"{tuned['name']}.yaml"
        cand.parent.mkdir(parents=True, exist_ok=True)
        cand.write_text(text)
        log_choice(picks, bpw, float(table.best[cap]))
        if not opts.verify:
            break
        v = verifier(cand)
        if max_kl is None:
            break
        met = v["kl_mean"] <= max_kl
        if met or cap == top:
            break
        scale = v["kl_mean"] / max(float(table.best[cap]), 1e-12)  # recalibrated: more bits
    return _Found(picks, bpw, text, cap, met, scale)


def _write_tune_files(
    out: Path, result: TuneResult, front: list, scale: float, predicted_base: float
) -> None:
    """tune.json (the result, the predicted frontier and its scale) and tune.png."""
    from ..io.atomic import atomic_write_text
    from .plots import plot_tune

    extra = {
        "frontier_predicted": front,
        "predicted_scale": scale,
        "predicted_base": predicted_base,
    }
    atomic_write_text(
        out / "tune.json",
        json.dumps({**result.to_json(), **extra}, indent=2, sort_keys=True) + "\n",
    )
    png = plot_tune(front, scale, result.verified, result.max_bits, result.max_kl)
    if png:
        (out / "tune.png").write_bytes(png)
