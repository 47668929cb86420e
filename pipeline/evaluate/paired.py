"""The drop between two models scored on the same items, with its paired uncertainty.

With d_i = reference_i − candidate_i (each 0 or 1), the drop is mean(d) and its standard
error std(d)/sqrt(n). Two 4-bit-vs-16-bit models agree on most items, so most d_i are 0
and this error is several times smaller than sqrt(se_ref² + se_cand²), which treats the
two accuracies as independent samples: small drops become measurable on a few hundred items.

The 95 % interval is Tango's score interval for a paired difference (Stat. Med. 1998;
Fagerland et al. 2014 recommend it), not mean ± 1.96 s.e.: with no item on which the two
models differ the s.e. is 0 and that Wald interval [0, 0] would claim certainty from 20
items. The score interval's width comes from how many items could differ unseen: with none
of n differing it is ±z²/(n + z²) (±16 pp at 20 items, ±1 pp at 400), the Wilson bound on
the discordant share, and it is close to the Wald one once items differ by the dozen.
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
    lost, gained = sum(1 for x in d if x > 0), sum(1 for x in d if x < 0)
    lo, hi = (100 * x for x in tango_interval(lost, gained, n))
    return {
        "n": n,
        "reference": _score([ref[k] for k in keys]),
        "candidate": _score([cand[k] for k in keys]),
        "drop_pp": drop,
        "drop_stderr_pp": se,
        "ci95_pp": (lo, hi),
        "within_noise": lo <= 0.0,
        "lost": lost,
        "gained": gained,
    }


def _score_z(lost: int, gained: int, n: int, delta: float) -> float:
    """Tango's score statistic for drop = delta: (lost - gained - n·delta) over its s.e.
    with the gained share at its maximum-likelihood value under that drop."""
    a, b = 2 * n, -lost - gained + (2 * n - lost + gained) * delta
    c = -gained * delta * (1 - delta)
    p_gained = (math.sqrt(max(b * b - 4 * a * c, 0.0)) - b) / (2 * a)
    num = lost - gained - n * delta
    var = n * (2 * p_gained + delta * (1 - delta))
    if var <= 0:
        return 0.0 if num == 0 else math.copysign(math.inf, num)
    return num / math.sqrt(var)


def tango_interval(lost: int, gained: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The drop's score interval (fractions): every delta whose |score| <= z; the score falls
    as delta grows, so each end is found by bisection between the estimate and ±1."""
    est = (lost - gained) / n

    def end(towards: float, sign: int) -> float:
        inside, outside = est, towards
        if sign * _score_z(lost, gained, n, towards) <= z:
            return towards
        for _ in range(60):
            mid = (inside + outside) / 2
            if sign * _score_z(lost, gained, n, mid) <= z:
                inside = mid
            else:
                outside = mid
        return inside

    return end(-1.0, 1), end(1.0, -1)
