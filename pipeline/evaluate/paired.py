"""The drop between two models scored on the same items, with its paired uncertainty.

With d_i = reference_i − candidate_i (each 0 or 1), the drop is mean(d) and its standard
error std(d)/sqrt(n). Two 4-bit-vs-16-bit models agree on most items, so most d_i are 0
and this error is several times smaller than sqrt(se_ref² + se_cand²), which treats the
two accuracies as independent samples: small drops become measurable on a few hundred items.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import StageError
from ..records.benchmarks import Score

Z95 = 1.959964


def _score(values: list[float]) -> Score:
    n = len(values)
    p = sum(values) / n
    return Score(value=p, stderr=math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None)


def paired(ref: dict[str, float], cand: dict[str, float], *, where: str) -> dict[str, Any]:
    """TaskResult fields: both scores, drop (pp), its paired s.e. and 95 % interval."""
    if ref.keys() != cand.keys() or not ref:
        raise StageError(
            f"benchmark {where}: the models were scored on different items "
            f"({len(ref)} vs {len(cand)}, {len(ref.keys() ^ cand.keys())} not shared)",
            hint="a cached reference from another data version? delete the cache's "
            "reference-bench entries",
        )
    keys = sorted(ref)
    d = [ref[k] - cand[k] for k in keys]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    se = 100 * sd / math.sqrt(n)
    drop = 100 * mean
    lo, hi = drop - Z95 * se, drop + Z95 * se
    return {
        "n": n,
        "reference": _score([ref[k] for k in keys]),
        "candidate": _score([cand[k] for k in keys]),
        "drop_pp": drop,
        "drop_stderr_pp": se,
        "ci95_pp": (lo, hi),
        "within_noise": lo <= 0.0,
        "lost": sum(1 for x in d if x > 0),
        "gained": sum(1 for x in d if x < 0),
    }
