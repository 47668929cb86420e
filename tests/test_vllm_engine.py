"""How the served check starts vLLM (pipeline/evaluate/engines.py, vllm_child.py): its KV
cache is sized for the check's own rows, so vLLM skips the free-memory profiler (which aborts
when another process on the GPU frees memory during the start) and asks only for the room
the check needs. vLLM itself needs a GPU; the child's arguments are tested here, and the
engine's call through a stand-in child that records what it was given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.evaluate import engines
from pipeline.evaluate.vllm_child import llm_kwargs

# Gemma 3 270M's text config (google/gemma-3-270m): 18 layers, 1 KV head of 256
GEMMA = {"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
         "head_dim": 256, "hidden_size": 640}  # fmt: skip
# Qwen2.5-0.5B: no head_dim, so hidden / heads = 64; 2 KV heads, 24 layers
QWEN = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "hidden_size": 896}  # fmt: skip
GIB = 1 << 30


def test_kv_bytes_cover_every_row_at_the_cache_dtype():
    per_token = 2 * 18 * 1 * 256 * 2  # K and V, every layer, bf16
    assert engines.kv_cache_bytes(GEMMA, "auto", 32, 513) == int(per_token * 32 * 513 * 1.1)
    # FP8 halves it; hidden / heads stands in for a missing head_dim
    assert engines.kv_cache_bytes(GEMMA, "fp8", 64, 513) == int(per_token // 2 * 64 * 513 * 1.1)
    assert engines.kv_cache_bytes(QWEN, "auto", 64, 32769) == int(
        2 * 24 * 2 * 64 * 2 * 64 * 32769 * 1.1
    )
    # a multimodal config nests the decoder's
    assert engines.kv_cache_bytes({"text_config": QWEN}, "auto", 8, 4096) == engines.kv_cache_bytes(
        QWEN, "auto", 8, 4096
    )


def test_kv_bytes_hold_at_most_64_sequences_and_never_less_than_the_floor():
    many = engines.kv_cache_bytes(QWEN, "auto", 10_000, 32769)
    assert many == engines.kv_cache_bytes(QWEN, "auto", engines.KV_MAX_SEQS, 32769)
    assert engines.kv_cache_bytes(GEMMA, "fp8", 1, 64) == engines.KV_FLOOR_BYTES


def test_child_asks_for_the_weights_the_cache_and_2_gib(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (3 * GIB // 1024))  # 3 MiB
    args = {"model": str(tmp_path), "kv_cache_dtype": "fp8", "served_topk": 256, "eager": False,
            "kv_cache_memory_bytes": 5 * GIB}  # fmt: skip
    kw = llm_kwargs(args, 513, 80 * GIB)
    assert kw["kv_cache_memory_bytes"] == 5 * GIB and kw["max_model_len"] == 513
    assert kw["gpu_memory_utilization"] == pytest.approx(
        (5 * GIB + 2 * GIB + 3 * GIB // 1024) / (80 * GIB), abs=1e-4
    )
    assert kw["max_logprobs"] == 256 and kw["kv_cache_dtype"] == "fp8"
    # a cache larger than the GPU asks for at most 95 %: vLLM's start then says what is free
    assert (
        llm_kwargs({**args, "kv_cache_memory_bytes": 200 * GIB}, 513, 80 * GIB)[
            "gpu_memory_utilization"
        ]
        == 0.95
    )


def test_the_engine_hands_the_child_the_cache_for_its_rows(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": GEMMA}))
    monkeypatch.setattr(engines, "unavailable", lambda name: None)
    seen: list[dict] = []

    def child(cmd, label):  # stands in for vllm_child.py: records its args, answers in kind
        work = Path(cmd[-1])
        args = json.loads((work / "args.json").read_text())
        seen.append(args)
        data = load_file(str(work / "in.safetensors"))
        gens = args.get("generate") or []
        if gens:  # each set's rows, cut n tokens short, continued by n
            out = {f"generated.{i}": torch.zeros(data[f"ids.{i}"].shape[0], n, dtype=torch.long)
                   for i, n in enumerate(gens)}  # fmt: skip
        else:
            rows = data["ids"].shape[0] * (data["ids"].shape[1] - 1)
            out = {"vals": torch.zeros(rows, 2, dtype=torch.float64),
                   "top1": torch.zeros(rows, dtype=torch.long)}  # fmt: skip
        save_file(out, str(work / "out.safetensors"))
        (work / "facts.json").write_text(json.dumps({"engine": "vllm 0.26.0", "missing": 0}))
        return 0, (
            Path(__file__).parent / "fixtures" / "vllm_bench" / "smollm2-w4a16-server.log"
        ).read_text()

    monkeypatch.setattr(engines.log, "run_child", child)
    eng = engines.VllmEngine(tmp_path, kv_cache_dtype="fp8")
    ids = torch.zeros(32, 513, dtype=torch.long)
    eng.logprobs_at(ids, torch.zeros(32 * 512, 2, dtype=torch.long))
    assert seen[-1]["kv_cache_memory_bytes"] == engines.kv_cache_bytes(GEMMA, "fp8", 32, 514)
    # every kernel vLLM logged and its speed warnings, in the check's facts (issue 57 item 2)
    assert json.loads(eng.facts["kernels_logged"]) == {
        "CompressedTensorsWNA16": ["MacheteLinearKernel", "MarlinLinearKernel"]
    }
    assert "performance may be degraded" in json.loads(eng.facts["performance_warnings"])[0]
    # the long-context check: every length in one start, the cache for the longest row
    sets = [
        (torch.zeros(8, 4096, dtype=torch.long), 6),
        (torch.zeros(8, 32768, dtype=torch.long), 6),
    ]
    got = eng.tail_top1_sets(sets)
    assert [g.shape for g in got] == [(8, 6), (8, 6)] and seen[-1]["generate"] == [6, 6]
    assert seen[-1]["kv_cache_memory_bytes"] == engines.kv_cache_bytes(GEMMA, "fp8", 8, 32768)


def test_inspect_counts_the_kv_cache_dtype_of_every_attention_layer():
    """A skipped layer serves 16-bit ('auto'), the others FP8: the facts say how many of
    each, and show the scales of the first FP8 layer, not of a skipped one."""
    from pipeline.evaluate.vllm_child import inspect

    class Attn(torch.nn.Module):
        def __init__(self, kv: str, k_scale: float):
            super().__init__()
            self.kv_cache_dtype, self.impl = kv, object()
            self._k_scale = torch.tensor(k_scale)

    model = torch.nn.ModuleList([Attn("auto", 1.0), Attn("fp8", 0.25), Attn("fp8", 0.5)])
    facts = inspect(model)
    assert facts["attention_kv_cache_dtypes"] == {"auto": 1, "fp8": 2}
    assert facts["attention"]["kv_cache_dtype"] == "fp8" and facts["attention"]["k_scale"] == 0.25
