"""The artifact's weights: the checkpoint's tensors re-laid out at the byte level (no dtype
conversion), sorted by name, canonical header, metadata {"format": "pt"}, sharded in name
order above `shard_size` data bytes. The same tensors give the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import IntegrityError, UsageError
from ..io.safetensors_header import Header, header_bytes, layout, read_header, shard_plan

DEFAULT_SHARD_SIZE = 5 * 1000**3  # 5 GB of tensor data per shard, like transformers
INDEX = "model.safetensors.index.json"
ST_METADATA = {"format": "pt"}
_COPY_CHUNK = 8 * 1024 * 1024


def source_weights(model_dir: Path) -> dict[str, Header]:
    """The checkpoint's safetensors headers (pickle files and symlinks out refused)."""
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise IntegrityError(
            f"pickle weight files {pickles} in the checkpoint; only safetensors are packaged",
            path=str(model_dir / pickles[0]),
        )
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if not files:
        raise UsageError(
            "no *.safetensors weights in the model directory",
            path=str(model_dir),
            hint="pass the directory that quantize saved with save_compressed=True",
        )
    for p in files:
        if p.is_symlink() and not p.resolve().is_relative_to(model_dir.resolve()):
            raise IntegrityError("weight file is a symlink out of the checkpoint", path=str(p))
    return {p.name: read_header(p) for p in files}


def _copy_tensor_data(src: Path, header: Header, name: str, dst) -> None:
    t = header.tensors[name]
    with open(src, "rb") as fh:
        fh.seek(header.data_start + t.begin)
        left = t.end - t.begin
        while left:
            chunk = fh.read(min(left, _COPY_CHUNK))
            if not chunk:
                raise IntegrityError(f"tensor {name!r}: file ended early", path=str(src))
            dst.write(chunk)
            left -= len(chunk)


def write_weights(
    model_dir: Path, headers: dict[str, Header], dst: Path, shard_size: int
) -> list[str]:
    where: dict[str, str] = {}
    for fname, h in headers.items():
        for name in h.tensors:
            if name in where:
                raise IntegrityError(
                    f"tensor {name!r} stored in both {where[name]} and {fname}",
                    path=str(model_dir / fname),
                )
            where[name] = fname
    all_t = {n: headers[f].tensors[n] for n, f in where.items()}
    plan = shard_plan(all_t, shard_size)
    names = (
        ["model.safetensors"]
        if len(plan) == 1
        else [f"model-{i:05d}-of-{len(plan):05d}.safetensors" for i in range(1, len(plan) + 1)]
    )
    weight_map = {}
    total = 0
    for shard, tensor_names in zip(names, plan, strict=True):
        specs = {n: (all_t[n].dtype, all_t[n].shape) for n in tensor_names}
        lay = layout(specs)
        hb = header_bytes(lay, ST_METADATA)
        with open(dst / shard, "wb") as out:
            out.write(len(hb).to_bytes(8, "little"))
            out.write(hb)
            for n in sorted(tensor_names):
                _copy_tensor_data(model_dir / where[n], headers[where[n]], n, out)
                weight_map[n] = shard
                total += all_t[n].end - all_t[n].begin
    if len(plan) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names
