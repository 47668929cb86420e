"""A tiny llama GGUF (f16, SentencePiece vocab) written with the gguf library: the
local-GGUF fetch tests' input (imported by tests, like cli_run)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FF, CTX = 32, 2, 4, 2, 64, 128
WORDS = "the capital of france is paris and a small model reads text".split()


def tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, 256 byte pieces, single characters, then merged pieces with
    SentencePiece scores (higher = merged first) — what llama.cpp writes for 'llama'."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    chars = sorted(set("".join(WORDS)) | {"▁"})
    pieces = []
    for w in WORDS:
        w = "▁" + w
        for i in range(2, len(w) + 1):
            if w[:i] not in pieces:
                pieces.append(w[:i])
    tokens += chars + pieces
    types += [1] * (len(chars) + len(pieces))
    scores = [0.0] * (3 + 256) + [-1000.0 - i for i in range(len(chars))]
    scores += [-float(len(p)) - i * 1e-3 for i, p in enumerate(pieces)]
    return tokens, scores, types


def write_tiny_llama_gguf(path: Path, seed: int = 0, *, states_vocab: bool = True) -> Path:
    """`states_vocab` False: no `llama.vocab_size` key, as in Gemma 3 270M's GGUF (the config
    takes the token count)."""
    import gguf

    tokens, scores, types = tiny_vocab()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("qship-tiny-llama")
    w.add_context_length(CTX)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if states_vocab:
        w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16)

    def norm():
        return (1.0 + 0.01 * rng.standard_normal(HIDDEN)).astype(np.float32)

    kv = HIDDEN // HEADS * KV_HEADS
    w.add_tensor("token_embd.weight", mat(vocab, HIDDEN))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(HIDDEN, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(kv, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(kv, HIDDEN))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(HIDDEN, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(FF, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(FF, HIDDEN))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(HIDDEN, FF))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", mat(vocab, HIDDEN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
