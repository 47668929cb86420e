"""The long-context retrieval check (recipe `serve.long_context`): a passkey hidden in long
natural text, asked for at the end, as the artifact is served -- the failure a 512-token KL
cannot see (vLLM's FP8-KV study saw a needle score fall from 91 % to 13 % on Hopper).

Each trial is exactly `length` tokens: the task header, corpus text with the needle ("The
pass key is 48213. Remember it. 48213 is the pass key.") at depth (i + 0.5) / trials, the
question, and the passkey's own tokens last. A model retrieves it when its greedy choice
at each of those last positions is the passkey's token: the transformers engine reads the
top-1 there in one forward (teacher-forced), vLLM generates them greedily from the prompt
before them -- the same verdict, since greedy reproduces a sequence exactly when every
teacher-forced top-1 matches it.

The reference and the artifact run through the same engine; the artifact twice when it has
a quantized KV cache (as served, and with a 16-bit one), so a drop can be put on the KV
cache or on the weights.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from .. import log
from ..errors import StageError, UsageError
from ..recipe import LongContext
from ..records.served import LongContextCheck, LongContextRow

HEADER = ("There is an important piece of information hidden inside a lot of irrelevant text. "
          "Find it and memorize it; you will be asked for it.\n\n")  # fmt: skip
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER = " {key}"
FIELD = "serve.long_context.lengths"


class TailEngine(Protocol):
    name: str
    facts: dict[str, str]

    def tail_top1_sets(self, sets: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """Per set (ids [N, T], n): [N, n], the greedy token at each of the last n positions
        of each row (predicted from the tokens before it); every set in one engine start."""
        ...


@dataclass(frozen=True)
class Trials:
    ids: torch.Tensor
    """[trials, length] token ids, the passkey's tokens last."""
    answer_len: int
    """Tokens of the passkey at the end of every row."""
    keys: list[str]


def resolve_lengths(cfg: LongContext, max_positions: int | None) -> list[int]:
    """The lengths in tokens ("max": the model's context); exit 2 for one beyond it."""
    out = []
    for x in cfg.lengths:
        if x == "max":
            if not max_positions:
                raise UsageError("the model's config names no max_position_embeddings, so "
                                 "'max' has no length", path=FIELD, hint="list lengths in tokens")  # fmt: skip
            x = max_positions
        assert isinstance(x, int)
        if max_positions and x > max_positions:
            raise UsageError(
                f"a {x}-token trial is longer than the model's context ({max_positions} tokens)",
                path=FIELD,
                hint=f"list lengths up to {max_positions}, or 'max' for the model's longest",
            )
        out.append(x)
    return sorted(set(out))


def filler_ids(tokenizer: Any, texts: list[str]) -> list[int]:
    """The corpus as one token stream, its documents in a fixed order (by hash)."""
    docs = sorted(texts, key=lambda t: hashlib.sha256(t.encode()).hexdigest())
    ids = tokenizer("\n\n".join(docs), add_special_tokens=False)["input_ids"]
    if len(ids) < 1000:
        raise UsageError(f"the corpus holds {len(ids)} tokens: too little text to hide a "
                         "needle in", path="calibration.source", hint="use a larger corpus")  # fmt: skip
    return list(ids)


def build(tokenizer: Any, filler: list[int], length: int, trials: int, seed: int = 0) -> Trials:
    """`trials` rows of exactly `length` tokens (see the module docstring)."""

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    specials = list(tokenizer("", add_special_tokens=True)["input_ids"])  # BOS, if any
    header, question = enc(HEADER), enc(QUESTION)
    rng = random.Random(f"{seed}/{length}")
    rows, keys, n_ans = [], [], None
    for i in range(trials):
        for _ in range(100):  # a key whose tokens have the common count (BPE digit groups)
            key = str(rng.randrange(10_000, 100_000))
            ans = enc(ANSWER.format(key=key))
            if n_ans is None or len(ans) == n_ans:
                break
        n_ans = len(ans)
        needle = enc(NEEDLE.format(key=key))
        if not _contains(needle, ans):
            raise StageError(f"the tokenizer splits the passkey {key} differently in the needle "
                             "and in the answer: it cannot be copied token by token",
                             hint="report this tokenizer; the check cannot score it")  # fmt: skip
        fixed = specials + header + needle + question + ans
        room = length - len(fixed)
        if room < 16:
            raise UsageError(
                f"a {length}-token trial leaves {room} tokens of text around the needle "
                f"(header, needle, question and passkey take {len(fixed)})",
                path=FIELD,
                hint=f"list lengths of at least {len(fixed) + 16} tokens",
            )
        start = rng.randrange(len(filler))
        text = (filler[start:] + filler * (1 + room // len(filler)))[:room]
        at = int(room * (i + 0.5) / trials)
        row = specials + header + text[:at] + needle + text[at:] + question + ans
        assert len(row) == length, (len(row), length)
        rows.append(row)
        keys.append(key)
    return Trials(ids=torch.tensor(rows, dtype=torch.long), answer_len=int(n_ans or 0), keys=keys)


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def retrieved(engine: TailEngine, sets: list[Trials]) -> list[list[bool]]:
    """Per set, per trial: the passkey came back exactly."""
    got = engine.tail_top1_sets([(t.ids, t.answer_len) for t in sets])
    out = []
    for g, t in zip(got, sets, strict=True):
        want = t.ids[:, -t.answer_len :]
        out.append([bool(x) for x in (g.to(want.device) == want).all(dim=1).tolist()])
    return out


def run(
    make_engine: Any, artifact: Path, reference: Path, cfg: LongContext, *,
    kv_cache_dtype: str, has_kv_scheme: bool, tokenizer: Any, texts: list[str],
    max_positions: int | None,
) -> LongContextCheck:  # fmt: skip
    """The check: `make_engine(folder, kv_cache_dtype)` -> a TailEngine (vllm or
    transformers); the reference once, the artifact as served and, when it has a quantized
    KV cache, with a 16-bit one."""
    t0 = time.perf_counter()
    lengths = resolve_lengths(cfg, max_positions)
    filler = filler_ids(tokenizer, texts)
    sets = {n: build(tokenizer, filler, n, cfg.trials, cfg.seed) for n in lengths}
    runs = [("reference", reference, "bfloat16"), ("served", artifact, kv_cache_dtype)]
    if has_kv_scheme and kv_cache_dtype != "bfloat16":
        runs.append(("served_16bit", artifact, "bfloat16"))
    rates: dict[str, dict[int, float]] = {}
    engine_name = ""
    with (
        log.heartbeat("long-context check"),
        log.Progress("long-context check", total=len(runs), unit="models") as bar,
    ):
        for label, folder, kv in runs:
            eng = make_engine(folder, kv)
            rates[label] = {}
            for n, ok in zip(sets, retrieved(eng, list(sets.values())), strict=True):
                rates[label][n] = sum(ok) / len(ok)
                log.detail(f"long context: {label} retrieved {sum(ok)}/{len(ok)} at {n} tokens")
            bar.advance(1)
            engine_name = eng.name
            del eng
    rows = [
        LongContextRow(
            length=n,
            trials=cfg.trials,
            reference=rates["reference"][n],
            served=rates["served"][n],
            served_16bit=rates.get("served_16bit", {}).get(n),
            drop=rates["reference"][n] - rates["served"][n],
        )  # fmt: skip
        for n in lengths
    ]
    failures = [
        f"{r.length} tokens: retrieved {r.served:.0%} vs the reference's {r.reference:.0%} "
        f"(drop {r.drop:.3f} > {cfg.max_drop})"
        + (f"; with a 16-bit KV cache {r.served_16bit:.0%}" if r.served_16bit is not None else "")
        for r in rows
        if r.drop > cfg.max_drop
    ]
    return LongContextCheck(engine=engine_name, kv_cache_dtype=kv_cache_dtype, rows=rows,
                            max_drop=cfg.max_drop, passed=not failures, failures=failures,
                            seconds=round(time.perf_counter() - t0, 1))  # fmt: skip


def check_artifact(
    artifact: Path, reference: Path, sg: Any, source: str, *, device: str | None = None,
    attention: str = "kv-only",
) -> LongContextCheck:  # fmt: skip
    """`run` for a quantized folder and its reference with a recipe's `serve:` section (its
    engine, KV-cache dtype and long_context) and the text of its corpus `source` around the
    needle."""
    from transformers import AutoTokenizer

    from ..data.corpus import load_corpus
    from ..model.checkpoint import text_config
    from ..model.files import read_config_json
    from . import engines

    assert sg.long_context is not None
    cfg = read_config_json(Path(artifact))
    qc = cfg.get("quantization_config") or {}
    mp = text_config(cfg).get("max_position_embeddings")
    ds, _ = load_corpus(source)

    def make(folder: Path, kv: str) -> Any:
        opts = {"served_topk": 1} if sg.engine == "vllm" else {}
        return engines.make(sg.engine, Path(folder), kv_cache_dtype=kv, device=device,
                            attention=attention, **opts)  # fmt: skip

    return run(make, Path(artifact), Path(reference), sg.long_context,
               kv_cache_dtype=sg.kv_cache_dtype, has_kv_scheme=bool(qc.get("kv_cache_scheme")),
               tokenizer=AutoTokenizer.from_pretrained(str(artifact)), texts=list(ds["text"]),
               max_positions=mp if isinstance(mp, int) else None)  # fmt: skip
