"""Scoring generated answers, per item, by lm-eval's definitions; code in qship's sandbox.

lm-eval generates (`generate_until`, greedy, its stop sequences: the benchmark child in
benchmarks.py) and qship scores what came back:

- gsm8k: lm-eval's `gsm8k_cot` exact match. Its `flexible-extract` filter (the last
  number in the completion) is the primary metric, `strict-match` ("The answer is N.")
  the stricter one; both compare after the task's `regexes_to_ignore` (commas, `$`, a
  trailing period), case-insensitively, with the number after `####` in the gold answer.
- humaneval: pass@1 (greedy, one completion): `prompt + completion`, then the task's
  `test` and `check(entry_point)`, as lm-eval's `build_predictions` and `doc_to_target`
  build it for `code_eval`.
- mbpp: pass@1: the completion, then the first three `test_list` asserts (lm-eval's
  `doc_to_target` outside few-shot).

A program passes when it exits 0 within the sandbox's limits (code_eval's rule: the tests
raised nothing). The reference cache keeps the completions, not the scores, so a cached
reference is scored by today's scorer and sandbox.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..data.generative import GENERATIVE
from .sandbox import Sandbox

# lm-eval gsm8k-cot.yaml: filter_list and metric_list
GSM8K_STRICT = r"The answer is (\-?[0-9\.\,]+)."
GSM8K_FLEXIBLE = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
GSM8K_IGNORE = (",", r"\$", "(?s).*#### ", r"\.$")
INVALID = "[invalid]"  # lm-eval's RegexFilter fallback
METRIC = {"gsm8k": "exact_match,flexible-extract", "humaneval": "pass@1", "mbpp": "pass@1"}


def extract_answer(completion: str, pattern: str, group_select: int) -> str:
    """lm-eval's RegexFilter: the `group_select`-th match; of a match's groups the first
    that matched; [invalid] when none."""
    found = re.findall(pattern, completion)
    if not found:
        return INVALID
    match = found[group_select]
    if isinstance(match, tuple):
        groups = [m for m in match if m]
        match = groups[0] if groups else INVALID
    return match.strip()


def _normalized(text: str) -> str:
    for pattern in GSM8K_IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def gsm8k_target(doc: dict[str, Any]) -> str:
    """lm-eval's doc_to_target: the number after `####`."""
    return str(doc["answer"]).split("####")[-1].strip()


def gsm8k_correct(doc: dict[str, Any], completion: str, *, strict: bool = False) -> bool:
    answer = (extract_answer(completion, GSM8K_STRICT, 0) if strict
              else extract_answer(completion, GSM8K_FLEXIBLE, -1))  # fmt: skip
    return _normalized(answer) == _normalized(gsm8k_target(doc))


def humaneval_program(doc: dict[str, Any], completion: str) -> str:
    return doc["prompt"] + completion + "\n" + doc["test"] + f"\ncheck({doc['entry_point']})"


def mbpp_program(doc: dict[str, Any], completion: str) -> str:
    return completion + "\n" + "\n".join(doc["test_list"][:3])


PROGRAMS: dict[str, Callable[[dict[str, Any], str], str]] = {
    "humaneval": humaneval_program,
    "mbpp": mbpp_program,
}


def score(
    task: str, docs: list[dict[str, Any]], completions: dict[str, str], sandbox: Sandbox | None
) -> dict[str, float]:
    """{doc_id: 1.0 right / passed, 0.0 otherwise} for the completions lm-eval returned."""
    items: dict[str, float] = {}
    for doc_id, completion in completions.items():
        doc = docs[int(doc_id)]
        if GENERATIVE[task].kind == "gsm8k":
            items[doc_id] = float(gsm8k_correct(doc, completion))
            continue
        assert sandbox is not None, "code tasks are scored in the sandbox"
        items[doc_id] = float(sandbox.run(PROGRAMS[task](doc, completion)).passed)
    return items
