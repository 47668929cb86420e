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

import copy
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import log
from ..errors import UsageError
from ..evaluate import reference_cache
from ..evaluate.scoring import forward_logits, score_against_reference
from ..model.devices import DTYPES, default_device
from ..model.loading import load_model
from ..quantize.modifiers import qargs
from ..quantize.plan import build_plan, plan_for_dir, weight_storage_bits
from ..recipe import Recipe, load_recipe
from ..records.evaluation import ModelRef
from ..records.plan import ModuleScheme, Plan

UPGRADE_BITS = 8


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


def measure(
    model: ModelRef,
    recipe: Recipe,
    *,
    heldout_ids: torch.Tensor,
    cache_dir: Path,
    device: str | None = None,
    sequences: int | None = None,
    batch_size: int | None = None,
    model_label: str | None = None,
    recipe_label: str | None = None,
) -> tuple[Sensitivity, Plan]:
    device = device or default_device()
    if sequences is not None:
        if sequences <= 0:
            raise UsageError("--sequences must be positive", hint="e.g. --sequences 8")
        heldout_ids = heldout_ids[:sequences]
    ids = heldout_ids.long().cpu()
    bs = batch_size or recipe.evaluation.batch_size
    t_all = time.perf_counter()
    lm = load_model(model.path, device=device)
    plan = build_plan(lm, recipe)
    targets = [m for m in plan.modules if m.scheme]
    if not targets:
        raise UsageError(
            f"recipe {recipe.name} quantizes no module: nothing to measure",
            hint="give at least one group a method other than 'none'",
        )
    # a held-out subset gets its own reference entry (the key hashes the ids themselves)
    entry = reference_cache.get_or_build(
        cache_dir, model, ids, topk=reference_cache.DEFAULT_TOPK, forward=forward_logits,
        load_model=lambda _p: lm, batch_size=bs, dtype="auto", device=device,
    )  # fmt: skip
    ref = entry.load()

    def kl_of() -> dict:
        return score_against_reference(lm, ids, ref, bs)["on"].summary()

    baseline = kl_of()["kl"]["mean"]
    mods = dict(lm.named_modules())
    rows = []
    bar = log.Progress("sensitivity", len(targets), unit="modules")
    for i, mp in enumerate(targets, 1):
        assert mp.scheme is not None
        lin = mods[mp.name]
        orig = lin.weight.data.clone()
        t0 = time.perf_counter()
        try:
            lin.weight.data.copy_(rtn_weight(orig, mp.scheme))
            s = kl_of()
        finally:
            lin.weight.data.copy_(orig)
        rows.append(
            {
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
        )
        log.detail(
            f"[{i}/{len(targets)}] {mp.name}: KL {s['kl']['mean']:.4g} "
            f"({time.perf_counter() - t0:.1f} s)"
        )
        bar.update(i, mp.name)
    bar.close()
    rows.sort(key=lambda r: -r["kl_mean"])
    settings = {
        "method": "rtn min-max, one module at a time, at its group's scheme",
        "kl_mode": f"cached-top{reference_cache.DEFAULT_TOPK}+tail",
        "sequences": int(ids.shape[0]),
        "seq_len": int(ids.shape[1]),
        "tokens_scored": int(ids.shape[0] * (ids.shape[1] - 1)),
        "heldout_hash": entry.record["heldout_hash"],
        "device": device,
        "batch_size": bs,
    }
    res = Sensitivity(
        model=model_label or str(model.path),
        recipe=recipe_label or recipe.name,
        rows=rows,
        baseline_kl_mean=baseline,
        settings=settings,
        seconds=time.perf_counter() - t_all,
    )
    return res, plan


# ------------------------------------------------------------------ recipe upgrade


def _bits(row: dict, scheme: ModuleScheme, dtype_bits: int) -> int:
    return weight_storage_bits(row["out_features"], row["in_features"], scheme, dtype_bits)


def choose_upgrades(rows: list[dict], plan: Plan, max_bits: float) -> tuple[list[dict], float]:
    """Greedy by KL won back per extra stored bit, while the quantized weights' bits per
    weight stay within `max_bits`. Returns (chosen rows, resulting bits per weight)."""
    dtype_bits = DTYPES[plan.dtype].bits
    quant = [m for m in plan.modules if m.scheme]
    total_bits = sum(
        weight_storage_bits(m.out_features, m.in_features, m.scheme, dtype_bits) for m in quant
    )
    n_weights = sum(m.in_features * m.out_features for m in quant)
    cands = []
    for r in rows:
        scheme = ModuleScheme(**r["scheme"])
        if scheme.bits >= UPGRADE_BITS:
            continue
        up = scheme.model_copy(update={"bits": UPGRADE_BITS})
        extra = _bits(r, up, dtype_bits) - _bits(r, scheme, dtype_bits)
        cands.append((r["kl_mean"] / extra, extra, r))
    cands.sort(key=lambda c: -c[0])
    chosen = []
    for _gain, extra, r in cands:
        if (total_bits + extra) / n_weights <= max_bits + 1e-12:
            chosen.append(r)
            total_bits += extra
    return chosen, total_bits / n_weights


def upgrade_recipe(recipe_data: dict, recipe: Recipe, plan: Plan, chosen: list[dict]) -> dict:
    """A copy of the recipe (YAML data) where the `chosen` modules form new groups
    `<group>-int8`: same method, options and scheme, 8 bits; their old groups `exclude`
    them (and keep their roles and targets, so the rest of the recipe stays portable)."""
    data = copy.deepcopy(recipe_data)
    by_group: dict[str, list[str]] = {}
    for r in chosen:
        by_group.setdefault(r["group"], []).append(r["name"])
    members = plan.groups()
    groups = []
    for g in data["groups"]:
        names = by_group.get(g["name"])
        if not names:
            groups.append(g)
            continue
        up = copy.deepcopy(g)
        up.pop("roles", None)
        up.pop("exclude", None)
        up.update(name=f"{g['name']}-int{UPGRADE_BITS}", targets=sorted(names),
                  scheme={**g["scheme"], "bits": UPGRADE_BITS})  # fmt: skip
        if len(names) == len(members[g["name"]]):
            groups.append(up)  # every module moved: the old group would claim nothing
            continue
        groups += [{**g, "exclude": sorted({*g.get("exclude", []), *names})}, up]
    data["groups"] = groups
    data["name"] = f"{recipe.name}-sens{len(chosen)}"
    data["description"] = (
        f"{recipe.description or recipe.name}; {len(chosen)} most sensitive module(s) at "
        f"int{UPGRADE_BITS} (qship sensitivity)"
    )
    return data


def run(
    model: str,
    recipe_path: Path,
    *,
    cache_dir: Path,
    device: str | None = None,
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
        _refuse_overwrite(Path(write_recipe))
    recipe = load_recipe(recipe_path)
    ctx = runner.Context(Path(cache_dir), device=device)
    runner.check_recipe(model, recipe, ctx, show_plan=False)
    snap = runner.fetch_stage(model, ctx)
    tokens = runner.tokens_stage(snap, recipe, ctx)
    with ctx.stage("measure") as line:
        res, _plan = measure(
            ModelRef(path=snap.path, model_hash=snap.model_hash),
            recipe,
            heldout_ids=tokens.heldout_ids,
            cache_dir=Path(cache_dir),
            device=device,
            sequences=sequences,
            model_label=model,
            recipe_label=str(recipe_path),
        )
        line.note = f"{len(res.rows)} modules; most sensitive {res.rows[0]['name']}"
    if write_recipe is not None and max_bits is not None:
        res.written_recipe = write_upgraded_recipe(
            res.rows, Path(snap.path), Path(recipe_path), Path(write_recipe), max_bits, model
        )
    if out is not None:
        atomic_write_text(Path(out), json.dumps(res.to_json(), indent=2, sort_keys=True) + "\n")
    return res


def _refuse_overwrite(dest: Path) -> None:
    if dest.exists():
        raise UsageError(
            f"{dest} exists; qship does not overwrite recipes",
            path=str(dest),
            hint="choose a new file name or delete the old one",
        )


def write_upgraded_recipe(
    rows: list[dict], model_dir: Path, recipe_path: Path, dest: Path, max_bits: float, model: str
) -> dict:
    """Write `dest`: the recipe at `recipe_path` upgraded from measured `rows` (any recipe
    with the same schemes can reuse one measurement). It must load and plan within
    `max_bits`, else it is removed and the error raised. Returns what was written."""
    import yaml

    from ..io.atomic import atomic_write_text

    _refuse_overwrite(dest)
    recipe = load_recipe(recipe_path)
    plan = plan_for_dir(model_dir, recipe)
    if max_bits < plan.bits_per_weight.quantized:
        raise UsageError(
            f"--max-bits {max_bits} is below the recipe's own "
            f"{plan.bits_per_weight.quantized:.4f} bits per weight",
            path="--max-bits",
            hint="give a budget above the base recipe's bits per weight",
        )
    chosen, bpw = choose_upgrades(rows, plan, max_bits)
    data = upgrade_recipe(yaml.safe_load(recipe_path.read_text()), recipe, plan, chosen)
    text = (
        f"# Written by `qship sensitivity --recipe {recipe_path} --max-bits {max_bits}` on "
        f"{model}:\n# the base recipe with the {len(chosen)} module(s) that cost the most KL "
        f"per extra stored bit\n# (RTN one module at a time) moved to int{UPGRADE_BITS}. "
        "Compare it with `qship compare` before shipping.\n"
        + yaml.safe_dump(data, sort_keys=False, width=100)
    )
    atomic_write_text(dest, text)
    try:  # the written recipe must load and plan within the budget
        got = plan_for_dir(model_dir, load_recipe(dest)).bits_per_weight.quantized
        if got > max_bits + 1e-9:
            raise UsageError(
                f"the upgraded recipe plans {got:.4f} bits per weight, over --max-bits {max_bits}",
                path=str(dest),
            )
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return {
        "path": str(dest),
        "name": data["name"],
        "max_bits": max_bits,
        "bits_per_weight": got,
        "bits_per_weight_estimate": bpw,
        "upgraded": [r["name"] for r in chosen],
        "kl_won_back_estimate": sum(r["kl_mean"] for r in chosen),
    }
