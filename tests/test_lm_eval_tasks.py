"""The local lm-eval tasks run offline on a tiny model; hub tasks are skipped, not hung."""

from __future__ import annotations

import json
import time

from pipeline.evaluate import benchmarks, model_ref


def test_task_data_is_built_deterministically(tmp_path, monkeypatch, repo_root):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "build_tasks", repo_root / "eval" / "build_tasks.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "OUT", tmp_path)
    mod.main()
    for name in ("news_ppl.jsonl", "lastword.jsonl"):
        committed = (repo_root / "eval" / "tasks" / "data" / name).read_bytes()
        assert (tmp_path / name).read_bytes() == committed, f"{name}: rerun eval/build_tasks.py"
    rows = [json.loads(x) for x in (tmp_path / "lastword.jsonl").read_text().splitlines()]
    assert len(rows) > 100 and all(r["target"].startswith(" ") for r in rows)


def test_local_tasks_offline_and_hub_task_skipped(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    t0 = time.perf_counter()
    res = benchmarks.compare(
        model_ref(tiny_llama),
        tiny_llama,
        tasks=["qship_news_ppl", "qship_lastword"],
        hub_tasks=["arc_easy"],
        limit=8,
        cache_dir=tmp_path,
        device="cpu",
    )
    took = time.perf_counter() - t0
    t = res.to_json()["tasks"]
    assert (
        t["qship_news_ppl"]["status"] == "ok" and t["qship_news_ppl"]["metric"] == "bits_per_byte"
    )
    assert 0 < t["qship_news_ppl"]["reference"]["value"] < 8
    assert t["qship_lastword"]["status"] == "ok" and t["qship_lastword"]["metric"] == "acc"
    assert t["qship_lastword"]["reference"]["stderr"] is not None
    assert t["qship_lastword"]["n"] == 8
    for name in ("qship_news_ppl", "qship_lastword"):  # same model: no drop
        assert t[name]["drop"] == 0.0
    assert t["arc_easy"]["status"] == "skipped" and "offline" in t["arc_easy"]["reason"]
    assert took < 900  # a hang guard only: 4 child processes, slow on a loaded 2-core box
