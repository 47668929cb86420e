"""Report (pure) and the CI parts of compare (--matrix, --collect) on synthetic eval.json."""

from __future__ import annotations

import csv
import io
import json
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline import kl_stats
from pipeline.cli import main
from pipeline.compare import collect, compare_block, matrix, row_from_file
from pipeline.errors import UsageError
from pipeline.report import (
    KL_HIST_EDGES,
    REPORT_FILES,
    best_by_width,
    best_per_column,
    best_recipe,
    kl_histogram,
    pareto_front,
    row_from_eval,
    summarise_rows,
    write_report,
)

PNG_SIG = b"\x89PNG\r\n\x1a\n"


def fake_eval(name: str, bits: float, scale: float, passed: bool, seed: int = 0) -> dict:
    """An eval.json as compare writes it: evaluate's summary + verdict + compare block."""
    rng = np.random.default_rng(seed)
    n = 2000
    kl = rng.lognormal(np.log(scale) - 1.5, 1.5, n)
    metrics = kl_stats.summarise(
        kl, rng.random(n) < 0.8, rng.random(n) * 3, rng.random(n) * 3.1, rng.normal(0, 0.01, n)
    )
    ev = {"metrics": metrics}
    ev["benchmarks"] = {
        "tasks": {
            "tiny_mc": {
                "status": "ok",
                "metric": "acc",
                "reference": {"value": 0.6},
                "candidate": {"value": 0.5 + 0.01 * seed},
                "drop": 0.1 - 0.01 * seed,
            },
            "hub_task": {"status": "skipped", "reason": "offline"},
        }
    }
    ev["verdict"] = {
        "passed": passed,
        "checks": [
            {"name": "kl_mean_max", "value": metrics["kl"]["mean"], "limit": 0.3, "passed": passed}
        ],
    }
    qrep = {
        "recipe": name,
        "recipe_hash": f"{seed:064x}",
        "checkpoint": {"bits_per_weight_quantized": bits, "bytes": int(bits * 1e5)},
        "timings": {"total": 1.5 + seed},
        "peak_memory": {"peak_rss_bytes": 10**9 + seed},
    }
    ev["compare"] = compare_block(
        name=name, recipe=f"recipes/{name}.yaml", quantize_report=qrep, kl_tokens=kl
    )
    return ev


RECIPES = [
    ("gptq-w4", 4.125, 0.17, True),
    ("rtn-w4", 4.125, 0.6, False),
    ("awq-w4", 4.156, 0.36, False),
    ("w8", 8.06, 0.01, True),
]


@pytest.fixture
def evals() -> list[dict]:
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
    r = row_from_eval(ev)
    assert r["name"] == "gptq-w4" and r["recipe"] == "recipes/gptq-w4.yaml"
    m = ev["metrics"]
    assert r["kl_mean"] == m["kl"]["mean"] and r["kl_p99"] == m["kl"]["p99"]
    assert r["top1"] == m["top1_agreement"] and r["ppl_ratio"] == m["ppl_ratio"]
    assert r["bits_per_weight"] == 4.125 and r["size_bytes"] == 412500
    assert r["quantize_s"] == 1.5 and r["peak_mem_bytes"] == 10**9
    assert r["passed"] is True and r["tasks"] == {"tiny_mc": 0.5}
    assert sum(r["kl_hist"]["counts"]) + r["kl_hist"]["zero"] == m["tokens"]


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


def test_duplicate_names_refused(evals):
    rows = [row_from_eval(evals[0]), row_from_eval(evals[0])]
    with pytest.raises(UsageError, match="same recipe name"):
        summarise_rows(rows)


def test_report_files_md_csv_json(evals, tmp_path):
    rows = [row_from_eval(e) for e in evals]
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
        assert float(g["task:tiny_mc"]) == r["tasks"]["tiny_mc"]


def test_html_self_contained_and_pngs_valid(evals, tmp_path):
    write_report([row_from_eval(e) for e in evals], tmp_path)
    for png in ("pareto.png", "kl_distribution.png"):
        _check_png((tmp_path / png).read_bytes())
    text = (tmp_path / "compare.html").read_text()
    p = _Refs()
    p.feed(text)
    assert len(p.imgs) == 2
    for tag, attr, v in p.refs:
        assert v.startswith("data:") or v.startswith("#"), (tag, attr, v[:80])
    assert "http://" not in text and "https://" not in text
    assert "@import" not in text and "url(" not in text
    import base64

    pngs = [base64.b64decode(s.split(",", 1)[1]) for s in p.imgs]
    assert pngs[0] == (tmp_path / "pareto.png").read_bytes()
    for data in pngs:
        _check_png(data)


def test_report_is_deterministic(evals, tmp_path):
    rows = [row_from_eval(e) for e in evals]
    write_report(rows, tmp_path / "a")
    write_report(list(reversed(rows)), tmp_path / "b")
    for f in REPORT_FILES:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_recipes_without_histogram_still_plot(evals, tmp_path):
    rows = [row_from_eval(e) for e in evals]
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
    assert main(["compare", "--matrix"]) == 0  # default: every recipes/*.yaml
    names = [j["name"] for j in json.loads(capsys.readouterr().out)["include"]]
    assert len(names) == len(list((repo_root / "recipes").glob("*.yaml"))) == len(set(names))


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


def _write_jobs(root: Path, evals: list[dict]) -> None:
    for ev in evals:
        d = root / f"eval-{ev['compare']['name']}"  # one folder per downloaded CI artifact
        d.mkdir(parents=True)
        (d / "eval.json").write_text(json.dumps(ev))


def test_collect_equals_direct_report(evals, tmp_path, capsys):
    _write_jobs(tmp_path / "jobs", evals)
    direct = write_report([row_from_eval(e) for e in evals], tmp_path / "direct")
    rc = main(
        ["compare", "--collect", str(tmp_path / "jobs"), "--out", str(tmp_path / "rep"), "--json"]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["best"] == "w8" and res["best_dir"].endswith("eval-w8")
    assert json.loads((tmp_path / "rep" / "compare.json").read_text()) == direct
    for f in REPORT_FILES:
        assert (tmp_path / "rep" / f).read_bytes() == (tmp_path / "direct" / f).read_bytes(), f


def test_collect_several_dirs_and_none_passing(evals, tmp_path):
    failing = [e for e in evals if not e["verdict"]["passed"]]
    _write_jobs(tmp_path / "j1", failing[:1])
    _write_jobs(tmp_path / "j2", failing[1:])
    rc = main(
        [
            "compare",
            "--collect",
            str(tmp_path / "j1"),
            str(tmp_path / "j2"),
            "--out",
            str(tmp_path / "rep"),
        ]
    )
    assert rc == 4  # nothing to ship; the report is still written
    rep = json.loads((tmp_path / "rep" / "compare.json").read_text())
    assert rep["best"] is None and len(rep["rows"]) == 2
    assert (
        main(["compare", "--collect", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    )


def test_collect_without_compare_block_reads_siblings(evals, tmp_path):
    """An eval.json from another command: figures from quantize_report.json / files beside it."""
    ev = dict(evals[0])
    block = ev.pop("compare")
    d = tmp_path / "art"
    d.mkdir()
    (d / "eval.json").write_text(json.dumps(ev))
    (d / "model.safetensors").write_bytes(b"x" * 1234)
    r = row_from_file(d / "eval.json")
    assert r["name"] == "art" and r["size_bytes"] == 1234 and r["bits_per_weight"] is None
    (d / "quantize_report.json").write_text(
        json.dumps(
            {
                "recipe": "gptq-w4",
                "checkpoint": {"bits_per_weight_quantized": 4.125, "bytes": 99},
                "timings": {"total": 2.0},
            }
        )
    )
    r = row_from_file(d / "eval.json")
    assert (r["name"], r["bits_per_weight"], r["size_bytes"], r["quantize_s"]) == (
        "gptq-w4",
        4.125,
        99,
        2.0,
    )
    assert r["kl_mean"] == row_from_eval({**ev, "compare": block})["kl_mean"]
    res = collect([d], tmp_path / "rep")
    # evaluate stores the per-token histogram itself: a CI job's eval.json plots as well
    h = res.report["rows"][0]["kl_hist"]
    assert h == ev["metrics"]["kl_hist"] and sum(h["counts"]) + h["zero"] == ev["metrics"]["tokens"]


def test_collect_qship_run_layout(evals, tmp_path):
    """What a CI job running `qship run --out results/NAME` uploads: the report folder
    NAME.report (eval.json, plan.json, run.json; always) and the artifact NAME (eval.json,
    provenance.json, weights; only when the gate passed). One row per recipe, figures from
    those files, best_dir = the artifact to publish."""
    for ev in evals[:2]:  # gptq-w4 passed, rtn-w4 failed
        name = ev["compare"]["name"]
        plain = {k: v for k, v in ev.items() if k != "compare"}
        job = tmp_path / "results" / f"qship-{name}"
        rep = job / f"{name}.report"
        rep.mkdir(parents=True)
        (rep / "eval.json").write_text(json.dumps(plain))
        (rep / "plan.json").write_text(
            json.dumps(
                {
                    "recipe_name": name,
                    "bits_per_weight": {"quantized": ev["compare"]["bits_per_weight"]},
                    "expected_checkpoint_bytes": 777,
                }
            )
        )
        (rep / "run.json").write_text(
            json.dumps({"stages": [{"stage": "quantize", "recipe": name, "seconds": 0.1}]})
        )
        if plain["verdict"]["passed"]:
            art = job / name
            art.mkdir()
            (art / "eval.json").write_text(json.dumps({**plain, "probe": {}}))
            (art / "model.safetensors").write_bytes(b"x" * 4321)
            (art / "provenance.json").write_text(
                json.dumps(
                    {
                        "recipe_sha256_resolved": "ab" * 32,
                        "quantize": {"seconds": 12.5, "peak_memory": {"peak_rss_bytes": 5}},
                    }
                )
            )
    res = collect([tmp_path / "results"], tmp_path / "report")
    rows = {r["name"]: r for r in res.report["rows"]}
    assert sorted(rows) == ["gptq-w4", "rtn-w4"]
    g, r = rows["gptq-w4"], rows["rtn-w4"]
    assert (g["size_bytes"], g["quantize_s"], g["peak_mem_bytes"], g["bits_per_weight"]) == (
        4321,
        12.5,
        5,
        4.125,
    )
    assert g["recipe_hash"] == "ab" * 32 and g["passed"] is True
    assert (r["size_bytes"], r["quantize_s"], r["passed"]) == (777, None, False)  # no artifact
    assert res.to_json()["best"] == "gptq-w4"
    assert res.to_json()["best_dir"] == str(tmp_path / "results" / "qship-gptq-w4" / "gptq-w4")
