"""Another round-to-nearest of the same weights: a copy of an artifact whose symmetric int4 MLP
weights (same scales) take the other neighbouring level wherever the source weight lies within
`near` of the midpoint between two levels, SHA256SUMS re-summed. About as close to the source
(the same quality), serving other numbers than evaluate measured: the served check must fail
it (issue 57 item 1; tests/test_served.py and the GPU session bench/device/served_gate_session.sh).

    python -m bench.reround ARTIFACT SOURCE_FOLDER DEST [--near 0.03]
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path

from pipeline.io.hashing import format_sha256sums, sha256_file


def _rehash_model(art: Path) -> None:
    """provenance's quantized_model_hash re-recorded for the changed weights."""
    import json

    from pipeline.io.hashing import hash_files, list_files
    from pipeline.model.files import model_hash

    prov = json.loads((art / "provenance.json").read_text())
    prov["quantized_model_hash"] = model_hash(hash_files(art, list_files(art)))
    (art / "provenance.json").write_text(json.dumps(prov, indent=2, sort_keys=True) + "\n")


def _sums(art: Path) -> None:
    """SHA256SUMS rewritten to match the files (a signature, the BOM's and the statements'
    hashes left stale: pass tests/factories.resum as `resum` to restate those too)."""
    rels = sorted(
        p.relative_to(art).as_posix()
        for p in art.rglob("*")
        if p.is_file() and not p.is_symlink() and p.name not in ("SHA256SUMS", "model.sig")
    )
    (art / "SHA256SUMS").write_text(
        format_sha256sums({r: sha256_file(art / r).sha256 for r in rels})
    )


def rerounded(art: Path, source: Path, dest: Path, near: float = 0.03,
              resum: Callable[[Path], None] | None = None) -> Path:  # fmt: skip
    import torch
    from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32
    from safetensors.torch import load_file, save_file

    bad = Path(shutil.copytree(art, dest))
    files = sorted(p.name for p in bad.glob("*.safetensors"))
    src: dict[str, torch.Tensor] = {}
    for f in sorted(source.glob("*.safetensors")):
        src.update(load_file(str(f)))
    for f in files:
        w = load_file(str(bad / f))
        for name in [k.removesuffix(".weight_packed") for k in w
                     if k.endswith(".weight_packed") and ".mlp." in k]:  # fmt: skip
            shape = torch.Size(w[f"{name}.weight_shape"].tolist())
            q = unpack_from_int32(w[f"{name}.weight_packed"], 4, shape).float()
            scale = w[f"{name}.weight_scale"].float()
            x = src[f"{name}.weight"].float() / scale.repeat_interleave(
                shape[1] // scale.shape[1], 1
            )
            low = x.floor()
            other = 2 * low + 1 - q  # floor <-> floor + 1
            flip = ((x - low - 0.5).abs() < near) & ((q == low) | (q == low + 1)) \
                & (other >= -8) & (other <= 7)  # fmt: skip
            w[f"{name}.weight_packed"] = pack_to_int32(
                torch.where(flip, other, q).to(torch.int8), 4
            )
        save_file(w, str(bad / f), metadata={"format": "pt"})
    _rehash_model(bad)
    (resum or _sums)(bad)
    return bad


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("source", type=Path)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--near", type=float, default=0.03)
    a = ap.parse_args()
    print(rerounded(a.artifact, a.source, a.dest, a.near))
