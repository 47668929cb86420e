"""The benchmark harness (bench/harness.py, `python -m bench`): the shipped suites name
what exists, a suite keeps each row's JSON as the row ends and stops at a failed row, and
bench's own scripts use only pipeline's public names (bench/studies/ is frozen)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest

from bench.harness import PLACEHOLDER, ROOT, SuiteError, load_suites, run_suite


def test_every_shipped_suite_names_scripts_models_and_recipes_that_exist():
    data = load_suites()
    assert "hashing" in data["suites"]  # `make bench`
    for name, suite in data["suites"].items():
        assert suite["rows"] and suite.get("machine") in ("cpu", "gpu"), name
        for row in suite["rows"]:
            args = row.get("args", row.get("qship", []))
            used = {m.group(1) for a in args for m in PLACEHOLDER.finditer(a)}
            unknown = [a for a in args if re.search(r"[{}]", PLACEHOLDER.sub("", a))]
            assert not unknown, (name, row["name"], unknown)
            for key in ("model", "recipe"):
                assert (key in used) == (key in row), (name, row["name"], key)
            if "recipe" in row:
                assert (ROOT / row["recipe"]).is_file(), (name, row["recipe"])


SUITE = """
[models]
tiny = "tests/fixtures/models/tiny-llama"

[suites.demo]
machine = "cpu"

[[suites.demo.rows]]
name = "plan"
qship = ["plan", "--model", "{model}", "--recipe", "{recipe}", "--json"]
model = "tiny"
recipe = "recipes/gptq-w4.yaml"

[[suites.demo.rows]]
name = "pin"
qship = ["fetch", "{model}", "--cache-dir", "{work}/cache", "--checksums", "{dir}", "--pin", "--json"]
model = "tiny"

[[suites.demo.rows]]
name = "bad-recipe"
qship = ["plan", "--model", "{model}", "--recipe", "{work}/none.yaml", "--json"]
model = "tiny"

[[suites.demo.rows]]
name = "never"
qship = ["--version"]
"""


def test_a_suite_keeps_each_finished_row_and_stops_at_a_failed_one(tmp_path):
    suites = tmp_path / "suites.toml"
    suites.write_text(SUITE)
    records = run_suite("demo", results=tmp_path / "res", work=tmp_path / "work", suites=suites)
    assert [r["row"] for r in records] == ["plan", "pin", "bad-recipe"]
    plan = json.loads((tmp_path / "res" / "demo" / "plan.json").read_text())
    assert plan["returncode"] == 0 and plan["result"]["model_type"] == "llama"  # plan's JSON
    assert plan["commit"] and plan["machine"] and plan["seconds"] > 0
    bad = json.loads((tmp_path / "res" / "demo" / "bad-recipe.json").read_text())
    assert bad["returncode"] == 2 and bad["result"] is None
    assert not (tmp_path / "res" / "demo" / "never.json").exists()
    assert sorted(p.name for p in (tmp_path / "res" / "demo").iterdir()) == [
        "bad-recipe.json", "pin", "pin.json", "plan.json"]  # fmt: skip
    assert len(list((tmp_path / "res" / "demo" / "pin").glob("*.json"))) == 1  # {dir}: the pin


def test_a_row_without_a_script_of_bench_or_an_unknown_suite_is_refused(tmp_path):
    suites = tmp_path / "suites.toml"
    suites.write_text('[suites.x]\nrows = [{ name = "a", script = "nowhere.py" }]\n')
    with pytest.raises(SuiteError, match="no script bench/nowhere.py"):
        load_suites(suites)
    p = subprocess.run([sys.executable, "-m", "bench", "run", "no-such-suite"], cwd=ROOT,
                       capture_output=True, text=True)  # fmt: skip
    assert p.returncode == 2 and "no suite 'no-such-suite'" in p.stderr and "hashing" in p.stderr


def private_pipeline_names(source: str) -> list[str]:
    """The `_private` names of pipeline that `source` imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeline"):
            mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names if a.name.startswith("pipeline")]
        else:
            continue
        found += [m for m in mods if any(p.startswith("_") for p in m.split("."))]
    return found


def test_bench_imports_only_public_names_of_pipeline():
    assert private_pipeline_names("from pipeline.x import _pool, ok\nimport pipeline._y\n") == [
        "pipeline.x._pool", "pipeline._y"]  # fmt: skip
    scripts = [p for p in (ROOT / "bench").rglob("*.py") if "studies" not in p.parts]
    bad = {
        str(p.relative_to(ROOT)): n for p in scripts if (n := private_pipeline_names(p.read_text()))
    }
    assert bad == {}, f"bench uses private names of pipeline (export a public one): {bad}"


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings (lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered -1, -2, ...)."""
    anchors, count = set(), {}
    for line in markdown.splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = count[slug] = count.get(slug, -1) + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_the_results_summary_links_each_row_to_a_dated_section():
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    summary, archive = text.split("\n# The archive: dated sections\n")
    links = re.findall(r"\]\(#([^)]+)\)", summary)
    assert len(links) > 20
    missing = sorted(set(links) - github_anchors(text))
    assert not missing, missing
    assert archive.count("\n## ") > 50  # the dated sections follow, kept
