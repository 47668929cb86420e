"""Write a random-weight checkpoint with Llama-3-8B dimensions (8.03 B params, bf16), or
with Qwen3-30B-A3B's layer dimensions (128 experts of 2048x768, 8 routed; `--moe`, the
first N of its 48 layers: 16 layers = 10.1 B params).

For the GPU quantize benchmark: its speed and memory depend on the shapes, not on the
values. Weights are initialised on the GPU when there is one (seconds instead of minutes
on the CPU). The tokenizer is the tiny test model's, with the vocabulary padded in the
config only (calibration ids stay below the tiny vocabulary).

    python bench/make_random_llama.py OUT_DIR [--moe LAYERS]
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TOKENIZER = Path(__file__).resolve().parent.parent / "tests/fixtures/models/tiny-llama"


def llama8b_config():
    """Llama-3-8B's dimensions (32 layers of 4096 hidden, 14336 MLP, 32/8 heads)."""
    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        tie_word_embeddings=False, torch_dtype="bfloat16",
    )  # fmt: skip


def moe_config(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        tie_word_embeddings=False, torch_dtype="bfloat16",
    )  # fmt: skip


def main(out: Path, moe_layers: int = 0) -> None:
    cfg = moe_config(moe_layers) if moe_layers else llama8b_config()
    t = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        if moe_layers:
            from transformers import Qwen3MoeForCausalLM

            model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
        else:
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, out / f)
    print(f"{n / 1e9:.2f} B params written to {out} in {time.time() - t:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[3]) if sys.argv[2:3] == ["--moe"] else 0)
