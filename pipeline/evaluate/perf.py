"""Served performance through vLLM's own benchmark, reference and candidate in one run.

The runner starts vLLM's OpenAI server (`vllm serve`, in vLLM's environment:
$QSHIP_VLLM_PYTHON) for the 16-bit reference and for the artifact, side by side (each with
half the memory), and runs `vllm bench serve` for every workload of the recipe
(`serve.workloads`): random prompts of prompt_len tokens, exactly output_len generated (EOS
ignored), at most `concurrency` in flight, one warm-up pass, then `repeats` passes with
seeds seed, seed+1, ..., the reference's pass r next to the artifact's pass r. Every pass
runs in one child process (vllm_bench_child.py: vLLM's imports paid once); each pass's
result JSON is kept (raw_dir, written as it completes: a lost machine loses one pass). The
server's log gives the weights' GPU memory, the KV-cache capacity in tokens, every kernel
vLLM chose per quantization scheme (a silent fallback shows there) and its speed warnings.

The figures per workload are the medians over the repeats; the speed-up is the median of
the neighbouring passes' ratios (the artifact's pass r over the reference's). The
reference's figures are kept per (model hash, engine and version, GPU, workload)
(`ReferenceCache`): a later artifact of the same reference is measured beside them, without
serving the reference again, and its record says so (`reference_cached`).
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
from typing import Any, Protocol

from .. import log
from ..errors import StageError, UsageError
from ..io.cache import StageCache, stage_key
from ..model.checkpoint import text_config
from ..recipe import ServeGate, Workload
from ..records.perf import ModelServing, PerfFigures, ServedPerf, WorkloadPerf
from .engines import kernels_in_log, performance_warnings, unavailable

GPU_MEMORY_UTILIZATION = 0.85
# each server's share: the reference and the candidate are served side by side
SERVER_MEMORY_UTILIZATION = round(GPU_MEMORY_UTILIZATION / 2, 3)
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
    and kernel (ServedCheck.kernel_counts of a served check of the same model), where known."""
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


class BenchRunner(Protocol):
    def identity(self) -> tuple[str, str]:
        """(engine and version, GPU) of the runs it would make."""
        ...

    def run(self, model_dir: Path, label: str, cfg: ServeGate, raw_dir: Path | None) -> ServedRun:
        """Serve `model_dir` and benchmark every workload of `cfg`."""
        ...

    def run_pair(self, reference: Path, candidate: Path, labels: tuple[str, str],
                 cfg: ServeGate, raw_dir: Path | None) -> tuple[ServedRun, ServedRun]:  # fmt: skip
        """Both served at once, each pass of one next to the same pass of the other."""
        ...


class ReferenceCache:
    """The reference's served figures per (reference model hash, engine and version, GPU,
    workload with its repeats, seed and memory share), in this process and, given a stage
    cache, on disk (`reference-perf/<key>`): another artifact of the same reference on the
    same kind of GPU is measured without serving the reference again."""

    STAGE = "reference-perf"

    def __init__(self, cache: StageCache | None = None, mem: dict[str, Any] | None = None) -> None:
        self.cache = cache
        self.mem: dict[str, Any] = mem if mem is not None else {}

    @staticmethod
    def key(ref_hash: str, engine: str, gpu: str, w: Workload, cfg: ServeGate) -> str:
        return stage_key(ReferenceCache.STAGE, {
            "reference": ref_hash, "engine": engine, "gpu": gpu, "workload": w.model_dump(),
            "repeats": cfg.repeats, "seed": cfg.seed, "memory": SERVER_MEMORY_UTILIZATION,
        }, versions=False)  # fmt: skip

    def get(self, key: str) -> tuple[PerfFigures, ModelServing] | None:
        rec = self.mem.get(key)
        if rec is None and self.cache is not None:
            hit = self.cache.lookup(self.STAGE, key)
            rec = hit.record if hit else None
        if rec is None:
            return None
        self.mem[key] = rec
        return (PerfFigures.from_json(rec["figures"], where=f"{self.STAGE}/{key}"),
                ModelServing.from_json(rec["serving"], where=f"{self.STAGE}/{key}"))  # fmt: skip

    def put(self, key: str, figures: PerfFigures, serving: ModelServing) -> None:
        rec = {"figures": figures.to_json(), "serving": serving.to_json()}
        self.mem[key] = rec
        if self.cache is not None:
            self.cache.get_or_build(self.STAGE, key, lambda _tmp: rec, force=True)


def measure(
    candidate: Path, reference: Path, cfg: ServeGate, runner: BenchRunner,
    raw_dir: Path | None = None, ref_cache: ReferenceCache | None = None,
    kernel_counts: dict[str, dict[str, int]] | None = None, reference_hash: str | None = None,
) -> ServedPerf:  # fmt: skip
    """The candidate served and benchmarked by `runner` beside the reference: both served at
    once, their passes interleaved (`BenchRunner.run_pair`), for the workloads whose
    reference figures `ref_cache` does not hold; the others beside the cached figures.
    `kernel_counts`: the candidate's Linears per kernel, from its served check;
    `reference_hash`: the reference's model hash (computed when not given)."""
    _fits(candidate, cfg)
    ref_cache = ref_cache if ref_cache is not None else ReferenceCache()
    if reference_hash is None:
        from ..model.files import hash_model_dir

        reference_hash = hash_model_dir(Path(reference))[1]
    engine, gpu = runner.identity()
    keys = {w.name: ReferenceCache.key(reference_hash, engine, gpu, w, cfg) for w in cfg.workloads}
    cached = {n: got for n, k in keys.items() if (got := ref_cache.get(k)) is not None}
    label = f"candidate-{Path(candidate).name or 'candidate'}"
    fresh = [w for w in cfg.workloads if w.name not in cached]
    ref, cand, paired = _runs(runner, reference, candidate, label, cfg, fresh, raw_dir)
    ref_serving = serving_facts(ref.log) if ref else next(iter(cached.values()))[1]
    rows = []
    for w in cfg.workloads:
        if w.name in cached:
            ref_fig = cached[w.name][0]
        else:
            assert ref is not None
            ref_fig = figures(ref.results.get(w.name, []), f"{reference} [{w.name}]")
            ref_cache.put(keys[w.name], ref_fig, ref_serving)
        rows.append(WorkloadPerf(
            name=w.name, prompt_len=w.prompt_len, output_len=w.output_len,
            concurrency=w.concurrency, num_prompts=w.prompts(), reference=ref_fig,
            candidate=figures(cand.results.get(w.name, []), f"{candidate} [{w.name}]"),
            interleaved=paired and w.name not in cached, reference_cached=w.name in cached,
        ))  # fmt: skip
    return ServedPerf(
        engine=cand.engine, gpu=cand.gpu, gpu_memory_utilization=SERVER_MEMORY_UTILIZATION,
        workloads=rows, reference=ref_serving,
        candidate=serving_facts(cand.log, kernel_counts), command=cand.command,
    )  # fmt: skip


def _runs(
    runner: BenchRunner, reference: Path, candidate: Path, label: str, cfg: ServeGate,
    fresh: list[Workload], raw_dir: Path | None,
) -> tuple[ServedRun | None, ServedRun, bool]:  # fmt: skip
    """The reference's passes of the `fresh` workloads (None: none) and the candidate's of
    every workload, and whether the fresh ones were interleaved: both served at once when
    the runner can (`run_pair`; a runner without it serves one model at a time)."""
    pair = getattr(runner, "run_pair", None)

    def only(ws: list[Workload]) -> ServeGate:
        return cfg.model_copy(update={"workloads": ws})

    ref: ServedRun | None = None
    cand: ServedRun | None = None
    if fresh and pair is not None:
        ref, cand = pair(reference, candidate, ("reference", label), only(fresh), raw_dir)
    elif fresh:
        ref = runner.run(reference, "reference", only(fresh), raw_dir)
    done = {w.name for w in fresh} if cand is not None else set()
    rest = [w for w in cfg.workloads if w.name not in done]
    if rest:
        alone = runner.run(candidate, label, only(rest), raw_dir)
        if cand is None:
            cand = alone
        else:
            cand.results.update(alone.results)
    assert cand is not None
    return ref, cand, pair is not None


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


@dataclass
class _Server:
    """One `vllm serve` of a run: its model, label, port, log and process."""

    model: str
    label: str
    port: int
    logf: Path
    proc: subprocess.Popen | None = None


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

    def identity(self) -> tuple[str, str]:
        """(engine and version, GPU): what a cached reference figure is keyed by."""
        return _engine(self.python), _gpu()

    def run(self, model_dir: Path, label: str, cfg: ServeGate, raw_dir: Path | None) -> ServedRun:
        """Serve `model_dir` alone and run every workload's passes against it."""
        return self.run_models([(model_dir, label)], cfg, raw_dir)[0]

    def run_pair(self, reference: Path, candidate: Path, labels: tuple[str, str],
                 cfg: ServeGate, raw_dir: Path | None) -> tuple[ServedRun, ServedRun]:  # fmt: skip
        """Both served at once, their passes interleaved (`run_models`)."""
        ref, cand = self.run_models([(reference, labels[0]), (candidate, labels[1])], cfg, raw_dir)
        return ref, cand

    def run_models(
        self, models: list[tuple[Path, str]], cfg: ServeGate, raw_dir: Path | None
    ) -> list[ServedRun]:
        """Every model (one or two) served at once, each with SERVER_MEMORY_UTILIZATION (started
        one after another: vLLM's memory profiling aborts when another process's memory
        moves during it), and every benchmark pass in one child, alternating between them:
        each model's pass r next to the others' pass r, so a drift of the machine (18 % on
        one warm H100 between two starts, issue 57) moves both sides of a ratio alike. The
        child imports vLLM (~25 s) while the servers load and compile, and runs once they all
        answer (the `go` file); a server that fails to start stops it."""
        import tempfile
        from concurrent.futures import ThreadPoolExecutor

        util = SERVER_MEMORY_UTILIZATION  # alone too: its figures match a paired run's
        with tempfile.TemporaryDirectory(prefix="qship-perf-") as tmp, \
                ThreadPoolExecutor(2, thread_name_prefix="qship-perf") as pool:  # fmt: skip
            go = Path(tmp) / "go"
            servers = [_Server(str(Path(m).resolve()), label, _free_port(),
                               Path(tmp) / f"server-{i}.log") for i, (m, label) in enumerate(models)]  # fmt: skip
            outs = [ServedRun(engine="", gpu="") for _ in models]
            engine = pool.submit(_engine, self.python)
            bench = pool.submit(self._bench, servers, cfg, Path(tmp), outs, raw_dir, go)
            try:
                try:
                    for srv, (m, _) in zip(servers, models, strict=True):
                        srv.proc = self._start(srv, Path(m), cfg, util)
                        self._wait(srv.proc, srv.port, srv.logf, srv.label)
                except BaseException:
                    go.write_text("stop")  # the child exits without a pass
                    raise
                go.write_text("go")
                bench.result()
                for out in outs:
                    out.engine, out.gpu = engine.result(), _gpu()
            finally:
                for srv, out in zip(servers, outs, strict=True):
                    _stop(srv.proc)
                    out.log = srv.logf.read_text(errors="replace") if srv.logf.is_file() else ""
        for srv, out in zip(servers, outs, strict=True):
            if raw_dir is not None:
                (raw_dir / f"{srv.label}-server.log").write_text(out.log)
        return outs

    def _start(
        self, srv: _Server, model_dir: Path, cfg: ServeGate, util: float
    ) -> subprocess.Popen:
        server = self._cli("serve", srv.model, "--port", str(srv.port), "--seed", str(cfg.seed),
                           "--gpu-memory-utilization", str(util),
                           "--max-model-len", str(_max_model_len(model_dir, cfg)),
                           *_skip_args(model_dir))  # fmt: skip
        with open(srv.logf, "wb") as fh:
            return subprocess.Popen(server, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip

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

    def _bench(self, servers: list[_Server], cfg: ServeGate, tmp: Path, outs: list[ServedRun],
               raw_dir: Path | None, go: Path | None = None) -> None:  # fmt: skip
        """Every workload's passes (a warm-up, not kept, then `repeats`), each pass of every
        server in turn, in one child of vLLM's environment (vllm_bench_child.py: vLLM
        imported once, not per pass); each pass's result is written as it completes, into
        raw_dir when given. With `go`, the child imports vLLM, then waits for that file to
        say `go` (or `stop`)."""
        res_dir = raw_dir or tmp
        res_dir.mkdir(parents=True, exist_ok=True)
        passes: list[tuple[int, Workload, int | None, list[str]]] = []
        for w in cfg.workloads:
            for r in (None, *range(cfg.repeats)):
                for i, srv in enumerate(servers):
                    passes.append((i, w, r, _pass_argv(srv, w, r, cfg, res_dir)))
        for *_, argv in passes:  # a result left by an earlier run must not count as this one's
            (res_dir / argv[-1]).unlink(missing_ok=True)
        spec = tmp / "passes.json"
        spec.write_text(json.dumps([argv for *_, argv in passes]))
        child = [self.python, str(Path(__file__).with_name("vllm_bench_child.py")), str(spec)]
        child += [str(go)] if go is not None else []
        labels = ", ".join(srv.label for srv in servers)
        rc, output = log.run_child(child, label=f"vllm bench serve ({labels})",
                                   timeout=self.bench_timeout_s + self.start_timeout_s)  # fmt: skip
        for i, w, r, argv in passes:
            res_file = res_dir / argv[-1]
            if r is None or not res_file.is_file():
                continue
            res, out = json.loads(res_file.read_text()), outs[i]
            out.results.setdefault(w.name, []).append(res)
            out.command = out.command or "vllm bench serve " + " ".join(argv)
            log.detail(f"{servers[i].label} {w.name} #{r + 1}: "
                       f"{res.get('output_throughput', 0):.0f} tok/s")  # fmt: skip
        missing = [argv[-1] for *_, argv in passes if not (res_dir / argv[-1]).is_file()]
        if rc != 0 or missing:
            raise StageError(f"vllm bench serve failed (exit {rc}; no result for "
                             f"{', '.join(missing) or 'none'}): {output[-1200:]}",
                             path=servers[0].model, hint="see vLLM's message above")  # fmt: skip


def _pass_argv(
    srv: _Server, w: Workload, r: int | None, cfg: ServeGate, res_dir: Path
) -> list[str]:
    """`vllm bench serve`'s arguments for pass r of workload w (None: the warm-up)."""
    seed, n = (cfg.seed + 1000, max(w.concurrency, 4)) if r is None else (cfg.seed + r, w.prompts())
    return [
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{srv.port}",
        "--model", srv.model, "--dataset-name", "random", "--random-input-len",
        str(w.prompt_len), "--random-output-len", str(w.output_len),
        "--num-prompts", str(n), "--max-concurrency", str(w.concurrency),
        "--seed", str(seed), "--ignore-eos", "--percentile-metrics", "ttft,tpot",
        "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(res_dir),
        "--result-filename", f"{srv.label}-{w.name}-{'warm' if r is None else r}.json",
    ]  # fmt: skip


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


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
