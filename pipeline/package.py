"""`qship package`: turn a quantized checkpoint into a deployable, checksummed artifact.

The artifact directory (complete or absent: built in a temp dir beside `out` by
fsutil.atomic_dir, fsynced, renamed; a killed run leaves only a dot-named `.partial-`
folder that the next run removes):

    model.safetensors | model-0000i-of-0000N.safetensors + model.safetensors.index.json
    config.json, generation_config.json, tokenizer files   (copied byte for byte)
    recipe.yaml      the resolved recipe, as given
    eval.json        evaluate's output + {"verdict": ..., "probe": fingerprint}
    provenance.json  inputs (source, hashes, calibration), versions, qship commit, timings
    README.md        model card (pipeline.model_card)
    SHA256SUMS       coreutils format over every file above
    model.sig        optional OpenSSF model-signing signature over all of the above

Weights are re-laid out at the byte level (no dtype conversion): tensors sorted by name,
canonical header, metadata {"format": "pt"}, sharded in name order above `shard_size`
data bytes. Determinism: the same inputs give byte-identical files except
`provenance.json` (its "timings") and hence its line in SHA256SUMS, and `model.sig`
(ECDSA signatures are randomized).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import yaml

from . import model_card
from .cache import library_versions
from .errors import IntegrityError, UsageError
from .fsutil import atomic_dir, remove_stale_partials
from .hashing import format_sha256sums, hash_files, sha256_bytes
from .safetensors_header import Header, header_bytes, layout, read_header, shard_plan
from .verify import (
    INDEX,
    SIGNATURE,
    SUMS,
    VerifyReport,
    check_records,
    check_sums,
    check_weights,
    fingerprint,
)

DEFAULT_SHARD_SIZE = 5 * 1000**3  # 5 GB of tensor data per shard, like transformers
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
TOKENIZER_KEYS = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one must exist
# Only these are copied; anything else in model_dir (e.g. llm-compressor's own recipe.yaml,
# an upstream README) is left out: the artifact's recipe.yaml is the resolved qship recipe.
COPIED = ("config.json", "generation_config.json", *TOKENIZER_FILES)
PROBE_TEXT = "The capital of France is"
ST_METADATA = {"format": "pt"}
_COPY_CHUNK = 8 * 1024 * 1024


@dataclass
class Artifact:
    path: Path
    files: dict[str, str] = field(default_factory=dict)  # relpath -> sha256 (SHA256SUMS)
    shards: list[str] = field(default_factory=list)
    signed: bool = False
    passed: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "path": str(self.path),
            "files": self.files,
            "shards": self.shards,
            "signed": self.signed,
            "verdict_passed": self.passed,
            "timings": self.timings,
        }

    def summary(self) -> str:
        v = "PASSED" if self.passed else "FAILED"
        s = "signed" if self.signed else "unsigned"
        return (
            f"artifact {self.path}: {len(self.files)} files, {len(self.shards)} weight shard(s), "
            f"{s}, gate {v}"
        )


# ------------------------------------------------------------------ inputs


def _load_recipe_text(recipe_path_or_text: str | Path) -> str:
    text = None
    if isinstance(recipe_path_or_text, Path) or (
        isinstance(recipe_path_or_text, str) and "\n" not in recipe_path_or_text
    ):
        p = Path(recipe_path_or_text)
        if p.is_file():
            text = p.read_text(encoding="utf-8")
        elif str(p).endswith((".yaml", ".yml")) or isinstance(recipe_path_or_text, Path):
            raise UsageError("recipe file not found", path=str(p))
    if text is None:
        text = str(recipe_path_or_text)
    try:
        obj = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UsageError(f"recipe is not valid YAML ({e})", path="recipe.yaml") from e
    if not isinstance(obj, dict):
        raise UsageError("recipe must be a YAML mapping", path="recipe.yaml")
    return text if text.endswith("\n") else text + "\n"


def _check_verdict(verdict: dict) -> None:
    if not isinstance(verdict, dict) or not isinstance(verdict.get("passed"), bool):
        raise UsageError("verdict must be a dict with a boolean 'passed'", path="verdict")
    checks = verdict.get("checks", [])
    if not isinstance(checks, list) or not all(
        isinstance(c, dict) and {"name", "value", "limit", "passed"} <= set(c) for c in checks
    ):
        raise UsageError(
            "verdict['checks'] must be a list of {name, value, limit, passed}", path="verdict"
        )


def _source_weights(model_dir: Path) -> dict[str, Header]:
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


# ------------------------------------------------------------------ weights


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


# ------------------------------------------------------------------ provenance


def _qship_commit() -> dict:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no", "--", "."],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
        return {"git_commit": rev, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "dirty": None}


def _versions() -> dict[str, str]:
    out = library_versions()
    for name in ("safetensors", "huggingface_hub", "tokenizers", "model-signing"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return dict(sorted(out.items()))


def _probe_ids(model_dir: Path, vocab: int | None) -> list[int]:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        ids = list(tok(PROBE_TEXT)["input_ids"])
        if ids and (vocab is None or max(ids) < vocab):
            return ids
    except Exception:  # noqa: BLE001 - no usable tokenizer: fall back to fixed ids
        pass
    top = vocab or 32
    return [i % top for i in (1, 5, 17, 42, 99, 123, 7)]


# ------------------------------------------------------------------ entry point


def package(
    *,
    model_dir: Path,
    out: Path,
    recipe_path_or_text: str | Path,
    eval_json: dict,
    verdict: dict,
    provenance: dict,
    sign_key: Path | None = None,
    sign_password: str | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    probe_prompt_ids: list[int] | None = None,
    name: str | None = None,
    overwrite: bool = False,
    probe: bool = True,
) -> Artifact:
    """Build the artifact at `out` (see the module docstring); returns its Artifact.

    probe=False skips the load-probe fingerprint (it loads the model in float32 on CPU,
    which a large model may not fit); `verify --load` then has nothing to compare with.
    """
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    model_dir, out = Path(model_dir), Path(out)
    if not model_dir.is_dir():
        raise UsageError("model directory not found", path=str(model_dir))
    cfg_path = model_dir / "config.json"
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"unreadable config.json ({e})", path=str(cfg_path)) from e
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict):
        raise UsageError(
            "config.json has no quantization_config: not a quantized checkpoint",
            path=str(cfg_path),
            hint="package the output of `qship quantize` (saved with save_compressed=True)",
        )
    if not isinstance(eval_json, dict) or not isinstance(provenance, dict):
        raise UsageError("eval_json and provenance must be JSON objects", path="eval.json")
    if shard_size <= 0:
        raise UsageError(f"shard_size must be positive, got {shard_size}", path="--shard-size")
    if sign_key is not None and not Path(sign_key).is_file():
        raise UsageError("signing key not found", path=str(sign_key))
    _check_verdict(verdict)
    recipe_text = _load_recipe_text(recipe_path_or_text)
    recipe_obj = yaml.safe_load(recipe_text)
    headers = _source_weights(model_dir)
    if not any((model_dir / f).is_file() for f in TOKENIZER_KEYS):
        raise UsageError(
            f"no tokenizer in the model directory (expected one of {list(TOKENIZER_KEYS)})",
            path=str(model_dir),
            hint="save the tokenizer next to the quantized weights (tokenizer.save_pretrained)",
        )
    if out.exists() and not overwrite:
        raise UsageError(
            "output already exists; an artifact is never overwritten silently",
            path=str(out),
            hint="choose another --out, or delete the old artifact first",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out.parent)
    input_digests = hash_files(
        model_dir,
        [p.name for p in model_dir.iterdir() if p.is_file() and not p.name.startswith(".")],
    )
    timings["inputs_s"] = round(time.perf_counter() - t_start, 3)

    with atomic_dir(out, replace=overwrite) as tmp:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; an artifact is for others too
        t = time.perf_counter()
        shards = write_weights(model_dir, headers, tmp, shard_size)
        timings["weights_s"] = round(time.perf_counter() - t, 3)
        for fname in COPIED:
            if (model_dir / fname).is_file():
                shutil.copyfile(model_dir / fname, tmp / fname)
        (tmp / "recipe.yaml").write_text(recipe_text, encoding="utf-8")

        t = time.perf_counter()
        vocab = (config.get("text_config") or config).get("vocab_size")
        ev = {**eval_json, "verdict": verdict}
        if probe:
            ids = probe_prompt_ids or _probe_ids(
                model_dir, vocab if isinstance(vocab, int) else None
            )
            ev["probe"] = fingerprint(tmp, ids)
        timings["probe_s"] = round(time.perf_counter() - t, 3)
        (tmp / "eval.json").write_text(json.dumps(ev, indent=2, sort_keys=True) + "\n")

        recipe_sha = sha256_bytes(recipe_text.encode("utf-8"))
        src = provenance.get("source") if isinstance(provenance.get("source"), dict) else {}
        base_model = (
            src.get("repo_id")
            or provenance.get("base_model")
            or (provenance.get("source") if isinstance(provenance.get("source"), str) else None)
        )
        license_ = src.get("license") or provenance.get("license")
        recipe_name = str(recipe_obj.get("name") or "recipe")
        # the name comes from the inputs, not from `out`, so that any --out gives the same bytes
        art_name = name or (
            f"{str(base_model).rstrip('/').rsplit('/', 1)[-1]}-{recipe_name}"
            if base_model
            else out.name
        )
        (tmp / "README.md").write_text(
            model_card.render(
                name=art_name,
                base_model=base_model,
                license=license_,
                recipe_name=recipe_name,
                recipe_sha256=recipe_sha,
                quantization_config=qc,
                eval_json=eval_json,
                verdict=verdict,
            ),
            encoding="utf-8",
        )
        caller_timings = (
            provenance.get("timings") if isinstance(provenance.get("timings"), dict) else {}
        )
        prov = {k: v for k, v in provenance.items() if k != "timings"}
        prov.update(
            {
                "name": art_name,
                "recipe": {"name": recipe_name, "sha256": recipe_sha},
                "quantized_checkpoint": {k: d.to_json() for k, d in input_digests.items()},
                "library_versions": _versions(),
                "qship": {"version": _versions().get("qship"), **_qship_commit()},
                "verdict_passed": verdict["passed"],
            }
        )
        timings["package_s"] = round(time.perf_counter() - t_start, 3)
        prov["timings"] = {**caller_timings, **{f"package.{k}": v for k, v in timings.items()}}
        (tmp / "provenance.json").write_text(
            json.dumps(prov, indent=2, sort_keys=True, default=str) + "\n"
        )

        rels = [p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()]
        digests = hash_files(tmp, [r for r in rels if r not in (SUMS, SIGNATURE)])
        sums = {r: d.sha256 for r, d in digests.items()}
        (tmp / SUMS).write_text(format_sha256sums(sums))
        # the artifact must pass its own gate before it may exist under its final name
        report = VerifyReport(path=str(out))
        check_sums(tmp, report)
        check_records(tmp, report)
        check_weights(tmp, report)
        if sign_key is not None:
            from .verify import sign_artifact

            sign_artifact(tmp, Path(sign_key), sign_password)
    return Artifact(
        path=out,
        files=sums,
        shards=shards,
        signed=sign_key is not None,
        passed=verdict["passed"],
        timings=timings,
    )
