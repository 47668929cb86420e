"""`qship compare` on the tiny trained Llama with two small recipes (RTN and GPTQ).

The in-process comparison must report the same numbers as separate `qship quantize` +
`qship evaluate` runs, `--collect` over the per-recipe eval.json files must rebuild the
same report, and the HTML must be self-contained with valid PNGs.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from pipeline.cli import main
from pipeline.compare.output import REPORT_FILES

# these recipes run no benchmark: no accuracy-drop plot
FILES = [f for f in REPORT_FILES if f != "task_drop_vs_kl.png"]

ROOT = Path(__file__).resolve().parent.parent
SMALL = {
    "calibration": {"num_samples": 8, "seq_len": 64, "batch_size": 8},
    "evaluation": {"sequences": 4, "seq_len": 64, "batch_size": 4, "tasks": [], "hub_tasks": []},
}
# figures that must be identical between the comparison and separate runs
QUALITY = ["tokens", "kl_mean", "kl_stderr", "kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max"]
QUALITY += ["top1", "ppl_reference", "ppl_candidate", "ppl_ratio", "bits_per_weight", "size_bytes"]


def _recipe(tmp: Path, base: str, name: str, gates: dict) -> Path:
    d = yaml.safe_load((ROOT / "recipes" / f"{base}.yaml").read_text())
    d["name"] = name
    d["kv_cache"] = None  # RTN then needs no calibration pass at all
    for k, v in SMALL.items():
        d[k].update(v)
    d["gates"] = gates
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


@pytest.fixture(scope="module")
def threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("recipes")
    return [
        _recipe(tmp, "rtn-w4", "tiny-rtn", {"kl_mean_max": 1e-6}),  # fails: shows a FAIL row
        _recipe(tmp, "gptq-w4", "tiny-gptq", {"kl_mean_max": 5.0, "top1_min": 0.05}),
    ]


@pytest.fixture(scope="module")
def compared(tmp_path_factory, tiny_llama, recipes, threads) -> dict:
    work = tmp_path_factory.mktemp("compare")
    out = work / "report"
    args = ["compare", "--model", str(tiny_llama), "--recipes", str(recipes[0]), str(recipes[1])]
    args += ["--out", str(out), "--cache-dir", str(work / "cache"), "--device", "cpu"]
    import contextlib

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main([*args, "--json"])
    assert rc == 0, buf.getvalue()
    res = json.loads(buf.getvalue())
    report = json.loads((out / "compare.json").read_text())
    return {"out": out, "res": res, "report": report, "cache": work / "cache", "args": args}


def test_compare_writes_full_report(compared):
    out, res, rep = compared["out"], compared["res"], compared["report"]
    for f in FILES:
        assert (out / f).is_file(), f
    assert not (out / "task_drop_vs_kl.png").exists()
    assert rep["recipes"] == ["tiny-gptq", "tiny-rtn"]
    assert res["best"] == rep["best"] == "tiny-gptq" and res["passed"] == ["tiny-gptq"]
    assert Path(res["best_dir"]) == out / "recipes" / "tiny-gptq"
    rows = {r["name"]: r for r in rep["rows"]}
    assert rows["tiny-rtn"]["passed"] is False and rows["tiny-gptq"]["passed"] is True
    for r in rows.values():
        assert 4.0 < r["bits_per_weight"] < 4.3  # int4 g128 + scales (+ zero points)
        assert r["size_bytes"] > 0 and r["quantize_s"] > 0 and r["peak_mem_bytes"] > 0
        assert r["kl_mean"] > 0 and 0 < r["top1"] <= 1 and r["ppl_ratio"] > 0
        h = r["kl_hist"]
        assert sum(h["counts"]) + h["zero"] == r["tokens"] == 4 * 63
    md = (out / "compare.md").read_text()
    assert "FAIL (kl_mean_max)" in md and "**tiny-gptq**" in md


def _entries(cache: Path, stage: str) -> list[str]:
    d = cache / stage
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else []


def test_recipes_share_tokens_and_reference(compared):
    """Two recipes with the same calibration/evaluation settings: one token set, one
    reference pass, two quantizations; a second comparison quantizes nothing."""
    cache = compared["cache"]
    assert len(_entries(cache, "tokens")) == 1
    assert len(_entries(cache, "reference")) == 1
    assert len(_entries(cache, "quantize")) == 2
    before = {s: _entries(cache, s) for s in ("quantize", "evaluate", "reference")}
    out2 = compared["out"].with_name("report2")
    args = [a if a != str(compared["out"]) else str(out2) for a in compared["args"]]
    assert main(args) == 0
    assert {s: _entries(cache, s) for s in before} == before
    a = json.loads((out2 / "compare.json").read_text())
    assert a == compared["report"]  # same cached stages -> the same report


def test_compare_equals_separate_evaluate_runs(compared, tiny_llama, recipes, tmp_path):
    """qship quantize + qship evaluate, each recipe on its own (own cache: the reference
    pass and the token sets are recomputed), give the numbers of the comparison; and
    --collect of those separately produced results gives the same rows."""
    rows = {r["name"]: r for r in compared["report"]["rows"]}
    cache = tmp_path / "cache"
    jobs = tmp_path / "jobs"
    for rp in recipes:
        name = yaml.safe_load(rp.read_text())["name"]
        q = tmp_path / f"q-{name}"
        e = tmp_path / f"e-{name}"
        common = ["--cache-dir", str(cache), "--device", "cpu"]
        assert (
            main(
                [
                    "quantize",
                    "--model",
                    str(tiny_llama),
                    "--recipe",
                    str(rp),
                    "--out",
                    str(q),
                    *common,
                ]
            )
            == 0
        )
        rc = main(
            [
                "evaluate",
                "--reference",
                str(tiny_llama),
                "--candidate",
                str(q),
                "--recipe",
                str(rp),
                "--out",
                str(e),
                *common,
            ]
        )
        assert rc in (0, 4)
        ev = json.loads((e / "eval.json").read_text())
        m = ev["metrics"]
        want = rows[name]
        got = {f"kl_{k}": v for k, v in m["kl"].items()}
        got.update(tokens=m["tokens"], top1=m["top1_agreement"], ppl_reference=m["ppl_reference"])
        got.update(ppl_candidate=m["ppl_candidate"], ppl_ratio=m["ppl_ratio"])
        for k in QUALITY[:-2]:
            assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), (name, k)
        assert ev["verdict"]["passed"] is want["passed"]
        # a CI job's upload: the eval.json (it carries the quantize figures)
        assert ev["quantize"]["name"] == name
        j = jobs / name
        j.mkdir(parents=True)
        shutil.copy(e / "eval.json", j / "eval.json")
    assert main(["compare", "--collect", str(jobs), "--out", str(tmp_path / "rep")]) == 0
    coll = json.loads((tmp_path / "rep" / "compare.json").read_text())
    assert (
        coll["recipes"] == compared["report"]["recipes"]
        and coll["best"] == compared["report"]["best"]
    )
    assert coll["pareto_bits_vs_kl"] == compared["report"]["pareto_bits_vs_kl"]
    for r in coll["rows"]:
        for k in QUALITY:
            assert r[k] == pytest.approx(rows[r["name"]][k], rel=1e-9, abs=1e-12), (r["name"], k)
        assert r["passed"] is rows[r["name"]]["passed"] and r["checks"] == rows[r["name"]]["checks"]


def test_collect_of_compare_results_is_identical(compared, tmp_path):
    """The per-recipe eval.json files of the comparison, downloaded as CI artifacts and
    collected, rebuild the report byte for byte."""
    out = compared["out"]
    for d in (out / "recipes").iterdir():
        shutil.copytree(d, tmp_path / "artifacts" / f"eval-{d.name}")
    rc = main(["compare", "--collect", str(tmp_path / "artifacts"), "--out", str(tmp_path / "rep")])
    assert rc == 0
    for f in FILES:
        assert (tmp_path / "rep" / f).read_bytes() == (out / f).read_bytes(), f


class _Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs: list[tuple[str, str]] = []

    def handle_starttag(self, tag, attrs):
        self.refs += [
            (k, v or "")
            for k, v in attrs
            if k in ("src", "href", "srcset", "action", "data", "poster")
        ]


def test_html_is_self_contained_with_valid_pngs(compared):
    out = compared["out"]
    text = (out / "compare.html").read_text()
    p = _Refs()
    p.feed(text)
    srcs = [v for k, v in p.refs if k == "src"]
    assert len(srcs) == 2
    assert all(v.startswith("data:image/png;base64,") for _, v in p.refs), p.refs
    assert "http:" not in text and "https:" not in text and "url(" not in text
    for name, src in zip(("pareto.png", "kl_distribution.png"), srcs, strict=True):
        data = base64.b64decode(src.split(",", 1)[1])
        assert data == (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        im = Image.open(io.BytesIO(data))
        im.verify()
        assert Image.open(io.BytesIO(data)).size[0] > 300


def test_different_heldout_tokens_refused(tiny_llama, recipes, tmp_path):
    """KL on different held-out tokens does not compare: exit 2 before any quantization."""
    d = yaml.safe_load(recipes[1].read_text())
    d["name"] = "other-eval"
    d["evaluation"]["sequences"] = 3
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(d))
    args = ["compare", "--model", str(tiny_llama), "--recipes", str(recipes[0]), str(other)]
    args += ["--out", str(tmp_path / "rep"), "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 2
    assert not (tmp_path / "cache" / "quantize").exists() and not (tmp_path / "rep").exists()


def test_collect_of_qship_run_jobs_equals_compare(compared, tiny_llama, recipes, tmp_path):
    """The CI path of .github/workflows/qship-compare.yml: one `qship run` per recipe (the
    matrix jobs), their results/ folders merged by `qship compare --collect`: the same
    figures, verdicts and best recipe as the in-process comparison, and best_dir is the
    packaged artifact to publish. Shares the comparison's cache: `qship run` hits the
    quantize and evaluate entries that `qship compare` wrote."""
    cache = compared["cache"]
    before = _entries(cache, "quantize")
    for rp in recipes:
        name = yaml.safe_load(rp.read_text())["name"]
        job = tmp_path / "download" / f"qship-{name}"  # download-artifact: one folder per job
        args = ["run", "--model", str(tiny_llama), "--recipe", str(rp), "--out", str(job / name)]
        rc = main([*args, "--cache-dir", str(cache), "--device", "cpu"])
        assert rc == (0 if name == "tiny-gptq" else 4)
        # a failed gate leaves no artifact, but its report keeps the quantize figures
        assert (job / f"{name}.report" / "quantize_report.json").is_file()
    assert _entries(cache, "quantize") == before  # nothing re-quantized
    buf = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(buf):
        rc = main(
            [
                "compare",
                "--collect",
                str(tmp_path / "download"),
                "--out",
                str(tmp_path / "rep"),
                "--json",
            ]
        )
    assert rc == 0
    res = json.loads(buf.getvalue())
    assert res["best"] == "tiny-gptq"
    assert Path(res["best_dir"]) == tmp_path / "download" / "qship-tiny-gptq" / "tiny-gptq"
    assert (Path(res["best_dir"]) / "SHA256SUMS").is_file()  # the packaged artifact
    coll = json.loads((tmp_path / "rep" / "compare.json").read_text())
    want = {r["name"]: r for r in compared["report"]["rows"]}
    assert coll["recipes"] == compared["report"]["recipes"]
    for r in coll["rows"]:
        w = want[r["name"]]
        for k in QUALITY[:-1]:  # size: the artifact's re-packed shards vs the checkpoint
            assert r[k] == pytest.approx(w[k], rel=1e-9, abs=1e-12), (r["name"], k)
        assert r["passed"] is w["passed"]
        assert [c["name"] for c in r["checks"]] == [c["name"] for c in w["checks"]]
        assert (r["bits_per_weight"], r["quantize_s"]) == (w["bits_per_weight"], w["quantize_s"])
