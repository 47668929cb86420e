"""Served performance (pipeline/evaluate/perf.py) without a GPU: a fake runner returns vLLM
benchmark output recorded from real runs (tests/fixtures/vllm_bench: `vllm bench serve
--save-result` JSON per model, workload and repeat, and the lines of each server log qship
reads; vLLM 0.26.0 on an H100 80GB, 2026-12-05, a random model of Llama-3-8B dimensions:
`reference` bf16, `candidate` W4A16 RTN int4 g128 (Machete), `fp8` FP8 dynamic (CUTLASS),
plus one refused 64-stream pass), and everything after it -- the figures, the speed gates,
the workload schema, the comparison report and the model card -- runs for real."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import yaml
from cli_run import qship
from factories import eval_file

from pipeline import gate
from pipeline.compare.output import PERF_FILES, write_report
from pipeline.compare.report import fastest, recommendation, summarise_rows, value
from pipeline.compare.rows import row
from pipeline.errors import RecipeError, StageError, UsageError
from pipeline.evaluate import perf
from pipeline.recipe import ServeGate, SpeedGates, load_recipe, parse_recipe
from pipeline.records import Check, Verdict

FIX = Path(__file__).parent / "fixtures" / "vllm_bench"
ROOT = Path(__file__).resolve().parent.parent


class RecordedRunner:
    """Returns the recorded result JSONs and server log of 'reference', 'fp8' (a model folder
    named fp8*) or 'candidate' (W4A16, any other folder), as VllmBench would after serving it."""

    def __init__(self, scale: dict[str, float] | None = None) -> None:
        self.calls: list[str] = []
        self.scale = scale or {}

    def run(self, model_dir, label, cfg, raw_dir):
        name = Path(model_dir).name
        who = (
            "reference"
            if label == "reference"
            else "fp8"
            if name.startswith("fp8")
            else "candidate"
        )
        self.calls.append(label)
        res = {}
        for w in cfg.workloads:
            runs = []
            for r in range(cfg.repeats):
                d = json.loads((FIX / f"{who}-{w.name}-{r}.json").read_text())
                f = self.scale.get(name, 1.0) if who != "reference" else 1.0
                d["output_throughput"] *= f
                runs.append(d)
            res[w.name] = runs
        return perf.ServedRun(engine="vllm 0.26.0", gpu="NVIDIA H100 80GB HBM3", results=res,
                              log=(FIX / f"{who}-server.log").read_text())  # fmt: skip


def _recorded(who: str, wl: str, key: str) -> float:
    return statistics.median(
        json.loads((FIX / f"{who}-{wl}-{r}.json").read_text())[key] for r in range(3)
    )


def test_figures_are_the_medians_of_the_recorded_runs(tmp_path):
    cfg = ServeGate()
    res = perf.measure(tmp_path / "candidate", tmp_path / "reference", cfg, RecordedRunner())
    assert [w.name for w in res.workloads] == ["1-stream", "64-streams"]
    for w in res.workloads:
        for who in ("reference", "candidate"):
            f = getattr(w, who)
            assert f.output_tok_s == _recorded(who, w.name, "output_throughput")
            assert f.ttft_p99_ms == _recorded(who, w.name, "p99_ttft_ms")
            assert f.tpot_p50_ms == _recorded(who, w.name, "p50_tpot_ms")
            assert len(f.repeats) == 3
        assert w.speedup == pytest.approx(
            _recorded("candidate", w.name, "output_throughput")
            / _recorded("reference", w.name, "output_throughput")
        )
    assert res.reference.weights_gib == pytest.approx(14.96)  # recorded: H100, 8B dims, bf16
    assert res.candidate.kv_cache_tokens == 496_880
    assert res.candidate.kernels == {"CompressedTensorsWNA16": "MacheteLinearKernel"}
    assert res.workloads[1].num_prompts == 8 * 64  # 8 per stream by default


def test_the_reference_is_served_once_for_several_candidates(tmp_path):
    runner, refs = RecordedRunner(), {}
    for name in ("a", "b"):
        perf.measure(tmp_path / name, tmp_path / "reference", ServeGate(), runner, ref_runs=refs)
    assert runner.calls == ["reference", "candidate-a", "candidate-b"]


def test_a_run_that_lost_requests_or_figures_is_an_error(tmp_path):
    class Lossy(RecordedRunner):
        def run(self, model_dir, label, cfg, raw_dir):
            out = super().run(model_dir, label, cfg, raw_dir)
            out.results["1-stream"][0]["completed"] = 3
            return out

    with pytest.raises(StageError, match="completed"):
        perf.measure(tmp_path / "c", tmp_path / "r", ServeGate(), Lossy())
    # recorded (H100, 8B dims): the server, started at exactly 1024 + 256 tokens, refused 12 of
    # 64 random prompts that re-encoded longer; such a pass is not a figure
    refused = json.loads((FIX / "recorded-refused-64-streams.json").read_text())
    assert refused["failed"] == 12
    with pytest.raises(StageError, match="64 requests sent, 52 completed"):
        perf.figures([refused], "64-streams")
    # the server now gets room for that: 1024 + 256 + 1024 // 8 + 32, within the context
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert perf._max_model_len(tmp_path / "m", ServeGate()) == 1440
    (tmp_path / "m" / "config.json").write_text(json.dumps({"max_position_embeddings": 1300}))
    assert perf._max_model_len(tmp_path / "m", ServeGate()) == 1300

    class NoP99(RecordedRunner):
        def run(self, model_dir, label, cfg, raw_dir):
            out = super().run(model_dir, label, cfg, raw_dir)
            del out.results["64-streams"][1]["p99_ttft_ms"]
            return out

    with pytest.raises(StageError, match="p99_ttft_ms"):
        perf.measure(tmp_path / "c", tmp_path / "r", ServeGate(), NoP99())


def test_speed_gates_pass_fail_and_fail_closed(tmp_path):
    res = perf.measure(tmp_path / "c", tmp_path / "r", ServeGate(), RecordedRunner())
    s1 = res.by_name()["1-stream"].speedup
    ok = gate.speed_checks(res, SpeedGates(min_speedup={"1-stream": s1 - 0.01},
                                           max_ttft_ms={"64-streams": 1e4}))  # fmt: skip
    assert all(c.passed for c in ok) and len(ok) == 2
    bad = gate.speed_checks(res, SpeedGates(min_speedup={"64-streams": 2.0}))
    assert not bad[0].passed and bad[0].value == pytest.approx(res.workloads[1].speedup)
    missing = gate.speed_checks(None, SpeedGates(min_speedup={"1-stream": 1.0}))
    assert not missing[0].passed and "not measured" in missing[0].note


def test_bad_workloads_exit_2_naming_the_field(tmp_path, tiny_llama, capsys):
    d = yaml.safe_load((ROOT / "recipes" / "fp8-dynamic.yaml").read_text())
    d["serve"] = {"engine": "vllm", "workloads": [
        {"name": "w", "prompt_len": 8, "output_len": 8, "concurrency": 0}]}  # fmt: skip
    with pytest.raises(RecipeError, match=r"serve\.workloads\[0\]\.concurrency"):
        parse_recipe(d, path="r.yaml")
    d["serve"]["workloads"] = [{"name": "long", "prompt_len": 500, "output_len": 64,
                                "concurrency": 4}]  # fmt: skip
    p = tmp_path / "long.yaml"
    p.write_text(yaml.safe_dump(d))
    rc, out = qship(capsys, "plan", "--model", str(tiny_llama), "--recipe", str(p))
    assert rc == 2 and "serve.workloads[0]" in out["message"] and "512" in out["message"]
    d["serve"]["gates"] = {"min_speedup": {"nope": 1.2}}
    with pytest.raises(RecipeError, match="no workload named 'nope'"):
        parse_recipe(d, path="r.yaml")
    # the default workloads are checked when they are served, against the model's context
    cfg = load_recipe(ROOT / "recipes" / "fp8-dynamic.yaml").serve or ServeGate()
    with pytest.raises(UsageError, match=r"serve\.workloads\[1\].*512"):
        perf.measure(tiny_llama, tiny_llama, cfg, RecordedRunner())


def test_verify_perf_needs_vllm_and_the_reference(tmp_path, capsys):
    rc, out = qship(capsys, "verify", str(tmp_path), "--perf")
    assert rc == 2 and "--reference" in out["message"]


def _ev(name, bits, scale, passed, res=None, seed=0):
    ev = eval_file(name, bits, scale, None, seed=seed)
    check = Check(name="kl_mean_max", value=ev.metrics.kl.mean, limit=0.3, op="<=", passed=passed)
    ev = ev.model_copy(update={"verdict": Verdict(passed=passed, checks=[check])})
    if res is not None:
        ev = ev.model_copy(update={"served_perf": res})
    q = ev.quantize.model_copy(update={"formats": {"fp8": ["W8A8-FP8"], "w4": ["W4A16"]}
                                       .get(name.split("-")[0], ["W4A16"])})  # fmt: skip
    return ev.model_copy(update={"quantize": q})


def test_compare_report_recommends_per_workload(tmp_path):
    """The recorded crossover (H100, 8B dims): W4A16 fastest at one stream, FP8 dynamic under
    64 streams; a failing recipe three times as fast is never recommended."""
    runner = RecordedRunner(scale={"bad": 3.0})
    refs: dict = {}
    res = {n: perf.measure(tmp_path / n, tmp_path / "ref", ServeGate(), runner, ref_runs=refs)
           for n in ("fp8", "w4", "bad")}  # fmt: skip
    rows = [row(_ev("fp8-dynamic", 8.1, 0.01, True, res["fp8"], 0)),
            row(_ev("w4-g128", 4.1, 0.17, True, res["w4"], 1)),
            row(_ev("bad-w4", 4.1, 0.9, False, res["bad"], 2))]  # fmt: skip
    rep = summarise_rows(rows)
    assert fastest(rows) == {"1-stream": "w4-g128", "64-streams": "fp8-dynamic"}
    words = recommendation(rep)
    assert "Fastest passing recipe per workload (NVIDIA H100 80GB HBM3, vllm 0.26.0)" in words
    for wl, who, name, fmt in (("1-stream", "candidate", "w4-g128", "W4A16"),
                               ("64-streams", "fp8", "fp8-dynamic", "W8A8-FP8")):  # fmt: skip
        sp = _recorded(who, wl, "output_throughput") / _recorded(
            "reference", wl, "output_throughput"
        )
        assert f"{wl}: **{name}** ({fmt}), {sp:.2f}x" in words, words
    out = write_report(rows, tmp_path / "rep")
    md = (tmp_path / "rep" / "compare.md").read_text()
    assert "1-stream speed-up" in md and "| formats |" in md and "W8A8-FP8" in md
    kv = f"| {res['fp8'].candidate.kv_cache_tokens} |"  # vLLM's log of the recorded FP8 run
    assert "KV-cache tokens" in md and kv in md, md
    csv_text = (tmp_path / "rep" / "compare.csv").read_text()
    assert "speed:64-streams" in csv_text and "kv_cache_tokens" in csv_text
    assert f",{res['fp8'].candidate.kv_cache_tokens}," in csv_text
    for f in PERF_FILES:
        assert (tmp_path / "rep" / f).read_bytes()[:4] == b"\x89PNG"
    assert out["fastest"]["64-streams"] == "fp8-dynamic"


def test_recommendation_says_when_no_recipe_beats_the_16_bit_model(tmp_path):
    """Qwen2.5-Coder-0.5B on the H200 (2026-12-06): W4A16 0.85x, FP8 0.89x at one stream --
    the report must not call a recipe slower than the 16-bit model 'fastest' without saying
    so; a workload where one is faster keeps the plain words."""
    runner = RecordedRunner(scale={"fp8": 0.7, "w4": 0.5})
    refs: dict = {}
    res = {n: perf.measure(tmp_path / n, tmp_path / "ref", ServeGate(), runner, ref_runs=refs)
           for n in ("fp8", "w4")}  # fmt: skip
    rows = [row(_ev("fp8-dynamic", 8.1, 0.01, True, res["fp8"], 0)),
            row(_ev("w4-g128", 4.1, 0.17, True, res["w4"], 1))]  # fmt: skip
    words = recommendation(summarise_rows(rows))
    sp = {w: value(rows[0], f"speed:{w}") for w in ("1-stream", "64-streams")}
    assert sp["64-streams"] < 1 < sp["1-stream"], sp  # the recordings x 0.7: FP8 1.48x, 1.35x
    assert (f"64-streams: none faster than the 16-bit model (the fastest, **fp8-dynamic** "
            f"(W8A8-FP8), {sp['64-streams']:.2f}x") in words, words  # fmt: skip
    assert f"1-stream: **fp8-dynamic** (W8A8-FP8), {sp['1-stream']:.2f}x" in words


def test_model_card_states_the_served_speed(tmp_path):
    from pipeline.artifact import model_card

    res = perf.measure(tmp_path / "c", tmp_path / "r", ServeGate(), RecordedRunner())
    ev = _ev("w4-g128", 4.1, 0.17, True, res)
    recipe = load_recipe(ROOT / "recipes" / "gptq-w4.yaml")
    card = model_card.render(name="x", source=None, recipe=recipe,
                             quantization_config={"quant_method": "compressed-tensors"},
                             evaluation=ev)  # fmt: skip
    assert "## Served speed (vllm 0.26.0, NVIDIA H100 80GB HBM3)" in card
    sp = res.workloads[0].speedup
    assert "| 1-stream | 256 → 128, 1 |" in card and f"{sp:.2f}x" in card
    assert "Weights on the GPU: 5.32 GiB (16-bit: 14.96)" in card
    assert "MacheteLinearKernel for CompressedTensorsWNA16" in card


STAND_IN_CLI = """
import json, os, sys, time
if __name__ != "__main__" and os.environ.get("STAND_IN_TIMES"):  # the bench child's import
    with open(os.environ["STAND_IN_TIMES"], "a") as f:
        f.write(f"imported {time.time()}\\n")
def serve(get):  # `vllm serve MODEL --port P ...`: /health answers after a delay, or exit 1
    import http.server
    if os.environ.get("STAND_IN_SERVE_FAIL"):
        print("stand-in: no GPU", flush=True)
        raise SystemExit(1)
    time.sleep(1.5)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", int(get("--port"))), Health)
    with open(os.environ["STAND_IN_TIMES"], "a") as f:
        f.write(f"ready {time.time()}\\n")
    print("GPU KV cache size: 1,234 tokens", flush=True)
    srv.serve_forever()
def main():  # `vllm bench serve ARGS` as the child calls it: writes its result file
    a = sys.argv
    get = lambda k: a[a.index(k) + 1]
    if a[1] == "serve":
        return serve(get)
    assert a[1:3] == ["bench", "serve"], a
    with open(os.environ["STAND_IN_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    if int(get("--seed")) == int(os.environ.get("STAND_IN_FAIL_SEED", "-1")):
        raise SystemExit(3)
    res = {"output_throughput": float(get("--seed")), "completed": int(get("--num-prompts"))}
    with open(os.path.join(get("--result-dir"), get("--result-filename")), "w") as f:
        json.dump(res, f)
if __name__ == "__main__":
    main()
"""


def _stand_in_vllm(tmp_path, monkeypatch, fail_seed=None):
    pkg = tmp_path / "site" / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "main.py").write_text(STAND_IN_CLI)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("STAND_IN_PIDS", str(tmp_path / "pids"))
    if fail_seed is not None:
        monkeypatch.setenv("STAND_IN_FAIL_SEED", str(fail_seed))
    bench = perf.VllmBench.__new__(perf.VllmBench)  # no GPU here: the constructor refuses
    bench.python, bench.start_timeout_s, bench.bench_timeout_s = sys.executable, 60, 120
    return bench


def test_bench_passes_run_in_one_child_and_keep_each_result(tmp_path, monkeypatch):
    """Every pass of every workload goes to one child (vLLM imported once per model, not per
    pass); the warm-up is not kept; results land in raw_dir; a stale file does not count."""
    bench = _stand_in_vllm(tmp_path, monkeypatch)
    cfg = ServeGate(repeats=3, seed=7)
    raw, tmp = tmp_path / "raw", tmp_path / "tmp"
    tmp.mkdir()
    raw.mkdir()
    stale = raw / f"cand-{cfg.workloads[0].name}-0.json"
    stale.write_text(json.dumps({"output_throughput": 999.0}))
    out = perf.ServedRun(engine="vllm", gpu="x")
    bench._bench("/m", 1234, cfg, tmp, out, "cand", raw)
    assert len(set((tmp_path / "pids").read_text().split())) == 1
    assert len((tmp_path / "pids").read_text().split()) == len(cfg.workloads) * 4
    for w in cfg.workloads:
        assert [r["output_throughput"] for r in out.results[w.name]] == [7.0, 8.0, 9.0]
        assert [r["completed"] for r in out.results[w.name]] == [w.prompts()] * 3
        assert (raw / f"cand-{w.name}-2.json").is_file()
    assert "--seed 7" in out.command


def test_bench_failure_keeps_the_passes_before_it(tmp_path, monkeypatch):
    bench = _stand_in_vllm(tmp_path, monkeypatch, fail_seed=8)
    cfg = ServeGate(repeats=3, seed=7)
    (tmp_path / "tmp").mkdir()
    out = perf.ServedRun(engine="vllm", gpu="x")
    with pytest.raises(StageError, match="exit 3; no result for"):
        bench._bench("/m", 1234, cfg, tmp_path / "tmp", out, "cand", tmp_path / "raw")
    first = cfg.workloads[0].name
    assert [r["output_throughput"] for r in out.results[first]] == [7.0]
    assert (tmp_path / "raw" / f"cand-{first}-0.json").is_file()


def test_bench_child_waits_for_the_server_then_runs_or_stops(tmp_path, monkeypatch):
    """Started beside the server, the child runs no pass before `go` says so; `stop` (the
    server failed to start) ends it without a pass."""
    import threading
    import time

    bench = _stand_in_vllm(tmp_path, monkeypatch)
    cfg = ServeGate(repeats=1, seed=7)
    (tmp_path / "tmp").mkdir()
    go, out = tmp_path / "go", perf.ServedRun(engine="vllm", gpu="x")
    errors: list[BaseException] = []

    def bench_in_thread() -> None:
        try:
            bench._bench("/m", 1234, cfg, tmp_path / "tmp", out, "cand", tmp_path / "raw", go)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    t = threading.Thread(target=bench_in_thread)
    t.start()
    time.sleep(1.5)
    assert not (tmp_path / "pids").exists()  # waiting: no pass yet
    go.write_text("go")
    t.join(60)
    assert not errors
    assert [r["output_throughput"] for r in out.results[cfg.workloads[0].name]] == [7.0]

    go.write_text("stop")
    (tmp_path / "pids").unlink()
    with pytest.raises(StageError, match="no result for"):
        bench._bench("/m", 1234, cfg, tmp_path / "tmp", perf.ServedRun(engine="vllm", gpu="x"),
                     "cand2", tmp_path / "raw", go)  # fmt: skip
    assert not (tmp_path / "pids").exists()


def test_bench_child_imports_while_the_server_starts(tmp_path, monkeypatch):
    """VllmBench.run starts the benchmark child beside the server (vLLM's imports overlap the
    server's start), runs the passes once the server answers, and keeps the server's log."""
    bench = _stand_in_vllm(tmp_path, monkeypatch)
    monkeypatch.setenv("STAND_IN_TIMES", str(tmp_path / "times"))
    cfg = ServeGate(repeats=1, seed=7)
    (tmp_path / "m").mkdir()
    out = bench.run(tmp_path / "m", "cand", cfg, tmp_path / "raw")
    times = dict(line.split() for line in (tmp_path / "times").read_text().splitlines())
    assert float(times["imported"]) < float(times["ready"])
    assert [r["output_throughput"] for r in out.results[cfg.workloads[-1].name]] == [7.0]
    assert "GPU KV cache size: 1,234 tokens" in (tmp_path / "raw" / "cand-server.log").read_text()


def test_a_server_that_fails_to_start_stops_the_bench_child(tmp_path, monkeypatch):
    bench = _stand_in_vllm(tmp_path, monkeypatch)
    monkeypatch.setenv("STAND_IN_SERVE_FAIL", "1")
    (tmp_path / "m").mkdir()
    with pytest.raises(StageError, match=r"exited \(1\) while starting: stand-in: no GPU"):
        bench.run(tmp_path / "m", "cand", ServeGate(repeats=1), tmp_path / "raw")
    assert not (tmp_path / "pids").exists()  # no pass ran
