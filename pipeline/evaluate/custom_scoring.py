"""Scoring a custom task's generated answers, per row (data/custom_tasks.py reads them).

- exact: the completion, stripped, equals the answer, stripped;
- regex: the answer, a pattern, is found in the completion (`re.search`);
- number: the first number in the completion (thousands commas ignored) is within the
  row's tolerance of the answer;
- contains: the answer appears in the completion, case-insensitively.

Multiple-choice rows are scored by lm-eval (`acc`: the choice of highest log-likelihood).
The reference cache keeps completions, so a cached reference is scored by today's rules.
"""

from __future__ import annotations

import re
from typing import Any

from ..data.custom_tasks import first_number


def correct(row: dict[str, Any], completion: str) -> bool:
    match, answer = row["match"], row["answer"]
    if match == "exact":
        return completion.strip() == str(answer).strip()
    if match == "regex":
        return re.search(answer, completion) is not None
    if match == "number":
        got = first_number(completion)
        return got is not None and abs(got - float(answer)) <= float(row["tolerance"])
    if match == "contains":
        return str(answer).lower() in completion.lower()
    raise ValueError(f"no generated-answer rule for match {match!r}")


def score(rows: list[dict[str, Any]], completions: dict[str, str]) -> dict[str, float]:
    """{doc_id: 1.0 right, 0.0 wrong} for the completions lm-eval returned."""
    return {i: float(correct(rows[int(i)], c)) for i, c in completions.items()}
