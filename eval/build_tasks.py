"""Build the offline lm-eval task data in eval/tasks/data/ from real text on PyPI.

Source: gensim's Lee news corpus `test/test_data/lee.cor` (50 Australian news articles,
Lee et al. 2005; shipped in the gensim wheel pinned in pyproject.toml). lee.cor is the
50-document "test" half of the corpus; the tiny test models were trained on the other
half (lee_background.cor) only.

    qship_news_ppl  (loglikelihood_rolling)  news_ppl.jsonl: {"text"} one article per line
    qship_lastword  (loglikelihood, acc)     lastword.jsonl: {"context", "target"}: every
                    sentence of >= 8 words ending in an alphabetic word of >= 3 letters;
                    context = the article up to that word (at most the last 80 words),
                    target = " " + the word. acc = the word is the model's greedy
                    continuation (as in LAMBADA).

Deterministic: same gensim file -> byte-identical JSONL. Run:
    .venv/bin/python eval/build_tasks.py
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "tasks" / "data"
CONTEXT_WORDS = 80


def lee_path() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or spec.origin is None:
        sys.exit("gensim is not installed (it is pinned in pyproject.toml)")
    return Path(spec.origin).parent / "test" / "test_data" / "lee.cor"


def articles(path: Path) -> list[str]:
    text = path.read_bytes().decode("latin-1")  # one pound sign in the file
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def lastword_items(docs: list[str]) -> list[dict]:
    items = []
    for doc in docs:
        # sentence ends: '.', '!' or '?' followed by a space + capital, or end of text
        for m in re.finditer(r"[.!?](?=\s+[A-Z\"']|\s*$)", doc):
            before = doc[: m.start()]
            sent_start = max(before.rfind(". "), before.rfind("? "), before.rfind("! "))
            sentence = before[sent_start + 1 :].split()
            if len(sentence) < 8:
                continue
            word = sentence[-1]
            if not re.fullmatch(r"[A-Za-z]{3,}", word):
                continue
            ctx_words = before.split()[:-1][-CONTEXT_WORDS:]
            items.append({"context": " ".join(ctx_words), "target": " " + word})
    return items


def write_jsonl(path: Path, rows: list[dict]) -> str:
    data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
    path.write_text(data, encoding="utf-8")
    return hashlib.sha256(data.encode()).hexdigest()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    docs = articles(lee_path())
    h1 = write_jsonl(OUT / "news_ppl.jsonl", [{"text": d} for d in docs])
    items = lastword_items(docs)
    h2 = write_jsonl(OUT / "lastword.jsonl", items)
    print(f"news_ppl.jsonl: {len(docs)} articles, sha256 {h1}")
    print(f"lastword.jsonl: {len(items)} items, sha256 {h2}")


if __name__ == "__main__":
    main()
