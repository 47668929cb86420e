"""Benchmark scores through lm-eval, for reference and candidate, and the drop.

Each lm-eval run happens in a child process (`python -m pipeline.evaluate.benchmarks`) so that
* a hub task whose data cannot be had fails fast or times out, and is reported as
  "skipped: <reason>" instead of hanging the evaluation;
* the model's memory is returned when the run ends (reference and candidate are never
  loaded together);
* the child can `chdir` into eval/tasks, against which the task YAMLs' relative
  `data_files` paths resolve.

Local tasks (eval/tasks/*.yaml, built by eval/build_tasks.py) always run offline
(HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1). Hub tasks run online only when a quick probe
of the Hub answers; otherwise they are tried offline (succeeds when their data is in the
local datasets cache) and reported skipped when that fails. Reference scores are cached
per (reference hash, task files, limit) in the stage cache.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from ..io.cache import StageCache, stage_key
from ..io.hashing import hash_files, list_files
from ..records.evaluation import Benchmarks, ModelRef, TaskResult

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = ROOT / "eval" / "tasks"
HUB_PROBE_URL = "https://huggingface.co/api/datasets?limit=1"
# primary metric per task and whether higher is better; others: acc if present
PRIMARY: dict[str, tuple[str, bool]] = {
    "qship_news_ppl": ("bits_per_byte", False),
    "qship_lastword": ("acc", True),
    "arc_easy": ("acc_norm", True),
    "arc_challenge": ("acc_norm", True),
    "hellaswag": ("acc_norm", True),
    "lambada_openai": ("acc", True),
    "piqa": ("acc_norm", True),
    "winogrande": ("acc", True),
    "wikitext": ("word_perplexity", False),
}
LOWER_IS_BETTER = ("perplexity", "bits_per_byte")


def hub_reachable(timeout: float = 3.0) -> tuple[bool, str]:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False, "offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set)"
    try:
        urllib.request.urlopen(HUB_PROBE_URL, timeout=timeout).close()  # noqa: S310
        return True, ""
    except Exception as e:  # noqa: BLE001 - any failure means: not reachable now
        return False, f"Hub unreachable ({type(e).__name__}: {str(e)[:120]})"


def tasks_hash(tasks_dir: Path = TASKS_DIR) -> str:
    d = hash_files(tasks_dir, [r for r in list_files(tasks_dir) if not r.startswith(".")])
    return stage_key("tasks", {r: v.sha256 for r, v in d.items()}, versions=False)


def run_lm_eval(
    model_dir: Path,
    tasks: list[str],
    *,
    tasks_dir: Path = TASKS_DIR,
    limit: int | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    batch_size: int = 1,
    offline: bool = True,
    timeout_s: float | None = None,
) -> dict[str, dict]:
    """Run lm-eval on `tasks` in a child process; {task: {status, metrics|reason, ...}}."""
    if not tasks:
        return {}
    with tempfile.TemporaryDirectory(prefix="qship-lmeval-") as tmp:
        out = Path(tmp) / "result.json"
        spec = {
            "model_dir": str(Path(model_dir).resolve()),
            "tasks": tasks,
            "tasks_dir": str(Path(tasks_dir).resolve()),
            "limit": limit,
            "device": device,
            "dtype": dtype or "auto",
            "batch_size": batch_size,
            "out": str(out),
        }
        env = dict(os.environ)
        if offline:
            env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pipeline.evaluate.benchmarks", json.dumps(spec)],
                env=env,
                cwd=str(Path(tasks_dir).resolve()),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return {
                t: {"status": "skipped", "reason": f"timed out after {timeout_s:.0f} s"}
                for t in tasks
            }
        secs = round(time.perf_counter() - t0, 2)
        if proc.returncode != 0 or not out.is_file():
            tail = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()]
            reason = tail[-1][:300] if tail else f"lm-eval exited {proc.returncode}"
            return {t: {"status": "skipped", "reason": reason} for t in tasks}
        res = json.loads(out.read_text())
    for r in res.values():
        r["seconds"] = secs
    return res


def _worker(spec: dict) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=spec["tasks_dir"])
    known = set(tm.all_tasks)
    out: dict[str, Any] = {}
    todo = [t for t in spec["tasks"] if t in known]
    for t in spec["tasks"]:
        if t not in known:
            out[t] = {"status": "skipped", "reason": f"unknown lm-eval task {t!r}"}
    if todo:
        args = f"pretrained={spec['model_dir']},dtype={spec['dtype']}"
        r = lm_eval.simple_evaluate(
            model="hf",
            model_args=args,
            tasks=todo,
            task_manager=tm,
            limit=spec["limit"],
            device=spec["device"],
            batch_size=spec["batch_size"],
            log_samples=False,
            bootstrap_iters=1000,
        )
        for t in todo:
            raw = r["results"].get(t, {})
            metrics = {}
            for k, v in raw.items():
                if "," not in k or "_stderr," in k or k == "alias":
                    continue
                name = k.split(",", 1)[0]
                se = raw.get(k.replace(",", "_stderr,", 1))
                metrics[name] = {
                    "value": float(v),
                    "stderr": float(se)
                    if isinstance(se, int | float) and math.isfinite(se)
                    else None,
                }
            n = (r.get("n-samples") or {}).get(t, {})
            out[t] = {"status": "ok", "metrics": metrics, "n": n.get("effective")}
    Path(spec["out"]).write_text(json.dumps(out, indent=2))


def _primary(task: str, metrics: dict) -> tuple[str, bool]:
    if task in PRIMARY and PRIMARY[task][0] in metrics:
        return PRIMARY[task]
    for name in ("acc_norm", "acc", "exact_match", *metrics):
        if name in metrics:
            return name, not any(s in name for s in LOWER_IS_BETTER)
    raise KeyError(task)


def compare(
    reference: ModelRef,
    candidate_dir: Path,
    *,
    tasks: list[str],
    hub_tasks: list[str],
    limit: int | None,
    cache_dir: Path,
    device: str = "cpu",
    dtype: str | None = None,
    tasks_dir: Path = TASKS_DIR,
    hub_timeout_s: float = 1800.0,
) -> Benchmarks:
    """Scores of both models on every task, with drop = how much worse the candidate is."""
    online, why = hub_reachable() if hub_tasks else (False, "")

    def run(model_dir: Path, hub: list[str]) -> dict[str, dict]:
        res = run_lm_eval(
            model_dir, tasks, tasks_dir=tasks_dir, limit=limit, device=device, dtype=dtype
        )
        for ht in hub:  # one child each: one unavailable dataset skips only its task
            got = run_lm_eval(
                model_dir,
                [ht],
                tasks_dir=tasks_dir,
                limit=limit,
                device=device,
                dtype=dtype,
                offline=not online,
                timeout_s=hub_timeout_s,
            )
            for r in got.values():
                if r["status"] != "ok" and not online:
                    r["reason"] = f"{why}; not in the local datasets cache: {r['reason']}"
            res.update(got)
        return res

    key = stage_key(
        "reference-bench",
        {
            "model_hash": reference.model_hash,
            "tasks": tasks,
            "hub_tasks": hub_tasks,
            "limit": limit,
            "tasks_files": tasks_hash(tasks_dir),
            "dtype": dtype or "auto",
            "device": device,
        },
    )
    cache = StageCache(Path(cache_dir))
    hit = cache.lookup("reference-bench", key)
    if hit and all(r.get("status") == "ok" for r in hit.record["results"].values()):
        ref_res, ref_hit = hit.record["results"], True
    else:
        ref_res, ref_hit = run(reference.path, hub_tasks), False
        if all(r.get("status") == "ok" for r in ref_res.values()):
            cache.get_or_build("reference-bench", key, lambda tmp: {"results": ref_res}, force=True)
    # a hub task whose data the reference run could not get is not retried for the candidate
    cand_res = run(
        candidate_dir, [t for t in hub_tasks if ref_res.get(t, {}).get("status") == "ok"]
    )
    out: dict[str, TaskResult] = {}
    for t in [*tasks, *hub_tasks]:
        r, c = ref_res.get(t, {}), cand_res.get(t, {})
        if r.get("status") != "ok" or c.get("status") != "ok":
            reason = r.get("reason") if r.get("status") != "ok" else c.get("reason")
            out[t] = TaskResult(status="skipped", reason=reason or "not run", hub=t in hub_tasks)
            continue
        metric, higher = _primary(t, r["metrics"])
        rv, cv = r["metrics"][metric], c["metrics"][metric]
        drop = (rv["value"] - cv["value"]) if higher else (cv["value"] - rv["value"])
        ses = [x for x in (rv.get("stderr"), cv.get("stderr")) if x is not None]
        out[t] = TaskResult.model_validate(
            {
                "status": "ok",
                "hub": t in hub_tasks,
                "metric": metric,
                "higher_is_better": higher,
                "reference": rv,
                "candidate": cv,
                "drop": drop,
                "drop_stderr": math.sqrt(sum(x * x for x in ses)) if len(ses) == 2 else None,
                "n": c.get("n"),
                "all_metrics": {"reference": r["metrics"], "candidate": c["metrics"]},
            }
        )
    return Benchmarks(tasks=out, limit=limit, reference_cached=ref_hit, hub_online=online)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
