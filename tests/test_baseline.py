"""Baselines in `qship compare`: bitsandbytes NF4 as a row without a recipe.

On the tiny trained Gemma 3 the bnb-nf4 row's exact KL, top-1 and perplexity equal a direct
computation with bitsandbytes (the reference and the model transformers loads with the same
BitsAndBytesConfig, on the same held-out tokens); the row has no gate, is never the
recommended recipe and says it is not servable by vLLM's fast kernels. Without bitsandbytes
the row says why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.compare import baseline
from pipeline.compare.output import write_report
from pipeline.compare.rows import unavailable_row
from pipeline.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
EVAL = {"sequences": 4, "seq_len": 64, "batch_size": 4, "tasks": [], "hub_tasks": []}


@pytest.fixture(scope="module")
def compared(tmp_path_factory, tiny_gemma, two_threads) -> dict:
    from pipeline import runner
    from pipeline.compare.compare import compare

    work = tmp_path_factory.mktemp("baseline")
    d = yaml.safe_load((ROOT / "recipes" / "rtn-w4.yaml").read_text())
    d.update(name="tiny-rtn", kv_cache=None, gates={"kl_mean_max": 5.0})
    d["calibration"].update(num_samples=4, seq_len=64, batch_size=4)
    d["evaluation"].update(EVAL)
    recipe = work / "tiny-rtn.yaml"
    recipe.write_text(yaml.safe_dump(d))
    res = compare(tiny_gemma, [recipe], work / "report", cache_dir=work / "cache",
                  device="cpu", exact=True, baselines=["bnb-nf4"])  # fmt: skip
    ctx = runner.Context(work / "cache", device="cpu")
    snap = runner.fetch_stage(str(tiny_gemma), ctx)
    from pipeline.recipe import load_recipe

    ids = runner.tokens_stage(snap, load_recipe(recipe), ctx).heldout_ids
    report = json.loads((work / "report" / "compare.json").read_text())
    return {"res": res, "report": report, "ids": ids, "out": work / "report", "recipe": recipe,
            "cache": work / "cache"}  # fmt: skip


def _direct_nf4(model: Path, ids: torch.Tensor) -> dict[str, float]:
    """KL(ref || NF4), top-1 and perplexities straight from transformers + bitsandbytes."""
    from transformers import AutoModelForCausalLM

    cfg = baseline.BASELINES["bnb-nf4"].config()
    ref = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    nf4 = AutoModelForCausalLM.from_pretrained(str(model), quantization_config=cfg,
                                               dtype=torch.float32).eval()  # fmt: skip
    with torch.no_grad():
        lp = torch.log_softmax(ref(ids.long()).logits[:, :-1].double(), -1)
        lq = torch.log_softmax(nf4(ids.long()).logits[:, :-1].double(), -1)
    nxt = ids.long()[:, 1:].unsqueeze(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1": (lp.argmax(-1) == lq.argmax(-1)).double().mean().item(),
        "ppl_reference": torch.exp(-lp.gather(-1, nxt).mean()).item(),
        "ppl_candidate": torch.exp(-lq.gather(-1, nxt).mean()).item(),
    }


def test_nf4_row_equals_direct_bitsandbytes(compared, tiny_gemma):
    row = {r["name"]: r for r in compared["report"]["rows"]}["bnb-nf4"]
    direct = _direct_nf4(tiny_gemma, compared["ids"])
    for k, v in direct.items():
        assert row[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert row["kl_mean"] > 1e-4  # NF4 changed the model: the comparison could fail
    # 4 bits + an 8-bit absmax per 64 + per-tensor constants (a 1 KB code book, its quant
    # state): 4.14 on Gemma 3 270M, more on the tiny 128-wide matrices
    assert 4.125 < row["bits_per_weight"] < 4.7
    assert row["size_bytes"] > 0 and row["formats"] == "NF4 g64 (bitsandbytes)"


def test_nf4_row_is_marked_and_never_recommended(compared):
    rep, res = compared["report"], compared["res"]
    row = {r["name"]: r for r in rep["rows"]}["bnb-nf4"]
    assert row["passed"] is None and "not servable by vLLM's fast kernels" in row["baseline"]
    assert res.best == "tiny-rtn" and "bnb-nf4" not in res.passed
    assert "bnb-nf4" not in rep["goals"].values()
    md = (compared["out"] / "compare.md").read_text()
    assert "Without qship (baselines, no gate): bnb-nf4 (" in md
    assert (compared["out"] / "baselines" / "bnb-nf4" / "eval.json").is_file()


def test_collect_keeps_the_baseline_row(compared, tmp_path):
    from pipeline.compare.compare import collect

    res = collect([compared["out"] / "recipes", compared["out"] / "baselines"], tmp_path)
    again = json.loads((tmp_path / "compare.json").read_text())
    assert res.recipes == ["bnb-nf4", "tiny-rtn"]
    assert again["rows"] == compared["report"]["rows"]


def test_matrix_job_measures_only_the_baseline(compared, tiny_gemma, tmp_path):
    """The CI path: `--matrix --baseline` lists a job that `--baselines-only` runs, whose
    eval.json holds the same row (the baseline entry and the evaluation from the cache)."""
    from pipeline.compare.compare import compare, matrix

    recipe = compared["recipe"]
    jobs = matrix([recipe], baselines=["bnb-nf4"])["include"]
    assert jobs[-1] == {"recipe": recipe.as_posix(), "name": "bnb-nf4", "baseline": "bnb-nf4"}
    res = compare(tiny_gemma, [recipe], tmp_path, cache_dir=compared["cache"], device="cpu",
                  exact=True, baselines=["bnb-nf4"], baselines_only=True)  # fmt: skip
    assert res.recipes == ["bnb-nf4"] and not (tmp_path / "recipes").exists()
    got = json.loads((tmp_path / "compare.json").read_text())["rows"]
    want = [r for r in compared["report"]["rows"] if r["name"] == "bnb-nf4"]
    assert got == want
    with pytest.raises(UsageError):
        matrix([recipe], baselines=["bnb-nf4", "bnb-nf4"])


def test_absent_bitsandbytes_row_says_why(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` fails
    why = baseline.unavailable()
    assert why is not None and "pip install 'qship[bnb]'" in why
    report = write_report([unavailable_row("bnb-nf4", why)], tmp_path)
    assert report["best"] is None
    assert f"bnb-nf4 {why}" in (tmp_path / "compare.md").read_text()


def test_unknown_baseline_is_a_usage_error():
    with pytest.raises(UsageError) as e:
        baseline.get("gptq-nf3")
    assert e.value.exit_code == 2 and "bnb-nf4" in str(e.value.hint)
