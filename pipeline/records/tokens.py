"""TokenSetInfo: the calibration and held-out token sets, as the records name them."""

from __future__ import annotations

from .base import Record


class TokenStats(Record):
    documents: int
    """Documents in the corpus."""
    heldout_documents: list[str]
    """Ids of the documents the held-out windows come from (none feeds calibration)."""
    calibration_documents: int
    """Documents calibration windows are drawn from."""
    calibration_documents_dropped: int = 0
    """Documents left out of calibration: they share a word 13-gram with a held-out one."""
    calibration_windows_available: int
    """Windows of calibration.seq_len tokens those documents give."""
    tokens_total: int
    """Tokens in the whole corpus."""
    calibration_mix: dict[str, int] = {}
    """calibration.mix: the calibration windows taken from each corpus (empty: one corpus)."""


class TokenSetInfo(Record):
    calib_shape: tuple[int, int]
    """[calibration.num_samples, calibration.seq_len]."""
    heldout_shape: tuple[int, int]
    """[evaluation.sequences, evaluation.seq_len]."""
    calib_hash: str
    """sha256 of the calibration token ids (shape + int64 bytes)."""
    heldout_hash: str
    """sha256 of the held-out token ids: every recipe evaluated on the same hash is
    comparable."""
    corpus_hash: str
    """sha256 over the corpus documents (id and text)."""
    source: str
    """The corpus actually used (a fallback from an unreachable Hub dataset says so)."""
    stats: TokenStats
    """How the corpus was split."""

    def summary(self) -> str:
        c, h = self.calib_shape, self.heldout_shape
        return f"calibration {c[0]}×{c[1]}, held-out {h[0]}×{h[1]} tokens ({self.source})"
