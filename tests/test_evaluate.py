"""evaluate(): self-comparison, reference-cache re-use, KV on/off, cached vs exact, gate exit 4.

Candidates are made here with llm-compressor directly (session fixtures, a few seconds
each on one thread): tiny-gemma3 W4A16 + FP8 KV cache, and tiny-llama 2-bit RTN
(deliberately damaged). Held-out ids come from gensim's lee.cor, which the tiny models
never saw in training.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import pipeline.evaluate.engine as ev
from pipeline.evaluate import model_ref, scoring

SEQ_LEN = 128


def _lee(name: str) -> str:
    spec = importlib.util.find_spec("gensim")
    return (Path(spec.origin).parent / "test" / "test_data" / name).read_bytes().decode("latin-1")


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def heldout(tiny_gemma) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_gemma))
    ids = tok(_lee("lee.cor"), add_special_tokens=False)["input_ids"]
    n = 6
    t = torch.tensor(ids[: n * SEQ_LEN]).view(n, SEQ_LEN)
    return t


def _quantize(src: Path, out: Path, modifier) -> Path:
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    ids = tok(_lee("lee_background.cor")[:60000], add_special_tokens=False)["input_ids"]
    t = torch.tensor(ids[: 16 * 128]).view(16, 128)
    ds = Dataset.from_dict({"input_ids": t.tolist(), "attention_mask": torch.ones_like(t).tolist()})
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    oneshot(
        model=model,
        tokenizer=tok,
        dataset=ds,
        recipe=[modifier],
        num_calibration_samples=16,
        max_seq_length=128,
        batch_size=16,
    )
    model.save_pretrained(str(out), save_compressed=True)
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def gemma_w4_kv(tmp_path_factory, tiny_gemma) -> Path:
    """tiny-gemma3, W4A16 RTN + FP8 e4m3 per-tensor static KV cache."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    mod = QuantizationModifier(
        targets="Linear",
        ignore=["lm_head"],
        scheme="W4A16",
        kv_cache_scheme={
            "num_bits": 8,
            "type": "float",
            "strategy": "tensor",
            "dynamic": False,
            "symmetric": True,
        },
    )
    return _quantize(tiny_gemma, tmp_path_factory.mktemp("cand") / "gemma-w4-kv", mod)


@pytest.fixture(scope="session")
def llama_2bit(tmp_path_factory, tiny_llama) -> Path:
    """tiny-llama, 2-bit symmetric RTN, group 32: a deliberately damaged model."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    mod = QuantizationModifier(
        ignore=["lm_head"],
        config_groups={
            "g": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 2,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                },
            }
        },
    )
    return _quantize(tiny_llama, tmp_path_factory.mktemp("cand") / "llama-2bit", mod)


def _run(ref, cand, heldout, cache, **kw):
    from pipeline.records.evaluation import EvalOptions

    data = {k: kw.pop(k) for k in ("data_dir", "overlap", "corpus", "measured_path") if k in kw}
    return ev.evaluate(model_ref(ref), model_ref(cand), heldout_ids=heldout, cache_dir=cache,
                       options=EvalOptions(device="cpu", **kw), **data)  # fmt: skip


def test_self_comparison(tiny_llama, heldout, tmp_path):
    exact = _run(tiny_llama, tiny_llama, heldout, tmp_path, exact=True).metrics
    assert exact.kl.max == 0.0 and exact.kl.mean == 0.0
    assert exact.top1_agreement == 1.0 and exact.ppl_ratio == 1.0 and exact.rms_dp == 0.0
    cached = _run(tiny_llama, tiny_llama, heldout, tmp_path).metrics
    # reference top-k log-probs are stored as float32: KL 0 up to that rounding
    assert cached.kl.max < 1e-6
    assert cached.top1_agreement == 1.0 and cached.ppl_ratio == pytest.approx(1.0, abs=1e-12)
    assert cached.tokens == heldout.shape[0] * (SEQ_LEN - 1)


def test_reference_cache_is_reused(tiny_llama, llama_2bit, heldout, tmp_path, monkeypatch):
    loaded: list[str] = []
    real = ev.load_model

    def spy(path, **kw):
        loaded.append(Path(path).name)
        return real(path, **kw)

    monkeypatch.setattr(ev, "load_model", spy)
    first = _run(tiny_llama, llama_2bit, heldout, tmp_path)
    assert loaded == ["tiny-llama", "llama-2bit"] and first.reference_cache.hit is False
    loaded.clear()
    second = _run(tiny_llama, llama_2bit, heldout, tmp_path)
    assert loaded == ["llama-2bit"], "second evaluation must run no reference forward"
    assert second.reference_cache.hit is True
    assert second.reference_cache.key == first.reference_cache.key
    assert second.metrics == first.metrics
    # where the candidate pass spends its time: forwards, KL arithmetic, within its total
    t = second.timings
    assert t["candidate_forward_s"] > 0 and t["candidate_kl_s"] >= 0
    # each figure is stored rounded to the millisecond
    assert t["candidate_forward_s"] + t["candidate_kl_s"] <= t["candidate_s"] + 0.002
    # a different held-out set is a different entry
    loaded.clear()
    _run(tiny_llama, llama_2bit, heldout[:3], tmp_path)
    assert loaded[0] == "tiny-llama"


def test_kv_quantization_on_off_changes_logits(gemma_w4_kv, heldout):
    model = ev.load_model(gemma_w4_kv, device="cpu")
    assert len(scoring.kv_modules(model)) == 4  # every attention layer is hooked
    batch = heldout[:2]
    with scoring.kv_quantization(model, True):
        on, _ = scoring.forward_logits(model, batch)
    with scoring.kv_quantization(model, False) as n:
        off, _ = scoring.forward_logits(model, batch)
    assert n == 4
    with scoring.kv_quantization(model, True):
        again, _ = scoring.forward_logits(model, batch)
    assert not torch.equal(on, off)
    assert torch.equal(on, again)  # the switch is restored and deterministic


def test_kv_share_and_cached_vs_exact(tiny_gemma, gemma_w4_kv, heldout, tmp_path):
    exact = _run(tiny_gemma, gemma_w4_kv, heldout, tmp_path, exact=True).to_json()
    e = exact["metrics"]
    gaps = {}
    for k in (128, 1024):
        cached = _run(tiny_gemma, gemma_w4_kv, heldout, tmp_path, topk=k).to_json()
        for r in (cached, exact):
            assert r["candidate"]["kv_cache_scheme"]["num_bits"] == 8
            assert r["metrics_weights_only"] is not None
            assert r["metrics"]["kl"]["mean"] != r["metrics_weights_only"]["kl"]["mean"]
            assert "kv_cache_share" in r
        c = cached["metrics"]
        assert c["kl"]["mean"] <= e["kl"]["mean"] * (1 + 1e-6)  # top-k + tail: a lower bound
        gaps[k] = (e["kl"]["mean"] - c["kl"]["mean"]) / e["kl"]["mean"]
        # everything except KL is exact in cached mode
        for key in ("top1_agreement", "ppl_reference", "ppl_candidate", "ppl_ratio", "rms_dp"):
            assert c[key] == pytest.approx(e[key], rel=1e-6), key
    # this tiny model's distributions are flat (ppl ~100s over a 2048 vocab), so the tail
    # holds much mass at k=128; with half the vocabulary stored the bound is within 1 %
    assert gaps[1024] < 0.01 and gaps[1024] <= gaps[128]
    print(
        f"\nexact KL {e['kl']['mean']:.6g}; cached relative gap k=128 {gaps[128]:.2%}, "
        f"k=1024 {gaps[1024]:.3%}; KV off (exact) {exact['metrics_weights_only']['kl']['mean']:.6g}"
    )


def test_damaged_candidate_fails_gate_exit_4(tiny_llama, llama_2bit, heldout, tmp_path, capsys):
    """The CLI on a damaged candidate: exit 4, one JSON object holding the error and the
    result, eval.json and eval.md written with the failed verdict."""
    from cli_run import qship

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: t\ngroups:\n  - {name: all, targets: [Linear], method: rtn, scheme: {bits: 4}}\n"
        "calibration: {source: builtin:english, num_samples: 4, seq_len: 64, batch_size: 4}\n"
        "evaluation: {sequences: 3, seq_len: 64, batch_size: 3}\n"
        "gates: {kl_mean_max: 0.05, kl_p99_max: 0.5, top1_min: 0.9, ppl_ratio_max: 1.1}\n"
    )
    out = tmp_path / "out"
    rc, data = qship(capsys, "evaluate", "--reference", str(tiny_llama), "--candidate",
                     str(llama_2bit), "--recipe", str(recipe), "--out", str(out),
                     "--cache-dir", str(tmp_path / "c"), "--device", "cpu")  # fmt: skip
    assert rc == 4 and data["exit_code"] == 4 and data["error"] == "GateFailed"
    gates = ["kl_mean_max", "kl_p99_max", "top1_min", "ppl_ratio_max"]
    for name in gates:
        assert name in data["message"]
    assert data["result"]["verdict"]["failed"] == gates
    saved = json.loads((out / "eval.json").read_text())  # written even on failure
    assert saved == data["result"] and saved["metrics"]["kl"]["mean"] > 0.05
    md = (out / "eval.md").read_text()
    assert "Gate: FAILED" in md and "kl_p99_max" in md


def test_cli_evaluate_dtype_and_topk_reach_the_evaluation(tiny_llama, llama_2bit, tmp_path, capsys):
    """--dtype float32 / --topk 16 are what eval.json records; a bad --dtype is exit 2."""
    from cli_run import qship

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: t\ngroups:\n  - {name: all, targets: [Linear], method: rtn, scheme: {bits: 4}}\n"
        "calibration: {source: builtin:english, num_samples: 4, seq_len: 64, batch_size: 4}\n"
        "evaluation: {sequences: 3, seq_len: 64, batch_size: 3}\n"
        "gates: {kl_mean_max: 10.0}\n"
    )
    args = ["evaluate", "--reference", str(tiny_llama), "--candidate", str(llama_2bit),
            "--recipe", str(recipe), "--cache-dir", str(tmp_path / "c"), "--device", "cpu"]  # fmt: skip
    rc, data = qship(
        capsys, *args, "--out", str(tmp_path / "o"), "--dtype", "float32", "--topk", "16"
    )
    assert rc == 0, data
    assert data["settings"]["dtype"] == "float32" and data["settings"]["topk"] == 16
    assert data["metrics"]["kl_mode"] == "cached-top16+tail"
    rc, err = qship(capsys, *args, "--out", str(tmp_path / "o2"), "--dtype", "fp8")
    assert rc == 2 and "--dtype" in err["message"]
    assert not (tmp_path / "o2").exists()
