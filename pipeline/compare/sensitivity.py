"""sensitivity: what each Linear module costs when it alone is quantized.

For every module the recipe quantizes, its weight is rounded to its group's scheme
(round-to-nearest with min-max scales, through compressed-tensors' own `calculate_qparams`
and `fake_quantize`: the rounding of the RTN recipe), the model is scored on the held-out
tokens against the cached reference log-probs (evaluate.score_against_reference, the
figures `qship evaluate` reports), and the weight is restored. One reference pass, then one
forward pass of the held-out set per module; the reference model itself is the candidate.

The ranking says where bits matter. `upgrade_recipe` turns it into a recipe: the modules
with the most KL per extra stored bit get 8 bits (same method and options as their group)
until the quantized weights' bits per weight reach the budget. KL is treated as additive
over modules and RTN-at-4-bit as the measure of what 8 bits win back: both approximations,
so the written recipe is a candidate to compare (`qship compare`), not a result.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import log
from ..errors import UsageError
from ..evaluate import reference_cache
from ..evaluate.scoring import forward_logits, score_against_reference
from ..io.pins import checksums_dir as pin_folder
from ..model.devices import DTYPES, default_device
from ..model.loading import load_model
from ..quantize.modifiers import qargs
from ..quantize.plan import build_plan, weight_storage_bits
from ..recipe import Recipe, load_recipe
from ..records.evaluation import ModelRef
from ..records.plan import ModulePlan, ModuleScheme, Plan
from .recipe_writer import UPGRADE_BITS, refuse_overwrite, write_upgraded_recipe


def rtn_weight(weight: torch.Tensor, scheme: ModuleScheme) -> torch.Tensor:
    """`weight` rounded to `scheme` and dequantized (same shape and dtype)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**qargs(scheme.model_copy(update={"observer": None})))
    w = weight.detach().float()
    gs = scheme.group_size
    view = w.view(w.shape[0], -1, gs) if gs else w.view(w.shape[0], 1, -1)
    mn, mx = view.amin(dim=-1), view.amax(dim=-1)
    scale, zp = calculate_qparams(mn, mx, args)
    if not gs:  # per channel: [out, 1]
        scale, zp = scale.view(-1, 1), zp.view(-1, 1)
    return fake_quantize(w, scale, zp, args).to(weight.dtype)


@dataclass
class Sensitivity:
    model: str
    recipe: str
    rows: list[dict]  # one per module: name, group, scheme, params, kl_mean, ... (ranked)
    baseline_kl_mean: float  # the unmodified model against its own reference (≈ 0)
    settings: dict
    seconds: float
    written_recipe: dict | None = field(default=None)

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "recipe": self.recipe,
            "baseline_kl_mean": self.baseline_kl_mean,
            "settings": self.settings,
            "seconds": round(self.seconds, 3),
            "modules": self.rows,
            "by_layer": _aggregate(self.rows, _layer_of),
            "by_type": _aggregate(self.rows, lambda n: n.rsplit(".", 1)[-1]),
            "written_recipe": self.written_recipe,
        }

    def summary(self) -> str:
        top = ", ".join(f"{r['name']} {r['kl_mean']:.4g}" for r in self.rows[:5])
        lines = [
            f"sensitivity of {len(self.rows)} modules ({self.settings['method']}, "
            f"{self.settings['tokens_scored']} tokens) in {self.seconds:.1f} s; most sensitive: {top}"
        ]
        if self.written_recipe:
            w = self.written_recipe
            lines.append(
                f"wrote {w['path']}: {len(w['upgraded'])} module(s) to int{UPGRADE_BITS}, "
                f"{w['bits_per_weight']:.4f} bits per weight (budget {w['max_bits']})"
            )
        return "\n".join(lines)


def _layer_of(name: str) -> str:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return m.group(1) if m else "other"


def _aggregate(rows: list[dict], key) -> dict:
    out: dict[str, float] = {}
    for r in rows:
        k = key(r["name"])
        out[k] = out.get(k, 0.0) + r["kl_mean"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@dataclass(frozen=True)
class MeasureOptions:
    """How `measure` runs and labels its result."""

    device: str | None = None
    sequences: int | None = None
    """The first N held-out sequences (None: all)."""
    batch_size: int | None = None
    """Sequences per forward pass (None: the recipe's evaluation.batch_size)."""
    model_label: str | None = None
    recipe_label: str | None = None
    options: Sequence[tuple[int, int | None]] = ()
    """(bits, group_size) each module is also measured at (`qship tune`)."""
    ids_name: str = "held-out"
    """Which tokens these are, recorded in the settings."""


def measure(
    model: ModelRef,
    recipe: Recipe,
    *,
    heldout_ids: torch.Tensor,
    cache_dir: Path,
    opts: MeasureOptions = MeasureOptions(),
) -> tuple[Sensitivity, Plan]:
    """KL of the model with one module at a time rounded to its group's scheme; with
    `opts.options` [(bits, group_size)], each module is also measured at those schemes (same
    symmetry and observer; a group size its width does not divide is left out) and its row
    gets `options`: [{bits, group_size, stored_bits, kl_mean}], its own scheme first."""
    device = opts.device or default_device()
    if opts.sequences is not None:
        if opts.sequences <= 0:
            raise UsageError("--sequences must be positive", hint="e.g. --sequences 8")
        heldout_ids = heldout_ids[: opts.sequences]
    ids = heldout_ids.long().cpu()
    bs = opts.batch_size or recipe.evaluation.batch_size
    t_all = time.perf_counter()
    lm = load_model(model.path, device=device)
    plan = build_plan(lm, recipe)
    targets = _measurable(plan, recipe)
    # a held-out subset gets its own reference entry (the key hashes the ids themselves)
    run = reference_cache.ReferencePass(forward_logits, lambda _p: lm, bs, device)
    entry = reference_cache.get_or_build(
        cache_dir, model, ids, topk=reference_cache.DEFAULT_TOPK, dtype="auto", run=run
    )
    ref = entry.load()

    def kl_of() -> dict:
        return score_against_reference(lm, ids, ref, bs)["on"].summary()

    baseline = kl_of()["kl"]["mean"]
    mods = dict(lm.named_modules())
    dtype_bits = DTYPES[plan.dtype].bits
    rows = []
    bar = log.Progress("sensitivity", len(targets), unit="modules")
    for i, mp in enumerate(targets, 1):
        t0 = time.perf_counter()
        row = _module_row(mp, mods[mp.name], kl_of, dtype_bits, opts.options)
        rows.append(row)
        log.detail(
            f"[{i}/{len(targets)}] {mp.name}: KL {row['kl_mean']:.4g} "
            f"({time.perf_counter() - t0:.1f} s)"
        )
        bar.update(i, mp.name)
    bar.close()
    rows.sort(key=lambda r: -r["kl_mean"])
    res = Sensitivity(
        model=opts.model_label or str(model.path),
        recipe=opts.recipe_label or recipe.name,
        rows=rows,
        baseline_kl_mean=baseline,
        settings=_settings(opts, ids, entry.record["heldout_hash"], device, bs),
        seconds=time.perf_counter() - t_all,
    )
    return res, plan


def _measurable(plan: Plan, recipe: Recipe) -> list[ModulePlan]:
    """The modules the recipe quantizes; exit 2 for none, or for a recipe that rounds
    activations (which one-module-at-a-time weight rounding would leave out)."""
    targets = [m for m in plan.modules if m.scheme]
    act = sorted({m.scheme.format_label() for m in targets if m.scheme and (
        m.scheme.activations is not None or m.scheme.type == "float")})  # fmt: skip
    if act:
        raise UsageError(
            f"recipe {recipe.name} uses {', '.join(act)}: sensitivity (and `qship tune`) "
            "rounds weights only, one module at a time, and would leave the activation "
            "rounding out of its figures",
            path=recipe.path,
            hint="compare the activation formats whole with `qship compare --recipes "
            "recipes/fp8-dynamic.yaml recipes/w8a8-int8-sq.yaml ...`; tune a W4A16 base",
        )
    if not targets:
        raise UsageError(
            f"recipe {recipe.name} quantizes no module: nothing to measure",
            hint="give at least one group a method other than 'none'",
        )
    return targets


def _module_row(
    mp: ModulePlan, lin: torch.nn.Module, kl_of: Callable[[], dict], dtype_bits: int,
    options: Sequence[tuple[int, int | None]],
) -> dict:  # fmt: skip
    """One module's row: the model's KL with this module alone rounded to its scheme (and
    to each option), its weight restored after each."""
    assert mp.scheme is not None
    orig = lin.weight.data.clone()
    measured = []
    for scheme in _variants(mp.scheme, mp.in_features, options):
        try:
            lin.weight.data.copy_(rtn_weight(orig, scheme))
            s = kl_of()
        finally:
            lin.weight.data.copy_(orig)
        bits = weight_storage_bits(mp.out_features, mp.in_features, scheme, dtype_bits)
        measured.append((scheme, bits, s))
    s = measured[0][2]
    row = {
        "name": mp.name,
        "group": mp.group,
        "method": mp.method,
        "scheme": mp.scheme.to_json(),
        "params": mp.in_features * mp.out_features,
        "in_features": mp.in_features,
        "out_features": mp.out_features,
        "kl_mean": s["kl"]["mean"],
        "kl_p99": s["kl"]["p99"],
        "top1_agreement": s["top1_agreement"],
    }
    if options:
        row["options"] = [
            {"bits": sc.bits, "group_size": sc.group_size, "stored_bits": b,
             "kl_mean": r["kl"]["mean"]} for sc, b, r in measured
        ]  # fmt: skip
    return row


def _settings(
    opts: MeasureOptions, ids: torch.Tensor, heldout_hash: str, device: str, bs: int
) -> dict:
    return {
        "method": "rtn min-max, one module at a time, at its group's scheme",
        "kl_mode": f"cached-top{reference_cache.DEFAULT_TOPK}+tail",
        "tokens": opts.ids_name,
        "options": [list(o) for o in opts.options],
        "sequences": int(ids.shape[0]),
        "seq_len": int(ids.shape[1]),
        "tokens_scored": int(ids.shape[0] * (ids.shape[1] - 1)),
        "heldout_hash": heldout_hash,
        "device": device,
        "batch_size": bs,
    }


def _variants(
    scheme: ModuleScheme, width: int, options: Sequence[tuple[int, int | None]]
) -> list[ModuleScheme]:
    """The module's own scheme, then each option it can take (group size divides width)."""
    out = [scheme]
    for bits, gs in options:
        v = scheme.model_copy(update={"bits": bits, "group_size": gs})
        if (gs is None or width % gs == 0) and v not in out:
            out.append(v)
    return out


def run(
    model: str,
    recipe_path: Path,
    *,
    cache_dir: Path,
    device: str | None = None,
    checksums_dir: Path | None = None,
    sequences: int | None = None,
    out: Path | None = None,
    write_recipe: Path | None = None,
    max_bits: float | None = None,
) -> Sensitivity:
    """`qship sensitivity`: fetch (verified, cached), held-out tokens of the recipe, measure;
    optionally write the upgraded recipe (`write_recipe`, needs `max_bits`) and the JSON."""
    import json

    from .. import runner
    from ..io.atomic import atomic_write_text

    if (write_recipe is None) != (max_bits is None):
        raise UsageError(
            "--write-recipe and --max-bits go together",
            path="--write-recipe" if write_recipe is None else "--max-bits",
            hint="e.g. --max-bits 4.20 --write-recipe recipes/my-sens.yaml",
        )
    if write_recipe is not None:  # before any compute
        refuse_overwrite(Path(write_recipe))
    recipe = load_recipe(recipe_path)
    ctx = runner.Context(Path(cache_dir), device=device, checksums_dir=pin_folder(checksums_dir))
    runner.check_recipe(model, recipe, ctx, show_plan=False)
    snap = runner.fetch_stage(model, ctx)
    tokens = runner.tokens_stage(snap, recipe, ctx)
    with ctx.stage("measure") as line:
        res, _plan = measure(
            ModelRef(path=snap.path, model_hash=snap.model_hash),
            recipe,
            heldout_ids=tokens.heldout_ids,
            cache_dir=Path(cache_dir),
            opts=MeasureOptions(
                device=device, sequences=sequences, model_label=model, recipe_label=str(recipe_path)
            ),  # fmt: skip
        )
        line.note = f"{len(res.rows)} modules; most sensitive {res.rows[0]['name']}"
    if write_recipe is not None and max_bits is not None:
        res.written_recipe = write_upgraded_recipe(
            res.rows, Path(snap.path), Path(recipe_path), Path(write_recipe), max_bits, model
        )
    if out is not None:
        atomic_write_text(Path(out), json.dumps(res.to_json(), indent=2, sort_keys=True) + "\n")
    return res
