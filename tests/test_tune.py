"""qship tune: the knapsack is exact, the written recipe is portable and plans as chosen, and
on the tiny trained Gemma the tuned recipe beats its base within the budget, verified end to
end; a second run with another budget reuses the measurement."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest
from cli_run import qship
from small_recipes import small_recipe

from pipeline.compare import knapsack
from pipeline.compare.recipe_writer import portable_targets
from pipeline.compare.tune import parse_options
from pipeline.model.roles import fused_sets
from pipeline.quantize.plan import plan_for_dir
from pipeline.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("two_threads")


def _brute(mods: list[list[knapsack.Option]], budget: int) -> float | None:
    best = None
    for combo in itertools.product(*[range(len(m)) for m in mods]):
        bits = sum(mods[i][k].bits for i, k in enumerate(combo))
        kl = sum(mods[i][k].kl for i, k in enumerate(combo))
        if bits <= budget and (best is None or kl < best):
            best = kl
    return best


def test_knapsack_equals_exhaustive_search():
    rng = random.Random(0)
    for _ in range(200):
        mods = [
            [knapsack.Option(rng.randint(1, 40), rng.random()) for _ in range(rng.randint(1, 4))]
            for _ in range(rng.randint(1, 5))
        ]
        budget = rng.randint(sum(min(o.bits for o in m) for m in mods), 160)
        pick = knapsack.allocate(mods, budget, unit=1)
        bits = sum(mods[i][k].bits for i, k in enumerate(pick))
        kl = sum(mods[i][k].kl for i, k in enumerate(pick))
        assert bits <= budget
        assert kl == pytest.approx(_brute(mods, budget))


def test_knapsack_beats_greedy_and_rounds_costs_up():
    # one 8-bit step (cost 10, gain 0.9) is worth more than two small ones of the same cost
    # that a KL-per-bit greedy takes first (gain 0.5 + 0.3 for 5 + 5 bits)
    a = [knapsack.Option(0, 1.0), knapsack.Option(10, 0.1)]
    b = [knapsack.Option(0, 0.5), knapsack.Option(4, 0.0)]
    c = [knapsack.Option(0, 0.3), knapsack.Option(4, 0.0), knapsack.Option(6, 0.0)]
    assert knapsack.allocate([a, b, c], 10, unit=1) == [1, 0, 0]
    # with unit 4 a cost of 10 counts as 12: over a budget of 10, never silently taken
    pick = knapsack.allocate([a, b, c], 10, unit=4)
    assert sum([a, b, c][i][k].bits for i, k in enumerate(pick)) <= 10
    t = knapsack.solve([a, b, c], 20, unit=1)
    front = knapsack.frontier(t)
    assert front[0] == (0, pytest.approx(1.8))
    assert all(y1 > y2 for (_, y1), (_, y2) in zip(front, front[1:], strict=False))


def test_portable_targets_match_exactly_the_chosen_modules():
    names = [f"{p}layers.{i}.{m}" for p in ("model.", "model.language_model.")
             for i in range(12) for m in ("self_attn.v_proj", "mlp.down_proj")]  # fmt: skip
    for prefix in ("model.", "model.language_model."):
        chosen = [f"{prefix}layers.3.mlp.down_proj", f"{prefix}layers.11.mlp.down_proj",
                  f"{prefix}layers.1.self_attn.v_proj"]  # fmt: skip
        pats = portable_targets(chosen)
        assert all(p.startswith("re:") for p in pats) and "model" not in "".join(pats)
        hit = {n for n in names if any(re.match(p[3:], n) for p in pats)}
        # the same modules under either prefix: layer 1 does not match 11, 3 not 13
        assert hit == {n for n in names for c in chosen if n.endswith(c.split("layers.")[1])
                       and n.split("layers.")[1] == c.split("layers.")[1]}  # fmt: skip
    assert portable_targets(["lm_head"]) == ["lm_head"]


def test_parse_options():
    assert parse_options("w4g128, w8ch,w4g32") == [(4, 128), (8, None), (4, 32)]
    for bad in ("w3g128", "w4g0", "g128", ""):
        with pytest.raises(Exception, match="--options"):
            parse_options(bad)


@pytest.fixture(scope="module")
def small_gptq(tmp_path_factory) -> Path:
    return small_recipe(tmp_path_factory.mktemp("recipes"), "gptq-w4", samples=16)


def test_tune_allocates_within_budget_and_beats_its_base(tiny_gemma, small_gptq, tmp_path, capsys):
    cache = tmp_path / "cache"
    args = ["tune", "--model", str(tiny_gemma), "--recipe", str(small_gptq), "--device", "cpu",
            "--cache-dir", str(cache), "--sequences", "4"]  # fmt: skip
    rc, res = qship(capsys, *args, "--max-bits", "4.3", "--write-recipe", str(tmp_path / "t.yaml"),
                    "--out", str(tmp_path / "out"))  # fmt: skip
    assert rc == 0, res
    assert res["measurement_cached"] is False
    base_plan = plan_for_dir(tiny_gemma, load_recipe(small_gptq))
    tuned = load_recipe(tmp_path / "t.yaml")
    plan = plan_for_dir(tiny_gemma, tuned)
    assert base_plan.bits_per_weight.quantized < plan.bits_per_weight.quantized <= 4.3
    assert res["bits_per_weight"] == pytest.approx(plan.bits_per_weight.quantized)
    moved = {n for ns in res["moved"].values() for n in ns}
    by = plan.by_name()
    for m in base_plan.modules:  # moved modules changed scheme, the others did not
        assert (by[m.name].scheme != m.scheme) == (m.name in moved), m.name
    # what vLLM serves as one layer (q/k/v, gate/up) moves as one: some such sets moved whole
    sets = fused_sets(m.name for m in plan.modules if m.scheme)
    assert all(len({by[n].scheme for n in s}) == 1 for s in sets)
    assert any(len(s) > 1 and s[0] in moved for s in sets), res["moved"]
    text = (tmp_path / "t.yaml").read_text()
    assert "model.layers" not in text and "&id" not in text  # portable, no YAML aliases
    # verified end to end, exact KL, on the held-out windows: the tuned recipe wins
    v = {r["name"]: r for r in res["verified"]}
    assert set(v) == {"gptq-w4-small", tuned.name}
    assert all(r["kl_mode"] == "exact" for r in v.values())
    assert v[tuned.name]["kl_mean"] < 0.9 * v["gptq-w4-small"]["kl_mean"], v
    out = json.loads((tmp_path / "out" / "tune.json").read_text())
    front = out["frontier_predicted"]
    assert front[0][0] == pytest.approx(base_plan.bits_per_weight.quantized, abs=1e-3)
    assert (tmp_path / "out" / "tune.png").is_file()
    assert (tmp_path / "out" / "report" / "compare.md").is_file()

    # another budget: the measurement is reused, fewer bits, deterministic for the same budget
    rc, res2 = qship(capsys, *args, "--max-bits", "4.2", "--write-recipe",
                     str(tmp_path / "t2.yaml"), "--out", str(tmp_path / "out2"), "--no-verify")  # fmt: skip
    assert rc == 0, res2
    assert res2["measurement_cached"] is True and res2["bits_per_weight"] <= 4.2
    rc, res3 = qship(capsys, *args, "--max-bits", "4.2", "--write-recipe",
                     str(tmp_path / "t3.yaml"), "--out", str(tmp_path / "out3"), "--no-verify")  # fmt: skip
    assert rc == 0 and res3["moved"] == res2["moved"]
    assert (tmp_path / "t3.yaml").read_text() == (tmp_path / "t2.yaml").read_text()

    # --max-kl: the fewest bits whose verified KL reaches it, within --max-bits
    target = (v[tuned.name]["kl_mean"] + v["gptq-w4-small"]["kl_mean"]) / 2
    rc, res4 = qship(capsys, *args, "--max-kl", f"{target:.5f}", "--max-bits", "4.3",
                     "--write-recipe", str(tmp_path / "t4.yaml"), "--out", str(tmp_path / "out4"))  # fmt: skip
    assert rc == 0 and res4["met"] is True, res4
    assert res4["verified"][-1]["kl_mean"] <= target
    assert res4["bits_per_weight"] < res["bits_per_weight"]
    # a KL no recipe within the budget reaches: exit 4, the closest recipe still written
    rc, res5 = qship(capsys, *args, "--max-kl", "1e-6", "--max-bits", "4.2",
                     "--write-recipe", str(tmp_path / "t5.yaml"), "--out", str(tmp_path / "out5"))  # fmt: skip
    assert rc == 4 and "max-kl" in res5["message"]
    assert (tmp_path / "t5.yaml").is_file()


def test_tune_refuses_bad_input_before_compute(tiny_gemma, small_gptq, tmp_path, capsys):
    base = ["tune", "--model", str(tiny_gemma), "--recipe", str(small_gptq),
            "--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "o")]  # fmt: skip
    rc, err = qship(capsys, *base, "--write-recipe", str(tmp_path / "x.yaml"))
    assert rc == 2 and "budget" in err["message"]
    keep = tmp_path / "keep.yaml"
    keep.write_text("keep me\n")
    rc, err = qship(capsys, *base, "--write-recipe", str(keep), "--max-bits", "4.3")
    assert rc == 2 and "exists" in err["message"] and keep.read_text() == "keep me\n"
    rc, err = qship(capsys, *base, "--write-recipe", str(tmp_path / "y.yaml"), "--max-kl", "0.1",
                    "--no-verify")  # fmt: skip
    assert rc == 2 and "--no-verify" in err["path"]
    rc, err = qship(capsys, *base, "--write-recipe", str(tmp_path / "z.yaml"), "--max-bits", "3.0")
    assert rc == 2 and "cheapest" in err["message"]
    assert not (tmp_path / "c" / "tune-sensitivity").exists() or rc == 2
    assert not any((tmp_path / n).exists() for n in ("x.yaml", "y.yaml", "z.yaml"))
