"""perf.VllmBench's processes without a GPU: a stand-in `vllm` package on PYTHONPATH plays
`vllm serve` (a /health endpoint, or a start that fails) and `vllm bench serve` (a result
file per pass), so the server, the benchmark child and their hand-over run for real."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.errors import StageError
from pipeline.evaluate import perf
from pipeline.recipe import ServeGate

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
    time.sleep(3)  # the bench child, started beside it, imports well within this
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
    if os.environ.get("STAND_IN_ORDER"):  # which server each pass went to, in order
        with open(os.environ["STAND_IN_ORDER"], "a") as f:
            f.write(f"{get('--base-url')} {get('--result-filename')}\\n")
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


def _servers(*labels: str) -> list[perf._Server]:
    return [
        perf._Server("/m", label, 1234 + i, Path("/dev/null")) for i, label in enumerate(labels)
    ]


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
    bench._bench(_servers("cand"), cfg, tmp, [out], raw)
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
        bench._bench(_servers("cand"), cfg, tmp_path / "tmp", [out], tmp_path / "raw")
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
            bench._bench(_servers("cand"), cfg, tmp_path / "tmp", [out], tmp_path / "raw", go)
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
        bench._bench(_servers("cand2"), cfg, tmp_path / "tmp",
                     [perf.ServedRun(engine="vllm", gpu="x")], tmp_path / "raw", go)  # fmt: skip
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


def test_a_pair_is_served_at_once_and_its_passes_alternate(tmp_path, monkeypatch):
    """Issue 57 item 4: the reference and the artifact are served side by side (each with
    half the memory) and one child runs pass r of each next to the other's, so a speed-up is
    a ratio of neighbouring passes; both servers' logs are kept."""
    bench = _stand_in_vllm(tmp_path, monkeypatch)
    monkeypatch.setenv("STAND_IN_TIMES", str(tmp_path / "times"))
    monkeypatch.setenv("STAND_IN_ORDER", str(tmp_path / "order"))
    cfg = ServeGate(repeats=2, seed=7)
    for m in ("ref", "cand"):
        (tmp_path / m).mkdir()
    ref, cand = bench.run_pair(tmp_path / "ref", tmp_path / "cand", ("reference", "candidate-c"),
                               cfg, tmp_path / "raw")  # fmt: skip
    assert len(set((tmp_path / "pids").read_text().split())) == 1  # one child for both
    order = [line.split() for line in (tmp_path / "order").read_text().splitlines()]
    assert len({url for url, _ in order}) == 2
    names = [name for _, name in order]
    w1 = cfg.workloads[0].name
    assert names[:6] == [f"reference-{w1}-warm.json", f"candidate-c-{w1}-warm.json",
                         f"reference-{w1}-0.json", f"candidate-c-{w1}-0.json",
                         f"reference-{w1}-1.json", f"candidate-c-{w1}-1.json"]  # fmt: skip
    for out in (ref, cand):
        assert [r["output_throughput"] for r in out.results[w1]] == [7.0, 8.0]
    for label in ("reference", "candidate-c"):
        assert "GPU KV cache size" in (tmp_path / "raw" / f"{label}-server.log").read_text()
