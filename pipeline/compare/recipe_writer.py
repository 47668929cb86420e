"""The recipes `qship sensitivity` and `qship tune` write, and the checks they pass.

* `write_upgraded_recipe` (sensitivity): the modules with the most KL per extra stored bit
  to int8, greedily (a fused set -- q/k/v, gate/up -- as one), each named exactly; the base
  group excludes them.
* `tuned_recipe` (tune): each module at the scheme the knapsack chose, one group per
  (base group, scheme) whose targets are layer-index regexes on the module path
  (`portable_targets`), planned again on the model (`check_written`).

Neither overwrites a file (`refuse_overwrite`, before any compute).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

from ..errors import UsageError
from ..model.devices import DTYPES
from ..model.roles import fused_sets
from ..quantize.plan import plan_for_dir, weight_storage_bits
from ..recipe import Recipe, load_recipe
from ..records.plan import ModuleScheme, Plan

UPGRADE_BITS = 8


# ------------------------------------------------------------------ sensitivity


def _bits(row: dict, scheme: ModuleScheme, dtype_bits: int) -> int:
    return weight_storage_bits(row["out_features"], row["in_features"], scheme, dtype_bits)


def choose_upgrades(rows: list[dict], plan: Plan, max_bits: float) -> tuple[list[dict], float]:
    """Greedy by KL won back per extra stored bit, while the quantized weights' bits per
    weight stay within `max_bits`; the sets a serving engine fuses (q/k/v, gate/up) move
    together. Returns (chosen rows, resulting bits per weight)."""
    dtype_bits = DTYPES[plan.dtype].bits
    quant = [m for m in plan.modules if m.scheme]
    total_bits = sum(
        weight_storage_bits(m.out_features, m.in_features, m.scheme, dtype_bits) for m in quant
    )
    n_weights = sum(m.in_features * m.out_features for m in quant)
    by = {r["name"]: r for r in rows}
    cands = []
    for members in fused_sets(by):
        rs = [by[n] for n in members]
        schemes = [ModuleScheme(**r["scheme"]) for r in rs]
        if any(sc.bits >= UPGRADE_BITS for sc in schemes):
            continue
        extra = sum(
            _bits(r, sc.model_copy(update={"bits": UPGRADE_BITS}), dtype_bits)
            - _bits(r, sc, dtype_bits)
            for r, sc in zip(rs, schemes, strict=True)
        )
        cands.append((sum(r["kl_mean"] for r in rs) / extra, extra, rs))
    cands.sort(key=lambda c: -c[0])
    chosen: list[dict] = []
    for _gain, extra, rs in cands:
        if (total_bits + extra) / n_weights <= max_bits + 1e-12:
            chosen += rs
            total_bits += extra
    return chosen, total_bits / n_weights


def _regroup(
    groups: list[dict], plan: Plan, moves: dict[str, dict[str, tuple[dict, list[str]]]], targets
) -> list[dict]:
    """The recipe's groups with `moves` ({group: {new group: (scheme changes, modules)}})
    applied: each new group right after its old one, same method and options, `targets` of
    its modules; the old group keeps its claims and excludes them (or goes, when all moved)."""
    members = plan.groups()
    out = []
    for g in groups:
        mine = moves.get(g["name"])
        if not mine:
            out.append(g)
            continue
        moved = [n for _s, ns in mine.values() for n in ns]
        if len(moved) < len(members[g["name"]]):
            out.append({**g, "exclude": [*g.get("exclude", []), *targets(moved)]})
        for name, (change, ns) in sorted(mine.items()):
            new = copy.deepcopy({k: v for k, v in g.items() if k not in ("roles", "exclude")})
            new.update(name=name, targets=targets(ns), scheme={**g["scheme"], **change})
            out.append(new)
    return out


def upgrade_recipe(recipe_data: dict, recipe: Recipe, plan: Plan, chosen: list[dict]) -> dict:
    """A copy of the recipe (YAML data) where the `chosen` modules form new groups
    `<group>-w8g128` (tune's naming): same method, options and scheme, 8 bits; their old
    groups `exclude` them (and keep their roles and targets, so the rest stays portable)."""
    data = copy.deepcopy(recipe_data)
    own = plan.by_name()
    picks = {}
    for r in chosen:
        s = own[r["name"]].scheme
        assert s is not None
        picks[r["name"]] = s.model_copy(update={"bits": UPGRADE_BITS})
    data["groups"] = _regroup(data["groups"], plan, tuned_moves(plan, picks), sorted)
    data["name"] = f"{recipe.name}-sens{len(chosen)}"
    data["description"] = (
        f"{recipe.description or recipe.name}; {len(chosen)} most sensitive module(s) at "
        f"int{UPGRADE_BITS} (qship sensitivity)"
    )
    return data


def refuse_overwrite(dest: Path) -> None:
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

    refuse_overwrite(dest)
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


# ------------------------------------------------------------------ tune


def portable_targets(names: list[str]) -> list[str]:
    """Regexes matching exactly `names` by layer index and module path, with any prefix:
    model.layers.3.mlp.down_proj + model.layers.7.mlp.down_proj ->
    re:(.*\\.)?layers\\.(3|7)\\.mlp\\.down_proj$. Names outside `layers.N.` stay exact."""
    by_rest: dict[str, list[int]] = {}
    exact: list[str] = []
    for n in names:
        m = re.fullmatch(r"(?:.*\.)?layers\.(\d+)\.(.+)", n)
        if m:
            by_rest.setdefault(m.group(2), []).append(int(m.group(1)))
        else:
            exact.append(n)

    def alt(ix: list[int]) -> str:
        s = sorted(set(ix))
        return str(s[0]) if len(s) == 1 else f"({'|'.join(map(str, s))})"

    pats = [
        rf"re:(.*\.)?layers\.{alt(ix)}\.{re.escape(rest)}$" for rest, ix in sorted(by_rest.items())
    ]
    return pats + sorted(exact)


def label(s: ModuleScheme) -> str:
    return f"w{s.bits}g{s.group_size or 'ch'}"


def tuned_moves(
    plan: Plan, picks: dict[str, ModuleScheme]
) -> dict[str, dict[str, tuple[dict, list[str]]]]:
    """{base group: {`<group>-<w8g128>`: (scheme changes, modules)}} for the `picks`."""
    group_of = {m.name: m.group for m in plan.modules}
    moves: dict[str, dict[str, tuple[dict, list[str]]]] = {}
    for n, sc in sorted(picks.items()):
        g = group_of[n]
        change = {"bits": sc.bits, "group_size": sc.group_size}
        moves.setdefault(g, {}).setdefault(f"{g}-{label(sc)}", (change, []))[1].append(n)
    return moves


def tuned_recipe(data: dict, plan: Plan, picks: dict[str, ModuleScheme], name: str) -> dict:
    """The base recipe's YAML data with the `picks` moved to groups `<group>-<w8g128>`."""
    out = copy.deepcopy(data)
    out["groups"] = _regroup(out["groups"], plan, tuned_moves(plan, picks), portable_targets)
    out["name"] = name
    out["description"] = (
        f"{data.get('description') or data['name']}; {len(picks)} module(s) at other bits / "
        "group sizes chosen by `qship tune` (KL per stored bit, knapsack)"
    )
    return out


def check_written(model_dir: Path, data: dict, picks: dict[str, ModuleScheme], base: Plan) -> Plan:
    """Plan the tuned recipe on the model: every module has the scheme tune chose."""
    plan = plan_for_dir(model_dir, Recipe.model_validate(data))
    want = {m.name: picks.get(m.name, m.scheme) for m in base.modules}
    got = {m.name: m.scheme for m in plan.modules}
    bad = [n for n in want if want[n] != got.get(n)]
    if bad:
        raise UsageError(
            f"the written recipe gives {bad[0]} {got.get(bad[0])}, tune chose {want[bad[0]]} "
            f"({len(bad)} module(s) differ)",
            path=data["name"],
            hint="a module path the regexes cannot tell apart; report it with the model name",
        )
    return plan


def tune_header(recipe_path: Path, max_bits: float | None, max_kl: float | None, model: str) -> str:
    budget = " ".join(f"--{k} {v}" for k, v in (("max-bits", max_bits), ("max-kl", max_kl)) if v)
    return (
        f"# Written by `qship tune --recipe {recipe_path} {budget}` on {model}: the base recipe\n"
        "# with each module at the bits / group size that buys the most KL per stored bit\n"
        "# (RTN one module at a time on calibration windows, a knapsack over the budget);\n"
        "# verified end to end in the tune report.\n"
    )
