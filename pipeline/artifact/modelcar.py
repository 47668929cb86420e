"""`qship publish ART --to oci://… --as modelcar`: the artifact as an OCI image KServe's
Modelcars pull (`storageUri: oci://…`): one uncompressed tar layer holding every file under
`/models`, and an image config naming it. The tar is reproducible (sorted, mtime 0, root
owned), so the same folder gives the same digests. KServe runs the image as a sidecar with
a shell command; with no base image here, a deploy that needs one stacks this layer on its
own base (the layer's digest is what `qship verify` holds)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import IntegrityError
from ..io.hashing import sha256_file

MODELS = "models"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"


def _info(name: str, size: int, mode: int, kind: bytes) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.type, ti.mtime = size, mode, kind, 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def write_layer(root: Path, rels: list[str], out: Path) -> None:
    """A tar of `rels` under models/, byte for byte the same for the same files."""
    dirs = sorted({MODELS, *(f"{MODELS}/{p}" for r in rels for p in
                             [PurePosixPath(r).parent.as_posix()] if p != ".")})  # fmt: skip
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
        for d in dirs:
            tar.addfile(_info(d + "/", 0, 0o755, tarfile.DIRTYPE))
        for rel in sorted(rels):
            with open(root / rel, "rb") as fh:
                tar.addfile(_info(f"{MODELS}/{rel}", (root / rel).stat().st_size, 0o644,
                                  tarfile.REGTYPE), fh)  # fmt: skip


def image(root: Path, rels: list[str], work: Path, manifest_type: str) -> tuple[bytes, dict]:
    """(the image manifest's bytes, digest -> file) for the layer and its config."""
    layer = work / "layer.tar"
    write_layer(root, rels, layer)
    ld = "sha256:" + sha256_file(layer).sha256
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": [ld]}},
                        sort_keys=True, separators=(",", ":")).encode()  # fmt: skip
    (work / "config.json").write_bytes(config)
    cd = "sha256:" + sha256_file(work / "config.json").sha256
    manifest: dict[str, Any] = {
        "schemaVersion": 2, "mediaType": manifest_type,
        "config": {"mediaType": CONFIG_TYPE, "digest": cd, "size": len(config)},
        "layers": [{"mediaType": LAYER_TYPE, "digest": ld, "size": layer.stat().st_size}],
    }  # fmt: skip
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return body, {cd: work / "config.json", ld: layer}


def extract(layer: Path, dest: Path, where: str) -> None:
    """The files under models/ into dest; anything else in the tar is an IntegrityError."""
    with tarfile.open(layer, "r:") as tar:
        for m in tar.getmembers():
            p = PurePosixPath(m.name)
            if p.parts[:1] != (MODELS,) or ".." in p.parts or not (m.isfile() or m.isdir()):
                raise IntegrityError(f"modelcar layer member {m.name!r} is not a plain file "
                                     f"under {MODELS}/", path=where, hint="do not deploy it")  # fmt: skip
            if m.isfile():
                target = dest / PurePosixPath(*p.parts[1:])
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                assert src is not None
                target.write_bytes(src.read())
