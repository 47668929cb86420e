"""A correct Hugging Face tokenizer for SentencePiece-BPE GGUFs (Gemma), built from the
GGUF's own tokenizer metadata.

Why: transformers 5.17 (the newest llm-compressor 0.14 allows) converts Gemma 3's GGUF
tokenizer wrongly — no BOS, pieces split oddly, and after save/reload a Unigram model
that splits text into characters ("The capital of France is" -> 10 pieces, no BOS). The GGUF carries everything needed:
`tokenizer.ggml.tokens`, `scores` (SentencePiece merge priorities), `token_type`
(1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte) and the special ids.
We build the same pipeline as Gemma's published tokenizer.json: spaces -> '▁', no
pre-tokenizer, BPE with merges ranked by score and byte fallback, '<bos>' prepended.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import generate_merges

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def supports(reader) -> bool:
    """SentencePiece vocabularies with scores ('llama' in GGUF terms) are handled here."""
    return (
        _field(reader, "tokenizer.ggml.model") == "llama"
        and "tokenizer.ggml.scores" in reader.fields
    )


def build_tokenizer(reader) -> PreTrainedTokenizerFast:
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    scores: list[float] = _field(reader, "tokenizer.ggml.scores")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    ids = {
        name: _field(reader, f"tokenizer.ggml.{name}_token_id")
        for name in ("bos", "eos", "unknown", "padding")
    }
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", True))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))

    vocab = {t: i for i, t in enumerate(tokens)}
    special = {
        t for t, ty in zip(tokens, types, strict=True) if ty in (CONTROL, USER_DEFINED, UNUSED)
    }
    # merges only between ordinary pieces, highest score first (SentencePiece BPE order)
    mergeable = [(t, s) for t, s, ty in zip(tokens, scores, types, strict=True) if ty == NORMAL]
    merges = generate_merges(vocab, mergeable, skip_tokens=special)

    unk = tokens[ids["unknown"]] if ids["unknown"] is not None else None
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    bos = tokens[ids["bos"]] if ids["bos"] is not None else None
    eos = tokens[ids["eos"]] if ids["eos"] is not None else None
    single = (
        ([f"{bos}:0"] if add_bos and bos else [])
        + ["$A:0"]
        + ([f"{eos}:0"] if add_eos and eos else [])
    )
    pair = (
        single
        + (["$B:1"] if not add_bos else [f"{bos}:1", "$B:1"])
        + ([f"{eos}:1"] if add_eos and eos else [])
    )
    special_pairs = [(t, vocab[t]) for t in {bos, eos} if t]
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special_pairs
    )

    # control/user-defined pieces (<start_of_turn>, <image_soft_token> ...) are atomic
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == USER_DEFINED
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=tokens[ids["padding"]] if ids["padding"] is not None else None,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(reader, out_dir: Path) -> None:
    build_tokenizer(reader).save_pretrained(out_dir)
