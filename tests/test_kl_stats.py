"""KL statistics against a direct float64 computation (numpy, no chunking)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.evaluate import kl_stats


def _direct(ref: np.ndarray, cand: np.ndarray, nxt: np.ndarray) -> dict:
    def logsoftmax(x):
        x = x.astype(np.float64)
        m = x.max(-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))

    lr, lc = logsoftmax(ref), logsoftmax(cand)
    kl = (np.exp(lr) * (lr - lc)).sum(-1)
    rows = np.arange(len(nxt))
    return {
        "kl": kl,
        "top1": lr.argmax(-1) == lc.argmax(-1),
        "nll_ref": -lr[rows, nxt],
        "nll_cand": -lc[rows, nxt],
        "dp": np.exp(lc[rows, nxt]) - np.exp(lr[rows, nxt]),
    }


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    n, v = 300, 97
    ref = torch.randn(n, v, generator=g) * 3
    cand = ref + 0.3 * torch.randn(n, v, generator=g)
    nxt = torch.randint(0, v, (n,), generator=g)
    return ref, cand, nxt


def test_exact_matches_direct_float64(logits):
    ref, cand, nxt = logits
    got = kl_stats.exact_token_stats(ref, cand, nxt, chunk=37)  # odd chunk: boundaries
    want = _direct(ref.numpy(), cand.numpy(), nxt.numpy())
    for k in ("kl", "nll_ref", "nll_cand", "dp"):
        np.testing.assert_allclose(got[k].numpy(), want[k], rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(got["top1"].numpy(), want["top1"])


def test_summary_matches_direct(logits):
    ref, cand, nxt = logits
    acc = kl_stats.Accumulator()
    for s in range(0, len(nxt), 100):  # three "batches"
        acc.add(kl_stats.exact_token_stats(ref[s : s + 100], cand[s : s + 100], nxt[s : s + 100]))
    got = acc.summary()
    w = _direct(ref.numpy(), cand.numpy(), nxt.numpy())
    kl = w["kl"]
    assert got["tokens"] == len(kl)
    assert got["kl"]["mean"] == pytest.approx(kl.mean(), rel=1e-12)
    assert got["kl"]["stderr"] == pytest.approx(kl.std(ddof=1) / math.sqrt(len(kl)), rel=1e-10)
    for name, q in (("median", 50), ("p90", 90), ("p99", 99), ("p999", 99.9)):
        assert got["kl"][name] == pytest.approx(np.percentile(kl, q), rel=1e-12)
    assert got["kl"]["max"] == pytest.approx(kl.max(), rel=1e-12)
    assert got["top1_agreement"] == pytest.approx(w["top1"].mean())
    assert got["ppl_reference"] == pytest.approx(math.exp(w["nll_ref"].mean()), rel=1e-12)
    assert got["ppl_candidate"] == pytest.approx(math.exp(w["nll_cand"].mean()), rel=1e-12)
    assert got["ppl_ratio"] == pytest.approx(
        math.exp(w["nll_cand"].mean() - w["nll_ref"].mean()), rel=1e-12
    )
    assert got["rms_dp"] == pytest.approx(math.sqrt((w["dp"] ** 2).mean()), rel=1e-12)


def test_self_comparison_is_zero(logits):
    ref, _, nxt = logits
    s = kl_stats.summarise(**kl_stats.exact_token_stats(ref, ref.clone(), nxt))
    assert s["kl"]["max"] == 0.0 and s["top1_agreement"] == 1.0
    assert s["ppl_ratio"] == 1.0 and s["rms_dp"] == 0.0


def test_topk_tail_is_a_lower_bound_and_exact_with_full_k(logits):
    ref, cand, nxt = logits
    exact = kl_stats.exact_token_stats(ref, cand, nxt)["kl"]
    for k in (1, 8, 32):
        stored = kl_stats.reference_topk(ref, nxt, k, chunk=50)
        approx = kl_stats.kl_topk_tail(stored, cand, nxt, chunk=50)
        assert (approx["kl"] <= exact + 1e-12).all()  # log-sum inequality
        # everything but KL is exact in the truncated mode
        full = kl_stats.exact_token_stats(ref, cand, nxt)
        for key in ("nll_ref", "nll_cand", "dp"):
            torch.testing.assert_close(approx[key], full[key], rtol=1e-6, atol=1e-7)
        assert torch.equal(approx["top1"], full["top1"])
    stored = kl_stats.reference_topk(ref, nxt, ref.shape[-1])
    approx = kl_stats.kl_topk_tail(stored, cand, nxt)
    # float32 storage of the reference log-probs limits agreement to ~1e-6 relative
    torch.testing.assert_close(approx["kl"], exact, rtol=1e-5, atol=1e-6)
    # the error shrinks as k grows
    errs = [
        (
            exact - kl_stats.kl_topk_tail(kl_stats.reference_topk(ref, nxt, k), cand, nxt)["kl"]
        ).mean()
        for k in (4, 16, 64)
    ]
    assert errs[0] > errs[1] > errs[2] >= -1e-9


def test_tail_mass_is_accurate_when_tiny():
    # reference nearly one-hot: tail mass ~ 1e-20 must not be lost to 1 - x cancellation
    ref = torch.full((1, 10), -50.0, dtype=torch.float64)
    ref[0, 0] = 0.0
    stored = kl_stats.reference_topk(ref, torch.tensor([0]), 1)
    want = math.log(9) - 50.0  # log(9 e^-50 / (1 + 9 e^-50))
    assert stored["tail_logp"].item() == pytest.approx(want, rel=1e-9)


def test_fused_form_matches_direct_float64(logits):
    """The fused reduction form (for a compiled GPU path) gives the same figures; the bf16
    logits qship feeds it are upcast inside."""
    ref, cand, nxt = logits
    got = kl_stats.exact_token_stats_fused(ref, cand, nxt, chunk=37)
    want = _direct(ref.numpy(), cand.numpy(), nxt.numpy())
    for k in ("kl", "nll_ref", "nll_cand", "dp"):
        np.testing.assert_allclose(got[k].numpy(), want[k], rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(got["top1"].numpy(), want["top1"])
    rb, cb = ref.bfloat16(), cand.bfloat16()
    a = kl_stats.exact_token_stats_fused(rb, cb, nxt)
    b = kl_stats.exact_token_stats(rb, cb, nxt)
    np.testing.assert_allclose(a["kl"].numpy(), b["kl"].numpy(), rtol=1e-9, atol=1e-12)
