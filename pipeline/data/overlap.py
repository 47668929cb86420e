"""Is any evaluation text also calibration text? Word 13-gram overlap (GPT-3's check).

The calibration windows are decoded back to text (what the quantizer actually saw) and cut
into lowercased word n-grams; every evaluation item -- a held-out window, a benchmark
document's text fields -- counts as overlapping when one of its n-grams is among them.
A field shorter than n words cannot overlap (ARC's short questions are checked through
their longer fields only). A quantizer calibrated on the text it is scored on would look
better than it is, so above `evaluation.max_overlap` the run refuses (exit 2).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from ..errors import UsageError
from ..records.benchmarks import Overlap, OverlapSet

N = 13
_WORD = re.compile(r"\w+")


def ngrams(text: str, n: int = N) -> set[tuple[str, ...]]:
    w = _WORD.findall(text.lower())
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def measure(
    calibration: Iterable[str],
    sets: Mapping[str, Sequence[Sequence[str]]],
    *,
    max_fraction: float,
    n: int = N,
) -> Overlap:
    """`sets`: name -> items, each item its text fields."""
    seen: set[tuple[str, ...]] = set()
    for text in calibration:
        seen |= ngrams(text, n)
    out = {}
    for name, items in sets.items():
        hits, examples = 0, list[str]()
        for fields in items:
            shared = next((g for f in fields for g in ngrams(f, n) if g in seen), None)
            if shared is not None:
                hits += 1
                if len(examples) < 3:
                    examples.append(" ".join(shared))
        out[name] = OverlapSet(
            items=len(items), overlapping=hits, fraction=hits / max(len(items), 1),
            examples=examples,
        )  # fmt: skip
    return Overlap(n=n, calibration_ngrams=len(seen), max_fraction=max_fraction, sets=out)


def refuse_if_contaminated(ov: Overlap, *, where: str) -> None:
    """UsageError (exit 2) naming every set above the threshold."""
    bad = {k: s for k, s in ov.sets.items() if s.fraction > ov.max_fraction}
    if bad:
        detail = "; ".join(
            f"{k}: {s.overlapping}/{s.items} items ({s.fraction:.1%}), e.g. {s.examples[0]!r}"
            for k, s in bad.items()
        )
        raise UsageError(
            f"evaluation text overlaps the calibration text ({ov.n}-gram check, limit "
            f"{ov.max_fraction:.1%}): {detail}",
            path=where,
            hint="calibrate on other text (calibration.source), or remove the task; raising "
            "evaluation.max_overlap only hides the contamination",
        )
