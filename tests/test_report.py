"""Report (pure) and the CI parts of compare (--matrix, --collect) on synthetic eval.json."""

from __future__ import annotations

import csv
import io
import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from factories import eval_file
from PIL import Image

from pipeline.cli import main
from pipeline.compare.compare import collect, matrix
from pipeline.compare.output import REPORT_FILES, write_report
from pipeline.compare.report import (
    best_by_width,
    best_per_column,
    best_recipe,
    pareto_front,
    recommendation,
    summarise_rows,
)
from pipeline.compare.rows import row, row_from_file
from pipeline.errors import UsageError
from pipeline.evaluate.kl_stats import KL_HIST_EDGES, kl_histogram
from pipeline.evaluate.paired import paired
from pipeline.records import Check, EvalFile, Probe, Verdict
from pipeline.records.benchmarks import TaskResult

PNG_SIG = b"\x89PNG\r\n\x1a\n"
REF = {str(i): float(i < 60) for i in range(100)}
TASKS = {
    "arc_easy": TaskResult(status="ok", metric="acc_norm", split="validation", n_total=570,
                           **paired(REF, {**REF, **{str(i): 0.0 for i in range(10)}},
                                    where="arc_easy")).to_json(),
    "hub_task": {"status": "skipped", "reason": "offline"},
}  # fmt: skip


def fake_eval(name: str, bits: float, scale: float, passed: bool, seed: int = 0) -> EvalFile:
    """An eval.json as compare writes it (records built from synthetic per-token KL)."""
    tasks = json.loads(json.dumps(TASKS))
    tasks["arc_easy"]["drop_pp"] -= seed  # recipes differ in their drop
    probe = eval_file(name, bits, scale, None, seed=seed, tasks=tasks)
    check = Check(name="kl_mean_max", value=probe.metrics.kl.mean, limit=0.3, op="<=",
                  passed=passed)  # fmt: skip
    return probe.model_copy(update={"verdict": Verdict(passed=passed, checks=[check])})


RECIPES = [
    ("gptq-w4", 4.125, 0.17, True),
    ("rtn-w4", 4.125, 0.6, False),
    ("awq-w4", 4.156, 0.36, False),
    ("w8", 8.06, 0.01, True),
]


@pytest.fixture
def evals() -> list[EvalFile]:
    return [fake_eval(n, b, s, p, seed=i) for i, (n, b, s, p) in enumerate(RECIPES)]


class _Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []
        self.imgs: list[str] = []

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ("src", "href", "srcset", "action", "data", "poster", "xlink:href"):
                self.refs.append((tag, k, v or ""))
            if tag == "img" and k == "src":
                self.imgs.append(v or "")


def _check_png(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIG and data[12:16] == b"IHDR"
    im = Image.open(io.BytesIO(data))
    im.verify()
    im = Image.open(io.BytesIO(data))
    im.load()
    assert im.format == "PNG" and im.width > 300 and im.height > 200
    return im.size


def test_histogram_is_fixed_and_complete():
    v = np.concatenate([[0.0, 1e-9], np.logspace(-5, 1.9, 500), [1e3]])
    h = kl_histogram(v)
    assert h["edges"] == KL_HIST_EDGES and len(h["counts"]) == len(KL_HIST_EDGES) - 1
    assert h["zero"] == 2 and sum(h["counts"]) + h["zero"] == v.size
    assert h["counts"][-1] >= 1  # 1e3 clipped into the last bin


def test_row_maps_eval_json(evals):
    ev = evals[0]
    r = row(ev)
    assert r["name"] == "gptq-w4" and r["recipe"] == "recipes/gptq-w4.yaml"
    m = ev.metrics
    assert r["kl_mean"] == m.kl.mean and r["kl_p99"] == m.kl.p99
    assert r["top1"] == m.top1_agreement and r["ppl_ratio"] == m.ppl_ratio
    assert r["bits_per_weight"] == 4.125 and r["size_bytes"] == 412500
    assert r["quantize_s"] == 1.5 and r["peak_mem_bytes"] == 10**9
    assert r["passed"] is True and r["tasks"] == {"arc_easy": pytest.approx(10.0)}
    lo, hi = r["task_ci"]["arc_easy"]
    assert lo < 10.0 < hi
    assert sum(r["kl_hist"]["counts"]) + r["kl_hist"]["zero"] == m.tokens


def test_selection_rules():
    rows = [
        {"name": "a", "bits_per_weight": 4.0, "kl_mean": 0.2, "passed": True, "top1": 0.7},
        {"name": "b", "bits_per_weight": 4.5, "kl_mean": 0.2, "passed": True, "top1": 0.8},
        {"name": "c", "bits_per_weight": 8.0, "kl_mean": 0.01, "passed": False, "top1": 0.9},
        {"name": "d", "bits_per_weight": 4.2, "kl_mean": 0.3, "passed": True, "top1": 0.9},
    ]
    assert best_recipe(rows) == "a"  # c is better but failed; a ties b on KL, fewer bits
    assert pareto_front(rows) == ["a", "c"]
    best = best_per_column(rows)
    assert best["kl_mean"] == ["c"] and best["bits_per_weight"] == ["a"]
    assert sorted(best["top1"]) == ["c", "d"]  # ties all marked
    assert best_recipe([{**r, "passed": False} for r in rows]) is None
    # per weight width: the failed 8-bit row gives no 8-bit winner; a passing one does
    assert best_by_width(rows) == {"4": "a"}
    rows[2]["passed"] = True
    assert best_by_width(rows) == {"4": "a", "8": "c"} and best_recipe(rows) == "c"


def _report(rows: list[dict]) -> dict:
    from pipeline.compare.report import summarise_rows

    return summarise_rows([{"kl_stderr": 0.001, **r} for r in rows])


def test_recommendation_per_goal_never_names_a_refused_recipe():
    """Per goal: the smallest recipe that passes its gate, the lowest KL within each bit
    budget; a recipe today's rules refuse (a split fused set) is named only as one not to
    ship, even with the best figures; shipped winners are named; `qship tune` is suggested
    unless a recipe it wrote (`<base>-tune<bits>`) is among the rows."""
    rows = [
        {"name": "rtn-w4", "bits_per_weight": 4.125, "kl_mean": 0.5, "passed": True},
        {"name": "autoround-w4a", "bits_per_weight": 4.156, "kl_mean": 0.15, "passed": True},
        {"name": "old-tuned", "bits_per_weight": 4.2, "kl_mean": 0.12, "passed": True,
         "refused": "its plan splits 3 fused set(s) vLLM loads as one layer"},
        {"name": "w8-int8", "bits_per_weight": 8.02, "kl_mean": 0.003, "passed": True},
        {"name": "awq-w4", "bits_per_weight": 4.0, "kl_mean": 0.4, "passed": False},
    ]  # fmt: skip
    rep = _report(rows)
    assert rep["goals"] == {"smallest_passing": "rtn-w4",
                            "lowest_kl_at_4.25_bits": "autoround-w4a",
                            "lowest_kl_at_8.25_bits": "w8-int8"}  # fmt: skip
    assert rep["best"] == "w8-int8"
    text = recommendation(rep)
    assert "Smallest that passes its gate: **rtn-w4**" in text
    assert "Lowest KL at ≤ 4.25 bits: **autoround-w4a** (4.156 bits/weight" in text
    assert "Lowest KL at ≤ 8.25 bits: **w8-int8**" in text
    assert "**old-tuned**" not in text and "Not to ship, whatever their figures: old-tuned" in text
    assert "autoround-w4a for the least KL" in text and "qship tune --recipe" in text
    tuned = _report([{**rows[0], "name": "gptq-w4a-mse-tune4.248"}])
    assert "qship tune" not in recommendation(tuned)
    none = _report([{**r, "passed": False} for r in rows])
    assert recommendation(none).startswith("No recipe passed")


def test_the_named_winners_are_shipped_recipes(repo_root):
    """Every recipe the recommendation names as a shipped winner is a file in recipes/ (a
    renamed or withdrawn recipe must leave the list), and a tuned winner among the rows is
    named with its goal."""
    from pipeline.compare.report import WINNERS

    shipped = {p.stem for p in (repo_root / "recipes").rglob("*.yaml")}
    assert set(WINNERS) <= shipped, set(WINNERS) - shipped
    rep = _report([{"name": "autoround-w4a-tune4.249-nokv", "bits_per_weight": 4.249,
                    "kl_mean": 0.118, "passed": True}])  # fmt: skip
    assert "autoround-w4a-tune4.249-nokv for the least KL within 4.25 bits on Gemma 3 270M" in (
        recommendation(rep)
    )


def test_a_collected_row_whose_plan_splits_a_fused_set_is_refused(evals, tmp_path, repo_root):
    from transformers import AutoConfig

    from pipeline.compare.rows import refused_by_plan
    from pipeline.quantize import plan_for_config
    from pipeline.recipe import load_recipe
    from pipeline.records.plan import ModulePlan, Plan

    config = AutoConfig.from_pretrained(repo_root / "tests" / "fixtures" / "models" / "tiny-llama")
    good = plan_for_config(config, load_recipe(repo_root / "recipes" / "gptq-w4.yaml"))
    (tmp_path / "plan.json").write_text(json.dumps(good.to_json()))
    assert refused_by_plan(tmp_path / "plan.json") is None
    mods: list[ModulePlan] = list(good.modules)
    i = next(i for i, m in enumerate(mods) if m.name.endswith("self_attn.k_proj"))
    assert mods[i].scheme is not None
    mods[i] = mods[i].model_copy(update={"scheme": mods[i].scheme.model_copy(
        update={"group_size": 64})})  # fmt: skip
    split = Plan.model_validate({**good.model_dump(), "modules": mods})
    (tmp_path / "plan.json").write_text(json.dumps(split.to_json()))
    assert "splits 1 fused set" in (refused_by_plan(tmp_path / "plan.json") or "")


def test_duplicate_names_refused(evals):
    rows = [row(evals[0]), row(evals[0])]
    with pytest.raises(UsageError, match="same recipe name"):
        summarise_rows(rows)


def test_report_files_md_csv_json(evals, tmp_path):
    rows = [row(e) for e in evals]
    rep = write_report(rows, tmp_path)
    for f in REPORT_FILES:
        assert (tmp_path / f).is_file(), f
    # w8 passes with the lowest KL: the best, though 4-bit gptq-w4 is also on the front
    assert rep["best"] == "w8" and rep["pareto_bits_vs_kl"] == ["gptq-w4", "w8"]
    assert json.loads((tmp_path / "compare.json").read_text()) == rep

    md = (tmp_path / "compare.md").read_text()
    assert "recipe (lowest mean KL, tie → fewer bits): **w8**" in md
    w8_line = next(line for line in md.splitlines() if line.startswith("| w8"))
    assert f"**{rep['rows'][3]['kl_mean']:.4g}**" in w8_line  # best mean KL marked
    assert "FAIL (kl_mean_max)" in md

    got = list(csv.DictReader(io.StringIO((tmp_path / "compare.csv").read_text())))
    assert [g["name"] for g in got] == rep["recipes"]
    for g, r in zip(got, rep["rows"], strict=True):
        assert float(g["kl_mean"]) == r["kl_mean"]  # repr round-trips exactly
        assert float(g["bits_per_weight"]) == r["bits_per_weight"]
        assert float(g["task:arc_easy"]) == r["tasks"]["arc_easy"]


def test_html_self_contained_and_pngs_valid(evals, tmp_path):
    write_report([row(e) for e in evals], tmp_path)
    for png in ("pareto.png", "kl_distribution.png", "task_drop_vs_kl.png"):
        _check_png((tmp_path / png).read_bytes())
    text = (tmp_path / "compare.html").read_text()
    p = _Refs()
    p.feed(text)
    assert len(p.imgs) == 3 and "accuracy drop vs mean KL" in text
    for tag, attr, v in p.refs:
        assert v.startswith("data:") or v.startswith("#"), (tag, attr, v[:80])
    assert "http://" not in text and "https://" not in text
    assert "@import" not in text and "url(" not in text
    import base64

    pngs = [base64.b64decode(s.split(",", 1)[1]) for s in p.imgs]
    assert pngs[0] == (tmp_path / "pareto.png").read_bytes()
    for data in pngs:
        _check_png(data)


def test_report_without_matplotlib_keeps_tables_and_drops_figures(evals, tmp_path, monkeypatch):
    """A bare GPU host: every table and the HTML page, no PNG, no error; tune's figure too."""
    import sys

    from pipeline.compare.plots import plot_tune

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    write_report([row(e) for e in evals], tmp_path)
    assert all((tmp_path / f).is_file() for f in REPORT_FILES if not f.endswith(".png"))
    assert not list(tmp_path.glob("*.png"))
    p = _Refs()
    p.feed((tmp_path / "compare.html").read_text())
    assert not p.imgs
    assert plot_tune([(4.1, 0.5), (4.2, 0.4)], 0.3, [], 4.25, None) is None


def test_report_is_deterministic(evals, tmp_path):
    rows = [row(e) for e in evals]
    write_report(rows, tmp_path / "a")
    write_report(list(reversed(rows)), tmp_path / "b")
    for f in REPORT_FILES:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_recipes_without_histogram_still_plot(evals, tmp_path):
    rows = [row(e) for e in evals]
    for r in rows:
        r["kl_hist"] = None
    write_report(rows, tmp_path)
    _check_png((tmp_path / "kl_distribution.png").read_bytes())


# ------------------------------------------------------------------ matrix / collect


def test_matrix_cli(capsys, repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)
    assert (
        main(["compare", "--matrix", "--recipes", "recipes/rtn-w4.yaml", "recipes/gptq-w4.yaml"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one line: fits $GITHUB_OUTPUT
    assert json.loads(out) == {
        "include": [
            {"recipe": "recipes/rtn-w4.yaml", "name": "rtn-w4"},
            {"recipe": "recipes/gptq-w4.yaml", "name": "gptq-w4"},
        ]
    }
    # default: every recipes/*.yaml a CPU runner can afford; with a GPU declared, all of them
    assert main(["compare", "--matrix", "--device", "cuda"]) == 0
    names = [j["name"] for j in json.loads(capsys.readouterr().out)["include"]]
    assert len(names) == len(list((repo_root / "recipes").glob("*.yaml"))) == len(set(names))
    assert main(["compare", "--matrix"]) == 0
    on_cpu = [j["name"] for j in json.loads(capsys.readouterr().out)["include"]]
    assert "autoround-w4a" in names and "autoround-w4a" not in on_cpu
    assert set(on_cpu) == set(names) - {"autoround-w4a"}


def test_matrix_refuses_duplicate_names(tmp_path, repo_root):
    src = (repo_root / "recipes" / "rtn-w4.yaml").read_text()
    (tmp_path / "a.yaml").write_text(src)
    (tmp_path / "b.yaml").write_text(src)
    with pytest.raises(UsageError, match="both named"):
        matrix([tmp_path / "a.yaml", tmp_path / "b.yaml"])
    assert (
        main(
            ["compare", "--matrix", str(tmp_path / "a.yaml"), "--recipes", str(tmp_path / "b.yaml")]
        )
        == 2
    )


def _write_jobs(root: Path, evals: list[EvalFile]) -> None:
    for ev in evals:
        assert ev.quantize is not None
        d = root / f"eval-{ev.quantize.name}"  # one folder per downloaded CI artifact
        d.mkdir(parents=True)
        (d / "eval.json").write_text(json.dumps(ev.to_json()))


def test_collect_equals_direct_report(evals, tmp_path, capsys):
    _write_jobs(tmp_path / "jobs", evals)
    direct = write_report([row(e) for e in evals], tmp_path / "direct")
    rc = main(
        ["compare", "--collect", str(tmp_path / "jobs"), "--out", str(tmp_path / "rep"), "--json"]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["best"] == "w8" and res["best_dir"].endswith("eval-w8")
    assert json.loads((tmp_path / "rep" / "compare.json").read_text()) == direct
    for f in REPORT_FILES:
        assert (tmp_path / "rep" / f).read_bytes() == (tmp_path / "direct" / f).read_bytes(), f


def test_collect_several_dirs_and_none_passing(evals, tmp_path, capsys):
    failing = [e for e in evals if e.verdict and not e.verdict.passed]
    _write_jobs(tmp_path / "j1", failing[:1])
    _write_jobs(tmp_path / "j2", failing[1:])
    args = ["compare", "--collect", str(tmp_path / "j1"), str(tmp_path / "j2")]
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "rep"), "--json"]) == 4  # nothing to ship
    out = json.loads(capsys.readouterr().out)  # one object: the error and the result
    assert out["exit_code"] == 4 and out["result"]["best"] is None
    rep = json.loads((tmp_path / "rep" / "compare.json").read_text())  # still written
    assert rep["best"] is None and len(rep["rows"]) == 2
    assert (
        main(["compare", "--collect", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    )


def test_collect_eval_without_quantize_figures_and_bad_files(evals, tmp_path, capsys):
    """`qship evaluate` on a folder that quantize did not write: a row named by its folder,
    with no size figures; a file that is not a qship record is exit 2, naming it."""
    d = tmp_path / "art"
    d.mkdir()
    bare = evals[0].model_copy(update={"quantize": None})
    (d / "eval.json").write_text(json.dumps(bare.to_json()))
    r = row_from_file(d / "eval.json")
    assert r["name"] == "art" and r["bits_per_weight"] is None and r["size_bytes"] is None
    assert r["kl_mean"] == evals[0].metrics.kl.mean
    res = collect([d], tmp_path / "rep")
    assert res.recipes == ["art"] and res.best == "art"
    h = json.loads((tmp_path / "rep" / "compare.json").read_text())["rows"][0]["kl_hist"]
    assert sum(h["counts"]) + h["zero"] == evals[0].metrics.tokens
    (d / "eval.json").write_text(json.dumps({"metrics": {"kl": {"mean": 0.1}}}))
    capsys.readouterr()
    assert main(["compare", "--collect", str(d), "--out", str(tmp_path / "r2"), "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["path"] == str(d / "eval.json") and "EvalFile" in err["message"]


def test_collect_qship_run_layout(evals, tmp_path):
    """What a CI job running `qship run --out results/NAME` uploads: the report folder
    NAME.report (always) and the artifact NAME (only when the gate passed), both with the
    same eval.json. One row per recipe; best_dir = the artifact to publish."""
    for ev in evals[:2]:  # gptq-w4 passed, rtn-w4 failed
        assert ev.quantize is not None and ev.verdict is not None
        name = ev.quantize.name
        job = tmp_path / "results" / f"qship-{name}"
        rep = job / f"{name}.report"
        rep.mkdir(parents=True)
        (rep / "eval.json").write_text(json.dumps(ev.to_json()))
        if ev.verdict.passed:
            art = job / name
            art.mkdir()
            probe = Probe(prompt_ids=[1], top_k=1, top_ids=[[2]], top_logits=[[0.5]])
            (art / "eval.json").write_text(
                json.dumps(ev.model_copy(update={"probe": probe}).to_json())
            )
    res = collect([tmp_path / "results"], tmp_path / "report")
    rows = {
        r["name"]: r for r in json.loads((tmp_path / "report" / "compare.json").read_text())["rows"]
    }
    assert sorted(rows) == ["gptq-w4", "rtn-w4"]
    assert rows["gptq-w4"]["size_bytes"] == evals[0].quantize.size_bytes
    assert rows["gptq-w4"]["passed"] is True and rows["rtn-w4"]["passed"] is False
    assert res.best == "gptq-w4"
    assert res.best_dir == str(tmp_path / "results" / "qship-gptq-w4" / "gptq-w4")


def test_compare_prints_the_limits_its_rows_support(evals, tmp_path):
    """Issue 57 item 7: the shipped gates are another model's (Gemma's, Qwen's); the report
    prints, per recipe, the limits its measurement on *this* model supports (10 % more loss
    than measured, rounded up) beside the recipe's own, so a team sets its own gates."""
    from pipeline.compare.report import supported_limits

    # fp8-dynamic's row on Gemma 3 270M (its recipe's origin): 10 % more loss, rounded up
    assert supported_limits({"kl_mean": 0.0278, "kl_p99": 0.198, "top1": 0.910,
                             "ppl_ratio": 1.032}) == {"kl_mean_max": 0.0306,
                                                      "kl_p99_max": 0.218, "top1_min": 0.901,
                                                      "ppl_ratio_max": 1.0352}  # fmt: skip
    rows = [row(e) for e in evals]
    rep = write_report(rows, tmp_path)
    for r in rep["rows"]:
        lim = rep["supported_limits"][r["name"]]
        # each measured row passes the limits it supports, and by about the headroom
        assert r["kl_mean"] <= lim["kl_mean_max"] <= r["kl_mean"] * 1.11
        assert r["kl_p99"] <= lim["kl_p99_max"] and r["top1"] >= lim["top1_min"]
        assert 1 - lim["top1_min"] <= (1 - r["top1"]) * 1.11
        assert r["ppl_ratio"] <= lim["ppl_ratio_max"]
    md = (tmp_path / "compare.md").read_text()
    section = md[md.index("## Gate limits these measurements support") :]
    gptq = next(line for line in section.splitlines() if line.startswith("| gptq-w4 |"))
    want = rep["supported_limits"]["gptq-w4"]["kl_mean_max"]
    assert f"| {want:g} (0.3) |" in gptq, gptq  # supported, then the recipe's own limit


def test_compare_prints_the_supported_limits(evals, tmp_path, capsys):
    """The command's own printout (not only the report files) lists them per recipe."""
    _write_jobs(tmp_path / "jobs", evals)
    res = collect([tmp_path / "jobs"], tmp_path / "rep")
    want = write_report([row(e) for e in evals], tmp_path / "direct")["supported_limits"]
    assert res.supported_limits == want
    text = res.summary()
    assert "limits these rows support on this model (10% more loss than measured)" in text
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("gptq-w4:"))
    assert f"kl_mean_max {want['gptq-w4']['kl_mean_max']:g}" in line, text
