"""Served performance through vLLM's own benchmark, reference and candidate in one run.

For each model (the 16-bit reference first, then the artifact) the runner starts vLLM's
OpenAI server (`vllm serve`, in vLLM's environment: $QSHIP_VLLM_PYTHON) and runs
`vllm bench serve` against it for every workload of the recipe (`serve.workloads`): random
prompts of prompt_len tokens, exactly output_len generated (EOS ignored), at most
`concurrency` in flight, one warm-up pass, then `repeats` passes with seeds seed, seed+1, ...
All passes of a model run in one child process (vllm_bench_child.py: vLLM's imports paid once);
each pass's result JSON is kept (raw_dir, written as it completes: a lost machine loses one
pass). The server's log gives the weights' GPU memory, the KV-cache capacity in tokens and the
kernel vLLM chose per quantization scheme (a silent fallback shows there).

The figures per workload are the medians over the repeats; the speed-up is the candidate's
output tokens/s over the reference's on the same GPU in the same run.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .. import log
from ..errors import StageError, UsageError
from ..model.checkpoint import text_config
from ..recipe import ServeGate, Workload
from ..records.perf import ModelServing, PerfFigures, ServedPerf, WorkloadPerf
from .engines import kernels_in_log, performance_warnings, unavailable

GPU_MEMORY_UTILIZATION = 0.85
# (figure, the result JSON's key, its fallback key)
FIGURES = (
    ("output_tok_s", "output_throughput", None),
    ("ttft_p50_ms", "p50_ttft_ms", "median_ttft_ms"),
    ("ttft_p99_ms", "p99_ttft_ms", None),
    ("tpot_p50_ms", "p50_tpot_ms", "median_tpot_ms"),
    ("tpot_p99_ms", "p99_tpot_ms", None),
)


@dataclass
class ServedRun:
    """What a runner returns for one model: {workload: [result JSON per repeat]} and the
    server's log."""

    engine: str
    gpu: str
    results: dict[str, list[dict]] = field(default_factory=dict)
    log: str = ""
    command: str = ""


class BenchRunner(Protocol):
    def run(self, model_dir: Path, label: str, cfg: ServeGate, raw_dir: Path | None) -> ServedRun:
        """Serve `model_dir` and benchmark every workload of `cfg`."""
        ...


def figures(results: list[dict], where: str) -> PerfFigures:
    """The medians over repeats of vLLM's result JSONs (a missing figure is exit 1)."""
    reps = []
    for r in results:
        row = {}
        for name, key, alt in FIGURES:
            v = r.get(key, r.get(alt) if alt else None)
            if not isinstance(v, int | float):
                raise StageError(f"vLLM's benchmark result has no {key!r}", path=where,
                                 hint="the pinned vLLM (0.26) writes it with --percentile-metrics "
                                 "ttft,tpot --metric-percentiles 50,99")  # fmt: skip
            row[name] = float(v)
        if int(r.get("completed", 0)) < int(r.get("num_prompts", 0) or 0):
            raise StageError(f"{r.get('num_prompts')} requests sent, {r.get('completed')} "
                             "completed", path=where, hint="see the server log")  # fmt: skip
        reps.append(row)
    if not reps:
        raise StageError("no benchmark result", path=where, hint="see the server log")
    med = {name: statistics.median(r[name] for r in reps) for name, _, _ in FIGURES}
    return PerfFigures(**med, repeats=reps)


_WEIGHTS = re.compile(r"Model loading took ([0-9.]+) ?GiB")
_KV_TOKENS = re.compile(r"GPU KV cache size: ([0-9,]+) tokens")


def serving_facts(text: str, counts: dict[str, dict[str, int]] | None = None) -> ModelServing:
    """Memory, kernels and speed warnings from a server log; `counts`: Linears per scheme
    and kernel (engines.kernel_counts of a served check of the same model), where known."""
    w = _WEIGHTS.search(text)
    kv = _KV_TOKENS.search(text)
    counts = counts or {}
    kernels: dict[str, dict[str, int | None]] = {}
    for scheme, names in kernels_in_log(text).items():
        kernels[scheme] = {k: counts.get(scheme, {}).get(k) for k in names}
    for scheme, got in counts.items():  # counted, though the log did not name them
        for k, n in got.items():
            kernels.setdefault(scheme, {}).setdefault(k, n)
    return ModelServing(
        weights_gib=float(w.group(1)) if w else None,
        kv_cache_tokens=int(kv.group(1).replace(",", "")) if kv else None,
        kernels=kernels,
        warnings=performance_warnings(text),
    )


def measure(
    candidate: Path, reference: Path, cfg: ServeGate, runner: BenchRunner,
    raw_dir: Path | None = None, ref_runs: dict[str, ServedRun] | None = None,
    kernel_counts: dict[str, dict[str, int]] | None = None,
) -> ServedPerf:  # fmt: skip
    """Both models served and benchmarked by `runner` (reference first). `ref_runs`: the
    reference's runs of this process by workload set (compare measures it once);
    `kernel_counts`: the candidate's Linears per kernel, from its served check."""
    _fits(candidate, cfg)
    key = f"{Path(reference).resolve()}|{cfg.model_dump_json(include={'workloads', 'repeats', 'seed'})}"
    ref = (ref_runs or {}).get(key)
    if ref is None:
        ref = runner.run(reference, "reference", cfg, raw_dir)
        if ref_runs is not None:
            ref_runs[key] = ref
    label = Path(candidate).name or "candidate"
    cand = runner.run(candidate, f"candidate-{label}", cfg, raw_dir)
    rows = []
    for w in cfg.workloads:
        rows.append(WorkloadPerf(
            name=w.name, prompt_len=w.prompt_len, output_len=w.output_len,
            concurrency=w.concurrency, num_prompts=w.prompts(),
            reference=figures(ref.results.get(w.name, []), f"{reference} [{w.name}]"),
            candidate=figures(cand.results.get(w.name, []), f"{candidate} [{w.name}]"),
        ))  # fmt: skip
    return ServedPerf(
        engine=cand.engine, gpu=cand.gpu, gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        workloads=rows, reference=serving_facts(ref.log),
        candidate=serving_facts(cand.log, kernel_counts),
        command=cand.command,
    )  # fmt: skip


def _context(model_dir: Path) -> int | None:
    try:
        c = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    limit = text_config(c).get("max_position_embeddings")
    return limit if isinstance(limit, int) and limit > 0 else None


def _max_model_len(model_dir: Path, cfg: ServeGate) -> int:
    """The server's context: the longest workload plus room for `bench serve`'s random
    prompts, which re-encode to a few more tokens than asked (12 of 64 requests of 1024 + 256
    tokens were refused at exactly 1280 on the H100, 2026-12-05), within the model's own."""
    want = max(w.prompt_len + w.output_len + w.prompt_len // 8 + 32 for w in cfg.workloads)
    limit = _context(model_dir)
    return min(want, limit) if limit else want


def _fits(model_dir: Path, cfg: ServeGate) -> None:
    """Exit 2 for a workload longer than the model's context."""
    limit = _context(model_dir)
    if limit is None:
        return
    bad = cfg.overlong(limit)
    if bad is not None:
        i, w = bad
        raise UsageError(
            f"field `serve.workloads[{i}]` ({w.name}): prompt_len {w.prompt_len} + "
            f"output_len {w.output_len} exceeds the model's context of {limit} tokens",
            path=str(model_dir), hint="set serve.workloads in the recipe to fit the model",
        )  # fmt: skip


# ------------------------------------------------------------------ vLLM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmBench:
    """`vllm serve` + `vllm bench serve` in vLLM's environment."""

    def __init__(self, *, start_timeout_s: float = 900, bench_timeout_s: float = 1800) -> None:
        reason = unavailable("vllm")
        if reason is not None:
            raise UsageError(f"served performance needs vLLM: {reason}", path="--perf",
                             hint="set QSHIP_VLLM_PYTHON to the python of vLLM's own "
                             "environment (`make serve-env`; CUDA only)")  # fmt: skip
        self.python = os.environ.get("QSHIP_VLLM_PYTHON") or sys.executable
        self.start_timeout_s, self.bench_timeout_s = start_timeout_s, bench_timeout_s

    def _cli(self, *args: str) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.cli.main", *args]

    def run(self, model_dir: Path, label: str, cfg: ServeGate, raw_dir: Path | None) -> ServedRun:
        """The server and the benchmark child start together: the child imports vLLM
        (~25 s a model) while the server loads and compiles, and runs its passes once the
        server answers (the `go` file); a server that fails to start stops it."""
        import tempfile
        from concurrent.futures import ThreadPoolExecutor

        model = str(Path(model_dir).resolve())
        max_len = _max_model_len(Path(model_dir), cfg)
        port = _free_port()
        with tempfile.TemporaryDirectory(prefix="qship-perf-") as tmp, \
                ThreadPoolExecutor(2, thread_name_prefix="qship-perf") as pool:  # fmt: skip
            logf, go = Path(tmp) / "server.log", Path(tmp) / "go"
            server = self._cli("serve", model, "--port", str(port), "--seed", str(cfg.seed),
                               "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION),
                               "--max-model-len", str(max_len), *_skip_args(Path(model_dir)))  # fmt: skip
            with open(logf, "wb") as fh:
                proc = subprocess.Popen(server, stdout=fh, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
            out = ServedRun(engine="", gpu="")
            engine = pool.submit(_engine, self.python)
            bench = pool.submit(self._bench, model, port, cfg, Path(tmp), out, label, raw_dir, go)
            try:
                try:
                    self._wait(proc, port, logf, label)
                except BaseException:
                    go.write_text("stop")  # the child exits without a pass
                    raise
                go.write_text("go")
                bench.result()
                out.engine, out.gpu = engine.result(), _gpu()
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                out_log = logf.read_text(errors="replace")
        if raw_dir is not None:
            (raw_dir / f"{label}-server.log").write_text(out_log)
        out.log = out_log
        return out

    def _wait(self, proc: subprocess.Popen, port: int, logf: Path, label: str) -> None:
        t0 = time.monotonic()
        with log.heartbeat(f"starting vLLM for the {label}"):
            while time.monotonic() - t0 < self.start_timeout_s:
                if proc.poll() is not None:
                    tail = logf.read_text(errors="replace")[-1500:]
                    raise StageError(f"vLLM's server exited ({proc.returncode}) while starting: "
                                     + tail, path=str(logf),
                                     hint="see vLLM's message above")  # fmt: skip
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        return
                except OSError:
                    time.sleep(2)
        raise StageError(f"vLLM's server did not answer within {self.start_timeout_s:.0f} s",
                         path=str(logf), hint="see its log")  # fmt: skip

    def _bench(self, model: str, port: int, cfg: ServeGate, tmp: Path, out: ServedRun,
               label: str, raw_dir: Path | None, go: Path | None = None) -> None:  # fmt: skip
        """Every workload's passes (a warm-up, not kept, then `repeats`) in one child of
        vLLM's environment (vllm_bench_child.py: vLLM imported once per model, not per pass);
        each pass's result is written as it completes, into raw_dir when given. With `go`,
        the child imports vLLM, then waits for that file to say `go` (or `stop`)."""
        res_dir = raw_dir or tmp
        res_dir.mkdir(parents=True, exist_ok=True)
        passes: list[tuple[Workload, int | None, list[str]]] = []
        for w in cfg.workloads:
            for r in (None, *range(cfg.repeats)):
                seed, n = (cfg.seed + 1000, max(w.concurrency, 4)) if r is None else (
                    cfg.seed + r, w.prompts())  # fmt: skip
                passes.append((w, r, [
                    "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
                    "--model", model, "--dataset-name", "random", "--random-input-len",
                    str(w.prompt_len), "--random-output-len", str(w.output_len),
                    "--num-prompts", str(n), "--max-concurrency", str(w.concurrency),
                    "--seed", str(seed), "--ignore-eos", "--percentile-metrics", "ttft,tpot",
                    "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(res_dir),
                    "--result-filename", f"{label}-{w.name}-{'warm' if r is None else r}.json",
                ]))  # fmt: skip
        for _, _, argv in passes:  # a result left by an earlier run must not count as this one's
            (res_dir / argv[-1]).unlink(missing_ok=True)
        spec = tmp / "passes.json"
        spec.write_text(json.dumps([argv for _, _, argv in passes]))
        child = [self.python, str(Path(__file__).with_name("vllm_bench_child.py")), str(spec)]
        child += [str(go)] if go is not None else []
        rc, output = log.run_child(child, label=f"vllm bench serve ({label})",
                                   timeout=self.bench_timeout_s + self.start_timeout_s)  # fmt: skip
        for w, r, argv in passes:
            res_file = res_dir / argv[-1]
            if r is None or not res_file.is_file():
                continue
            res = json.loads(res_file.read_text())
            out.results.setdefault(w.name, []).append(res)
            out.command = out.command or "vllm bench serve " + " ".join(argv)
            log.detail(f"{label} {w.name} #{r + 1}: {res.get('output_throughput', 0):.0f} tok/s")
        missing = [argv[-1] for _, _, argv in passes if not (res_dir / argv[-1]).is_file()]
        if rc != 0 or missing:
            raise StageError(f"vllm bench serve failed (exit {rc}; no result for "
                             f"{', '.join(missing) or 'none'}): {output[-1200:]}",
                             path=model, hint="see vLLM's message above")  # fmt: skip


@functools.cache  # one import of vLLM per process, not one per model
def _engine(python: str) -> str:
    try:
        v = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                           capture_output=True, text=True, timeout=120).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        v = ""
    return f"vllm {v}" if v else "vllm"


def _gpu() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout  # fmt: skip
        return out.strip().splitlines()[0] if out.strip() else "unknown GPU"
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown GPU"


def runner_for(engine: str) -> Callable[[], BenchRunner]:
    if engine != "vllm":
        raise UsageError(f"served performance is measured with vLLM, not {engine}",
                         path="serve.engine", hint="set serve.engine: vllm")  # fmt: skip
    return VllmBench


def _skip_args(model_dir: Path) -> list[str]:
    """vLLM's flag for the layers the recipe serves with a 16-bit KV cache (kv_cache.
    skip_layers), as a deployment must pass it: vLLM does not read it from the checkpoint."""
    from ..records.checkpoint import kv_skip_layers

    skip = kv_skip_layers(model_dir)
    return ["--kv-cache-dtype-skip-layers", *map(str, skip)] if skip else []
