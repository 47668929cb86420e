"""The issue-17 levers as recipe methods, on the tiny trained Llama (CPU, 16 x 128 tokens):
AutoRound (`method: autoround`) and AWQ's scales under GPTQ rounding (`awq_scales`) quantize
as planned, reload, and round better than RTN at the same scheme; what llm-compressor 0.14
cannot do is refused before any compute (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_quantize import _mean_kl
from transformers import AutoTokenizer

from pipeline.data.tokens import build_token_sets
from pipeline.errors import RecipeError
from pipeline.quantize import quantize
from pipeline.quantize.plan import plan_for_dir
from pipeline.recipe import Recipe, load_recipe

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("two_threads")


def _variant(name: str, method: str, options: dict | None = None, **scheme) -> Recipe:
    d = load_recipe(ROOT / "recipes" / "gptq-w4.yaml").model_dump(mode="json")
    d.update(name=name, kv_cache=None)
    d["calibration"].update(num_samples=16, seq_len=128, batch_size=16)
    d["evaluation"].update(sequences=8, seq_len=128, tasks=[])
    g = d["groups"][0]
    g.update(method=method, options=options or {})
    g["scheme"].update({"symmetric": False, **scheme})
    return Recipe.model_validate(d)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_llama):
    work = tmp_path_factory.mktemp("methods")
    done: dict = {}

    def get(r: Recipe):
        if r.name not in done:
            tok = AutoTokenizer.from_pretrained(tiny_llama)
            ts = build_token_sets(tok, r.calibration, r.evaluation, cache_dir=work / "cache")
            q = quantize(tiny_llama, r, work / r.name, tokens=ts, device="cpu")
            done[r.name] = (q, _mean_kl(tiny_llama, q.path, ts.heldout_ids))
        return done[r.name]

    return get


def test_autoround_and_awq_scales_beat_rtn(run):
    q_rtn, kl_rtn = run(_variant("rtn-a", "rtn"))
    q_ar, kl_ar = run(_variant("autoround-a", "autoround", {"iters": 50}))
    q_awq, kl_awq = run(_variant("gptq-awq-a", "gptq", {"awq_scales": True}))
    for q, method in ((q_ar, "autoround"), (q_awq, "gptq")):
        # quantize's own check held the saved config to the plan; the plan says the method
        assert {m.method for m in q.plan.modules if m.scheme} == {method}
        assert {m.scheme for m in q.plan.modules if m.scheme} == {
            m.scheme for m in q_rtn.plan.modules if m.scheme
        }
    # AWQ's mappings are planned for the GPTQ group that asked for the scales
    assert any(mp.applied for mp in q_awq.plan.mappings)
    assert not q_rtn.plan.mappings
    print(f"\nKL rtn {kl_rtn:.5f}  autoround {kl_ar:.5f}  awq+gptq {kl_awq:.5f}")
    assert kl_ar < 0.9 * kl_rtn and kl_awq < 0.9 * kl_rtn


def test_autoround_takes_other_bits_but_one_group_size(tiny_llama):
    r = _variant("ar-mixed", "autoround", {"iters": 5})
    d = r.model_dump(mode="json")
    up = {**d["groups"][0], "name": "up", "roles": [],
          "targets": ["re:.*layers\\.0\\.mlp\\.down_proj$"]}  # fmt: skip
    d["groups"][0]["exclude"] = ["re:.*layers\\.0\\.mlp\\.down_proj$"]
    d["groups"].insert(1, up)
    up["scheme"] = {**up["scheme"], "bits": 8}
    plan = plan_for_dir(tiny_llama, Recipe.model_validate(d))  # other bits: planned
    assert {m.scheme.bits for m in plan.modules if m.scheme} == {4, 8}
    up["scheme"] = {**up["scheme"], "bits": 4, "group_size": 64}
    with pytest.raises(RecipeError, match="one group size"):
        plan_for_dir(tiny_llama, Recipe.model_validate(d))


@pytest.mark.parametrize(
    "method,options,scheme,msg",
    [
        ("autoround", {}, {"symmetric": True}, "negative scales"),
        ("gptq", {"actorder": "group"}, {}, "actorder 'group'"),
        ("autoround", {"awq_scales": True}, {}, "do not apply"),
        ("awq", {"iters": 10}, {}, "do not apply"),
    ],
)
def test_what_the_library_cannot_do_is_refused(method, options, scheme, msg):
    with pytest.raises(Exception, match=msg):
        _variant("bad", method, options, **scheme)
