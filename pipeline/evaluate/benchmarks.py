"""Benchmark scores through lm-eval: both models on the same items, the drop paired.

Generative tasks (gsm8k, humaneval, mbpp) generate in the same child (lm-eval's
`generate_until`) and are scored by qship (generative.py; code in sandbox.py).

Every lm-eval run is a child process (`python -m pipeline.evaluate.benchmarks SPEC`): the
model's memory is returned when it ends (reference and candidate are never loaded
together), a Hub task that cannot get its data fails or times out alone, and the child
writes its own task folder (lm-eval's task definitions pointed at the local, pinned data:
pipeline.data.benchmarks.task_dir).

lm-eval runs with `log_samples`, so each item's 0/1 result comes back. The drop is then a
paired statistic: mean of (reference − candidate) per item, whose standard error is far
smaller than that of two independent accuracies, because both models get mostly the same
items right (paired.py). The reference's per-item results are cached per task in the stage
cache (key: reference hash, task, limit, data, lm-eval version, dtype, device, batch size),
so one reference pass serves every recipe and `qship compare`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import log
from ..data import benchmarks as data
from ..data import custom_tasks
from ..data.generative import CODE_TASKS, GENERATIVE, load_docs
from ..io.cache import StageCache, stage_key
from ..model.devices import device_kind
from ..records.benchmarks import Benchmarks, TaskResult
from ..records.evaluation import ModelRef
from . import custom_scoring, generative
from .paired import paired
from .sandbox import Sandbox, sandbox_for

ROOT = Path(__file__).resolve().parents[2]
HUB_PROBE_URL = "https://huggingface.co/api/datasets?limit=1"
STAGE = "reference-bench"
# the per-item metric each task is judged by: lm-eval's (and the leaderboards') primary
PRIMARY = {
    "hellaswag": "acc_norm", "arc_easy": "acc_norm", "arc_challenge": "acc_norm",
    "piqa": "acc_norm", "winogrande": "acc", "lambada_openai": "acc",
}  # fmt: skip
FALLBACK = ("acc_norm", "acc", "exact_match")  # other tasks: the first one they report


def hub_reachable(timeout: float = 3.0) -> tuple[bool, str]:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False, "offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set)"
    try:
        urllib.request.urlopen(HUB_PROBE_URL, timeout=timeout).close()  # noqa: S310
        return True, ""
    except Exception as e:  # noqa: BLE001 - any failure means: not reachable now
        return False, f"Hub unreachable ({type(e).__name__}: {str(e)[:120]})"


def run_lm_eval(
    model_dir: Path,
    tasks: list[str],
    *,
    data_dir: Path | None,
    limit: int | None,
    device: str,
    dtype: str,
    batch_size: int,
    offline: bool = True,
    timeout_s: float | None = None,
    offload: str = "none",
    custom_dir: Path | None = None,
) -> tuple[dict[str, dict], float]:
    """lm-eval on `tasks` (lm-eval task names, or custom tasks of `custom_dir`) in a child
    process;
    {task: {status, metric, items: {doc_id: 0/1}, split, n_total} | {status, reason}}, and
    the child's wall time (all its tasks: lm-eval pools their requests)."""
    if not tasks:
        return {}, 0.0
    with tempfile.TemporaryDirectory(prefix="qship-lmeval-") as tmp:
        spec = {"model_dir": str(Path(model_dir).resolve()), "tasks": tasks,
                "data_dir": str(data_dir) if data_dir else None, "limit": limit,
                "device": device, "dtype": dtype, "batch_size": batch_size, "work": tmp,
                "offload": offload, "custom_dir": str(custom_dir) if custom_dir else None}  # fmt: skip
        env = dict(os.environ)
        if offline:
            env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        t0 = time.perf_counter()
        try:
            rc, output = log.run_child(
                [sys.executable, "-m", "pipeline.evaluate.benchmarks", json.dumps(spec)],
                label=f"lm-eval ({len(tasks)} task(s))", env=env, cwd=tmp, timeout=timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {t: {"status": "skipped", "reason": f"timed out after {timeout_s:.0f} s"}
                    for t in tasks}, float(timeout_s or 0)  # fmt: skip
        out = Path(tmp) / "result.json"
        if rc != 0 or not out.is_file():
            reason = _failure(rc, output)
            return {t: {"status": "skipped", "reason": reason} for t in tasks}, 0.0
        res: dict[str, dict] = json.loads(out.read_text())
    return res, round(time.perf_counter() - t0, 2)


def _failure(rc: int, stderr: str) -> str:
    """Why the child failed: its last line that is not a progress bar, or the signal."""
    if rc < 0:
        return (f"lm-eval was killed by signal {-rc}" + (" (out of memory? lower "
                "evaluation.task_batch_size)" if -rc == 9 else ""))  # fmt: skip
    lines = [ln for ln in stderr.splitlines() if ln.strip() and "it/s]" not in ln
             and "s/it]" not in ln and "%|" not in ln]  # fmt: skip
    return lines[-1][:300] if lines else f"lm-eval exited {rc}"


def _primary(task: str, sample: dict) -> str | None:
    want = "acc" if task.startswith("mmlu_") else PRIMARY.get(task)
    for m in (want, *FALLBACK) if want else FALLBACK:
        if isinstance(sample.get(m), int | float | bool):
            return m
    return None


def _served_model(spec: dict) -> Any:
    """lm-eval's HF model around qship's loader with vLLM's Linear numerics (W8A8, W4A8)
    and the layers whose KV cache is served 16-bit, so the benchmarks score what vLLM
    serves, as the KL does."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from ..model.loading import load_model
    from ..records.checkpoint import kv_skip_layers
    from .numerics import serve_linears
    from .scoring import skip_kv_layers

    path = Path(spec["model_dir"])
    dtype = None if spec["dtype"] == "auto" else spec["dtype"]
    m = load_model(path, device=spec["device"], dtype=dtype)
    serve_linears(m)
    skip_kv_layers(m, kv_skip_layers(path))
    return HFLM(pretrained=m, tokenizer=AutoTokenizer.from_pretrained(str(path)),
                batch_size=spec["batch_size"])  # fmt: skip


def _served_numerics(model_dir: Path) -> bool:
    """Whether the checkpoint computes otherwise as served than as transformers loads it:
    its activations quantized (W8A8, W4A8) or layers with a 16-bit KV cache."""
    from ..records.checkpoint import kv_skip_layers
    from .scoring import quantizes_activations

    try:
        return quantizes_activations(model_dir) or bool(kv_skip_layers(model_dir))
    except (OSError, ValueError):
        return False


def _worker(spec: dict) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    work = Path(spec["work"])
    include = None
    if spec["data_dir"]:
        local = [t for t in spec["tasks"] if t in data.LOCAL_TASKS]
        include = str(data.task_dir(local, Path(spec["data_dir"]), work / "tasks"))
    custom = custom_tasks.manifest(Path(spec["custom_dir"])) if spec.get("custom_dir") else {}
    if custom:
        own = str(custom_tasks.task_dir(Path(spec["custom_dir"]), work / "custom"))
        include = [p for p in (include, own) if p]  # type: ignore[assignment]
    # a custom task runs under a name lm-eval cannot already know
    names = {t: custom_tasks.lm_eval_name(t) if t in custom else t for t in spec["tasks"]}
    tm = TaskManager(include_path=include)
    args = f"pretrained={spec['model_dir']},dtype={spec['dtype']}"
    model: Any = "hf"
    if spec.get("offload", "none") != "none" and spec["device"].startswith("cuda"):
        # a model that does not fit the GPU: lm-eval's accelerate placement (what fits on the
        # GPU, the rest in host memory, then files)
        args += f",parallelize=True,offload_folder={work / 'offload'}"
    elif _served_numerics(Path(spec["model_dir"])):
        model, args = _served_model(spec), ""
    r = lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=list(names.values()), task_manager=tm, limit=spec["limit"], device=spec["device"],
        batch_size=spec["batch_size"], log_samples=True, bootstrap_iters=0,
    )  # fmt: skip
    out: dict[str, Any] = {}
    for t in spec["tasks"]:
        samples = r["samples"].get(names[t]) or []
        generated = t in GENERATIVE or (t in custom and custom_tasks.generated(custom[t]))
        if generated:  # qship scores the completions (generative.py, custom_scoring.py)
            done = {str(s["doc_id"]): s["resps"][0][0] for s in samples}
            n_total = custom[t]["n"] if t in custom else len(load_docs(t, Path(spec["data_dir"])))
            out[t] = {"status": "ok", "split": "test", "n_total": n_total, "completions": done}
            continue
        metric = _primary(t, samples[0]) if samples else None
        if metric is None:
            out[t] = {"status": "skipped", "reason": "no per-item accuracy from lm-eval "
                      "(qship pairs acc / acc_norm / exact_match)"}  # fmt: skip
            continue
        cfg = r["configs"].get(names[t], {})
        out[t] = {
            "status": "ok", "metric": metric,
            "items": {str(s["doc_id"]): float(s[metric]) for s in samples},
            "split": cfg.get("test_split") or cfg.get("validation_split"),
            "n_total": (r.get("n-samples") or {}).get(names[t], {}).get("original"),
        }  # fmt: skip
    (work / "result.json").write_text(json.dumps(out))


def _pool(name: str, parts: dict[str, dict]) -> dict:
    """A group (mmlu) as one task: its subtasks' items pooled (lm-eval's size-weighted mean)."""
    bad = [r for r in parts.values() if r.get("status") != "ok"]
    if bad:
        return {"status": "skipped", "reason": bad[0].get("reason", "not run")}
    first = next(iter(parts.values()))
    return {
        "status": "ok", "metric": first["metric"], "split": first["split"],
        "items": {f"{t}/{k}": v for t, r in parts.items() for k, v in r["items"].items()},
        "n_total": sum(r["n_total"] or 0 for r in parts.values()) or None,
    }  # fmt: skip


def _run_named(
    model_dir: Path, local: list[str], hub: list[str], *, online: bool, why: str,
    hub_timeout_s: float, **kw: Any,
) -> tuple[dict[str, dict], float]:  # fmt: skip
    """Results by the names the recipe used (a group pooled), and the seconds. Local tasks:
    one offline child; each Hub task its own child: one missing dataset skips only itself."""
    raw, secs = run_lm_eval(model_dir, data.expand(local), **kw)
    res = {n: _pool(n, {t: raw[t] for t in data.expand([n])}) if n in data.GROUPS else raw[n]
           for n in local}  # fmt: skip
    for t in hub:
        got, s = run_lm_eval(model_dir, [t], **{**kw, "data_dir": None}, offline=not online,
                             timeout_s=hub_timeout_s)  # fmt: skip
        if got[t]["status"] != "ok" and not online:
            got[t]["reason"] = f"{why}; not in the local datasets cache: {got[t]['reason']}"
        res[t], secs = got[t], secs + s
    return res, secs


def reference_key(
    model_hash: str, task: str, *, hub: bool, limit: int | None, dtype: str, device: str,
    batch_size: int, custom: str | None = None,
) -> str:  # fmt: skip
    """The stage-cache key of one task's per-item reference results (`custom`: a custom
    task's content hash, its rows as the model sees them and how it generates)."""
    source = f"custom:{custom}" if custom else "hub" if hub else f"{data.PACKAGE}=={data.VERSION}"
    return stage_key(STAGE, {
        "model_hash": model_hash, "task": task, "limit": limit, "data": source,
        "dtype": dtype, "device": device_kind(device), "batch_size": batch_size,
    })  # fmt: skip


def _scored(
    task: str, result: dict, data_dir: Path | None, limit: int | None, sandbox: Sandbox | None
) -> dict:
    """A generative task's completions scored per item (the cache holds the completions)."""
    if "completions" not in result:  # multiple choice: lm-eval's acc per item
        return result
    if task not in GENERATIVE:  # a custom JSONL/CSV task (data_dir: its folder)
        assert data_dir is not None
        rows = custom_tasks.load_rows(data_dir, task, limit)
        match = custom_tasks.manifest(data_dir)[task]["match"]
        return {**result, "items": custom_scoring.score(rows, result["completions"]),
                "metric": f"correct ({match})"}  # fmt: skip
    assert data_dir is not None
    items = generative.score(task, load_docs(task, data_dir, limit), result["completions"],
                             sandbox)  # fmt: skip
    return {**result, "items": items, "metric": generative.METRIC[task]}


def _const(record: dict) -> Callable[[Path], dict]:
    return lambda _tmp: record


def _source(name: str, hub_tasks: list[str], custom: dict[str, dict]) -> str:
    if name in custom:
        return f"custom: {custom[name]['path']} (sha256 {custom[name]['sha256'][:12]}…)"
    return "hub" if name in hub_tasks else f"{data.PACKAGE}=={data.VERSION}"


def compare(
    reference: ModelRef,
    candidate_dir: Path,
    *,
    tasks: list[str],
    hub_tasks: list[str],
    data_dir: Path | None,
    limit: int | None,
    cache_dir: Path,
    device: str,
    dtype: str | None = None,
    batch_size: int = 4,
    hub_timeout_s: float = 1800.0,
    offload: str = "none",
    code_execution: str = "off",
    custom_dir: Path | None = None,
) -> Benchmarks:
    """Both models on every task, item by item; the reference from the cache when it can.
    Code tasks need `code_execution` (sandbox.py); checked before any model runs. The
    custom tasks of `custom_dir` (data/custom_tasks.py) run beside the local ones."""
    code = [t for t in tasks if t in CODE_TASKS]
    sandbox = sandbox_for(code_execution, where="evaluation.code_execution") if code else None
    online, why = hub_reachable() if hub_tasks else (False, "")
    custom = custom_tasks.manifest(custom_dir) if custom_dir else {}
    local = [*tasks, *custom]
    # float32 on the CPU as everywhere in evaluate (bf16 matmuls there are slow and lossy)
    dt = dtype or ("float32" if device_kind(device) == "cpu" else "auto")
    kw: dict[str, Any] = dict(data_dir=data_dir, limit=limit, device=device, dtype=dt,
                              batch_size=batch_size, offload=offload, custom_dir=custom_dir)  # fmt: skip
    cache = StageCache(Path(cache_dir))

    def key(name: str) -> str:
        content = (
            custom_tasks.content_hash(custom_dir, name) if custom_dir and name in custom else None
        )
        return reference_key(reference.model_hash, name, hub=name in hub_tasks, limit=limit,
                             dtype=dt, device=device, batch_size=batch_size, custom=content)  # fmt: skip

    ref: dict[str, dict] = {}
    for name in [*local, *hub_tasks]:
        hit = cache.lookup(STAGE, key(name))
        if hit is not None:
            ref[name] = {**hit.record, "cached": True}
    got, ref_s = _run_named(reference.path, [t for t in local if t not in ref],
                            [t for t in hub_tasks if t not in ref], online=online, why=why,
                            hub_timeout_s=hub_timeout_s, **kw)  # fmt: skip
    for name, r in got.items():
        ref[name] = r
        if r["status"] == "ok":
            cache.get_or_build(STAGE, key(name), _const(r), force=True)
    ok = [n for n in [*local, *hub_tasks] if ref[n]["status"] == "ok"]
    cand, cand_s = _run_named(candidate_dir, [t for t in local if t in ok],
                      [t for t in hub_tasks if t in ok], online=online, why=why,
                      hub_timeout_s=hub_timeout_s, **kw)  # fmt: skip
    out = {}
    for name in [*local, *hub_tasks]:
        r, c = ref[name], cand.get(name, {"status": "skipped", "reason": "reference did not run"})
        source = _source(name, hub_tasks, custom)
        if r["status"] != "ok" or c["status"] != "ok":
            reason = r.get("reason") if r["status"] != "ok" else c.get("reason")
            out[name] = TaskResult(status="skipped", reason=reason or "not run", data=source)
            continue
        if name in GENERATIVE or name in custom:
            folder = custom_dir if name in custom else data_dir
            r, c = (_scored(name, x, folder, limit, sandbox) for x in (r, c))
        stats = paired(r["items"], c["items"], where=name)
        out[name] = TaskResult(
            status="ok", data=source, split=r["split"], metric=r["metric"],
            n_total=r["n_total"], reference_cached=bool(r.get("cached")),
            isolation=sandbox.isolation if name in code and sandbox else None, **stats,
        )  # fmt: skip
    return Benchmarks(tasks=out, limit=limit, hub_online=online,
                      seconds={"reference": ref_s, "candidate": cand_s})  # fmt: skip


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
