"""`qship verify ARTIFACT`: the pre-deploy gate, usable without the rest of qship.

Checks, in order (every problem is collected; any problem is an IntegrityError, exit 3,
whose `path` is the first offending file and whose message lists them all):

1. the artifact is a real directory; nothing inside is a symlink or a special file;
2. `SHA256SUMS` parses (coreutils format; relative paths only, no `..`, no absolute
   path, no duplicates: hashing.parse_sha256sums), every listed file exists and matches,
   and every file present is listed, except `SHA256SUMS` itself and the signature file
   `model.sig` (written after SHA256SUMS, it signs every other file including
   SHA256SUMS). A renamed file shows up as one missing and one extra file; both are named;
3. the required files are there (config.json with quantization_config, weights, a
   tokenizer, eval.json, provenance.json, recipe.yaml, README.md);
4. every `*.safetensors` header is well-formed (safetensors_header.parse_header), the
   index (when sharded) maps every tensor to the shard that holds it, and the tensors
   agree with config.json: dims (vocab, hidden, layers, heads, intermediate) where the
   names are the usual HF ones, dense dtypes vs `dtype`, and for compressed-tensors
   `pack-quantized` every `weight_packed` / `weight_scale` / `weight_zero_point` vs
   `weight_shape` and the num_bits / strategy / group_size / symmetric of its group;
5. the signature (OpenSSF model-signing, elliptic-key method) when `model.sig` exists
   and a public key is given, or when `require_signature`;
6. with `load=True`, a smoke test: load with transformers, run the stored probe, compare
   with the fingerprint in `eval.json["probe"]` (see `fingerprint` / `compare_fingerprint`).

The probe fingerprint (format "qship-probe-v1"): the model runs once on `prompt_ids`
(float32, CPU, no KV cache); for every position the ids and logits of its top-k tokens
are kept (logits rounded to 1e-4). A reload matches when, at every position, the logits
of the stored ids are within `atol` and the top-1 token is the same, unless the stored
top-1/top-2 gap was itself below `atol` (a near tie may flip across machines).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .errors import IntegrityError, UsageError
from .hashing import hash_files, parse_sha256sums
from .safetensors_header import FLOAT_DTYPES, Header, read_header, read_int_tensor

SUMS = "SHA256SUMS"
SIGNATURE = "model.sig"
INDEX = "model.safetensors.index.json"
REQUIRED = ("config.json", "eval.json", "provenance.json", "recipe.yaml", "README.md")
MAX_SUMS_BYTES = 16 * 1024 * 1024
MAX_JSON_BYTES = 64 * 1024 * 1024
PROBE_FORMAT = "qship-probe-v1"
TORCH_TO_ST = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


@dataclass
class VerifyReport:
    path: str
    files: int = 0
    tensors: int = 0
    signature: str = "absent"  # absent | verified | present-unverified
    load: str = "skipped"  # skipped | matched
    checks: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ok: bool = True

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def summary(self) -> str:
        lines = [f"verify {self.path}: OK ({self.files} files, {self.tensors} tensors)"]
        lines += [f"  ✓ {c}" for c in self.checks]
        lines += [f"  ! {w}" for w in self.warnings]
        return "\n".join(lines)


class _Problems:
    def __init__(self, root: Path):
        self.root = root
        self.items: list[tuple[str, str]] = []

    def add(self, rel: str, msg: str) -> None:
        self.items.append((rel, msg))

    def raise_if_any(self, what: str) -> None:
        if not self.items:
            return
        first = self.items[0][0]
        listing = "\n".join(f"  - {rel}: {msg}" for rel, msg in self.items)
        raise IntegrityError(
            f"{what} failed for {len(self.items)} problem(s):\n{listing}",
            path=str(self.root / first),
            hint="do not deploy this artifact; re-package it (qship package) from its inputs",
        )


def _read_json(path: Path, problems: _Problems, rel: str) -> dict | None:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            problems.add(rel, f"larger than {MAX_JSON_BYTES} bytes")
            return None
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        problems.add(rel, f"not valid JSON ({type(e).__name__}: {str(e)[:120]})")
        return None
    if not isinstance(obj, dict):
        problems.add(rel, "not a JSON object")
        return None
    return obj


# ------------------------------------------------------------------ file set + hashes


def scan_tree(root: Path, problems: _Problems) -> list[str]:
    """Regular files below root (sorted relpaths); symlinks and special files are problems."""
    out = []

    def unreadable(err: OSError) -> None:
        rel = Path(err.filename).relative_to(root).as_posix() if err.filename else "."
        problems.add(rel, f"cannot be listed ({err.strerror})")

    for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=unreadable):
        base = Path(dirpath)
        for name in sorted(dirnames + filenames):
            p = base / name
            rel = p.relative_to(root).as_posix()
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                problems.add(rel, f"is a symlink (-> {os.readlink(p)}); artifacts hold plain files")
            elif stat.S_ISREG(st.st_mode):
                out.append(rel)
            elif not stat.S_ISDIR(st.st_mode):
                problems.add(rel, "is not a regular file")
    return sorted(out)


def check_sums(root: Path, report: VerifyReport) -> dict[str, str]:
    problems = _Problems(root)
    if root.is_symlink() or not root.is_dir():
        raise IntegrityError("artifact is not a directory (or is a symlink)", path=str(root))
    present = scan_tree(root, problems)
    sums_path = root / SUMS
    if SUMS not in present:
        problems.add(SUMS, "missing: the artifact has no checksum list")
        problems.raise_if_any("integrity check")
    if sums_path.stat().st_size > MAX_SUMS_BYTES:
        problems.add(SUMS, f"larger than {MAX_SUMS_BYTES} bytes")
        problems.raise_if_any("integrity check")
    listed = parse_sha256sums(sums_path.read_bytes(), where=str(sums_path))
    for rel in (SUMS, SIGNATURE):
        if rel in listed:
            problems.add(SUMS, f"lists {rel!r}, which is never covered by SHA256SUMS")
    others = [r for r in present if r not in (SUMS, SIGNATURE)]
    missing = sorted(set(listed) - set(others) - {SUMS, SIGNATURE})
    extra = sorted(set(others) - set(listed))
    digests = hash_files(root, [r for r in others if r in listed or r in extra])
    by_hash = {}
    for rel in extra:
        by_hash.setdefault(digests[rel].sha256, []).append(rel)
    for rel in missing:
        renamed = [e for e in by_hash.get(listed[rel], [])]
        also = f" (renamed to {', '.join(renamed)}?)" if renamed else ""
        problems.add(rel, f"listed in SHA256SUMS but absent{also}")
    for rel in extra:
        was = [m for m in missing if listed[m] == digests[rel].sha256]
        also = f" (renamed from {', '.join(was)}?)" if was else ""
        problems.add(rel, f"present but not listed in SHA256SUMS (extra file){also}")
    for rel in sorted(set(listed) & set(others)):
        if digests[rel].sha256 != listed[rel]:
            problems.add(rel, f"sha256 {digests[rel].sha256} != {listed[rel]} listed in SHA256SUMS")
    for rel in REQUIRED:
        if rel not in present and rel not in missing:
            problems.add(rel, "required file absent (and not listed in SHA256SUMS)")
    if not any(r in present for r in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        problems.add(
            "tokenizer.json", "no tokenizer (tokenizer.json / tokenizer.model / vocab.json)"
        )
    if not any(r.endswith(".safetensors") for r in present):
        problems.add("model.safetensors", "no *.safetensors weight file in the artifact")
    problems.raise_if_any("integrity check")
    report.files = len(present)
    report.checks.append(f"SHA256SUMS: {len(listed)} files listed, all present and matching")
    report.checks.append("no symlinks, no unlisted files, no unsafe paths")
    return listed


# ------------------------------------------------------------------ safetensors vs config


def _matches(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        try:
            return re.match(pattern[3:], module) is not None
        except re.error:
            return False
    return module == pattern


def check_records(root: Path, report: VerifyReport) -> None:
    """eval.json and provenance.json are JSON objects; eval.json carries the verdict."""
    problems = _Problems(root)
    ev = _read_json(root / "eval.json", problems, "eval.json")
    _read_json(root / "provenance.json", problems, "provenance.json")
    verdict = ev.get("verdict") if ev is not None else None
    if ev is not None and not (
        isinstance(verdict, dict) and isinstance(verdict.get("passed"), bool)
    ):
        problems.add("eval.json", "no verdict object with a boolean 'passed'")
    problems.raise_if_any("record check")
    report.checks.append(f"eval.json verdict: {'passed' if verdict['passed'] else 'FAILED'}")


def check_weights(root: Path, report: VerifyReport) -> None:
    problems = _Problems(root)
    config = _read_json(root / "config.json", problems, "config.json")
    problems.raise_if_any("config check")
    assert config is not None
    headers: dict[str, Header] = {}
    for rel in sorted(p.relative_to(root).as_posix() for p in root.rglob("*.safetensors")):
        try:
            headers[rel] = read_header(root / rel)
        except IntegrityError as e:
            problems.add(rel, e.message)
    problems.raise_if_any("safetensors header check")
    owner: dict[str, str] = {}
    for rel, h in headers.items():
        for name in h.tensors:
            if name in owner:
                problems.add(rel, f"tensor {name!r} also stored in {owner[name]}")
            owner[name] = rel
    if (root / INDEX).exists():
        index = _read_json(root / INDEX, problems, INDEX)
        wmap = index.get("weight_map") if index else None
        if not isinstance(wmap, dict):
            problems.add(INDEX, "no weight_map object")
        else:
            for name, rel in sorted(wmap.items()):
                if owner.get(name) != rel:
                    problems.add(INDEX, f"maps {name!r} to {rel!r}, found in {owner.get(name)}")
            for name in sorted(set(owner) - set(wmap)):
                problems.add(owner[name], f"tensor {name!r} missing from {INDEX}")
    elif len(headers) > 1:
        problems.add(INDEX, f"{len(headers)} shards but no index file")
    problems.raise_if_any("safetensors index check")
    tensors = {name: (owner[name], headers[owner[name]].tensors[name]) for name in owner}
    check_against_config(root, config, headers, tensors, problems)
    problems.raise_if_any("weights vs config.json check")
    report.tensors = len(tensors)
    report.checks.append(
        f"{len(headers)} safetensors file(s) well-formed; {len(tensors)} tensors consistent "
        "with config.json and quantization_config"
    )


def check_against_config(root, config, headers, tensors, problems: _Problems) -> None:
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        problems.add("config.json", "no quantization_config object (not a quantized checkpoint)")
        return
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

    def dim(key):
        v = cfg.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    hidden, vocab, layers = dim("hidden_size"), dim("vocab_size"), dim("num_hidden_layers")
    heads, inter = dim("num_attention_heads"), dim("intermediate_size")
    kv_heads = dim("num_key_value_heads") or heads
    head_dim = dim("head_dim") or (hidden // heads if hidden and heads else None)
    cdtype = TORCH_TO_ST.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("dtype")))

    # logical 2-D shapes (out, in) of the usual HF module names
    def expected_linear(module: str):
        leaf = module.rsplit(".", 1)[-1]
        q = heads * head_dim if heads and head_dim else None
        kv = kv_heads * head_dim if kv_heads and head_dim else None
        table = {
            "q_proj": (q, hidden),
            "k_proj": (kv, hidden),
            "v_proj": (kv, hidden),
            "o_proj": (hidden, q),
            "gate_proj": (inter, hidden),
            "up_proj": (inter, hidden),
            "down_proj": (hidden, inter),
            "lm_head": (vocab, hidden),
        }
        return table.get(leaf)

    layer_ids = set()
    for name, (rel, t) in sorted(tensors.items()):
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m:
            layer_ids.add(int(m.group(1)))
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and name.endswith("embed_tokens.weight"):
            if vocab and hidden and t.shape != (vocab, hidden):
                problems.add(
                    rel,
                    f"{name}: shape {list(t.shape)} != [vocab_size {vocab}, hidden_size {hidden}]",
                )
        if leaf == "weight" and (
            name.endswith("layernorm.weight") or name.endswith("model.norm.weight")
        ):
            if hidden and t.shape != (hidden,):
                problems.add(rel, f"{name}: shape {list(t.shape)} != [hidden_size {hidden}]")
        if leaf == "weight" and len(t.shape) == 2 and (exp := expected_linear(module)):
            if all(exp) and t.shape != exp:
                problems.add(
                    rel, f"{name}: shape {list(t.shape)} != expected {list(exp)} from config.json"
                )
        if leaf == "weight" and cdtype and t.dtype in FLOAT_DTYPES and t.dtype != cdtype:
            if name.endswith(("embed_tokens.weight", "norm.weight")) or module == "lm_head":
                problems.add(rel, f"{name}: dtype {t.dtype} != config.json dtype {cdtype}")
    if layers is not None:
        if layer_ids and max(layer_ids) >= layers:
            problems.add(
                "config.json",
                f"weights have layer {max(layer_ids)} but num_hidden_layers is {layers}",
            )
        absent = sorted(set(range(layers)) - layer_ids) if layer_ids else []
        if absent:
            problems.add(
                "config.json",
                f"num_hidden_layers is {layers} but layers {absent[:8]} have no tensors",
            )

    groups = qc.get("config_groups") or {}
    ignore = qc.get("ignore") or []
    fmt = qc.get("format")
    if not isinstance(groups, dict) or not isinstance(ignore, list):
        problems.add("config.json", "quantization_config.config_groups/ignore malformed")
        return
    packed = sorted(n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed"))
    if fmt == "pack-quantized" and groups and not packed:
        problems.add(
            "config.json", "format pack-quantized but no *.weight_packed tensor in the weights"
        )
    for module in packed:
        rel, tp = tensors[module + ".weight_packed"]
        if any(_matches(module, p) for p in ignore if isinstance(p, str)):
            problems.add(rel, f"{module} is quantized but listed in quantization_config.ignore")
        cands = []
        for gname, g in groups.items():
            if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
                continue
            targets = [x for x in g.get("targets") or [] if isinstance(x, str)]
            if any(_matches(module, x) for x in targets if x.startswith("re:") or "." in x):
                cands.insert(0, (gname, g))
            elif any(not x.startswith("re:") for x in targets):
                cands.append((gname, g))  # a class-name target ("Linear")
        if not cands:
            problems.add(rel, f"{module}: no quantization_config group targets it")
            continue
        errs = []
        for gname, g in cands:
            e = _check_packed(root, module, g["weights"], tensors, headers, expected_linear(module))
            if not e:
                errs = []
                break
            errs.append(f"[{gname}] " + "; ".join(e))
        for e in errs[:1]:
            problems.add(rel, f"{module}: {e}")
    kv = qc.get("kv_cache_scheme")
    if isinstance(kv, dict) and layers:
        for i in sorted(layer_ids):
            for s in ("k_scale", "v_scale"):
                if not any(n.endswith(f".layers.{i}.self_attn.{s}") for n in tensors):
                    problems.add(
                        "config.json", f"kv_cache_scheme set but layer {i} has no self_attn.{s}"
                    )


def _check_packed(root, module, w, tensors, headers, expected) -> list[str]:
    errs = []
    rel, tp = tensors[module + ".weight_packed"]
    if tp.dtype != "I32" or len(tp.shape) != 2:
        return [f"weight_packed is {tp.dtype}{list(tp.shape)}, expected a 2-D I32 tensor"]
    if module + ".weight_shape" not in tensors:
        return ["weight_shape tensor missing"]
    srel, ts = tensors[module + ".weight_shape"]
    try:
        shape = read_int_tensor(root / srel, headers[srel], module + ".weight_shape")
    except IntegrityError as e:
        return [e.message]
    if len(shape) != 2 or min(shape) <= 0:
        return [f"weight_shape {shape} is not [out, in]"]
    out, inn = shape
    if expected and all(expected) and (out, inn) != expected:
        errs.append(f"weight_shape {shape} != expected {list(expected)} from config.json")
    bits = w.get("num_bits")
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        return [f"num_bits {bits!r} not in 1..8"]
    want = (out, math.ceil(inn * bits / 32))
    if tp.shape != want:
        errs.append(f"weight_packed shape {list(tp.shape)} != {list(want)} for {bits}-bit {shape}")
    strategy, gs = w.get("strategy"), w.get("group_size")
    if strategy == "group":
        if not isinstance(gs, int) or gs <= 0:
            return errs + [f"strategy group with group_size {gs!r}"]
        ngroups = math.ceil(inn / gs)
    elif strategy == "channel":
        ngroups = 1
    elif strategy == "tensor":
        ngroups = None
    else:
        return errs + [f"unsupported weight strategy {strategy!r}"]
    if module + ".weight_scale" not in tensors:
        return errs + ["weight_scale tensor missing"]
    _, tsc = tensors[module + ".weight_scale"]
    if tsc.dtype not in FLOAT_DTYPES:
        errs.append(f"weight_scale dtype {tsc.dtype} is not floating point")
    if ngroups is None:
        if tsc.numel != 1:
            errs.append(f"weight_scale shape {list(tsc.shape)} for per-tensor strategy")
    elif tsc.shape != (out, ngroups):
        errs.append(
            f"weight_scale shape {list(tsc.shape)} != [{out}, {ngroups}] "
            f"(strategy {strategy}, group_size {gs}, in_features {inn})"
        )
    zp = tensors.get(module + ".weight_zero_point")
    if w.get("symmetric") is True and zp is not None:
        errs.append("weight_zero_point present but the group is symmetric")
    if w.get("symmetric") is False:
        if zp is None:
            errs.append("weight_zero_point missing but the group is asymmetric")
        elif ngroups is not None and zp[1].shape not in (
            (math.ceil(out * bits / 32), ngroups),
            (out, ngroups),
        ):
            errs.append(
                f"weight_zero_point shape {list(zp[1].shape)} does not fit [{out}, {ngroups}]"
            )
    return errs


# ------------------------------------------------------------------ signature


def sign_artifact(root: Path, private_key: Path, password: str | None = None) -> Path:
    """Sign every file of `root` except model.sig with model-signing's elliptic-key method."""
    import model_signing

    hcfg = model_signing.hashing.Config().set_ignored_paths(
        paths=[SIGNATURE], ignore_git_paths=False
    )
    sig = root / SIGNATURE
    try:
        model_signing.signing.Config().use_elliptic_key_signer(
            private_key=Path(private_key), password=password
        ).set_hashing_config(hcfg).sign(root, sig)
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(
            f"cannot sign with this key ({type(e).__name__}: {e})",
            path=str(private_key),
            hint="give a PEM elliptic-curve private key (e.g. openssl ecparam -genkey -name prime256v1)",
        ) from e
    return sig


def check_signature(
    root: Path, report: VerifyReport, *, pubkey: Path | None, require: bool
) -> None:
    sig = root / SIGNATURE
    if not sig.exists():
        if require:
            raise IntegrityError(
                f"unsigned artifact: {SIGNATURE} absent but a signature is required",
                path=str(sig),
                hint="package it with --sign-key, or drop --require-signature",
            )
        return
    if pubkey is None:
        if require:
            raise UsageError("--require-signature needs --pubkey PUBLIC_KEY.pem", path=str(sig))
        report.signature = "present-unverified"
        report.warnings.append(f"{SIGNATURE} present but not verified (no --pubkey given)")
        return
    if not Path(pubkey).is_file():
        raise UsageError("public key file not found", path=str(pubkey))
    import model_signing

    try:
        model_signing.verifying.Config().use_elliptic_key_verifier(
            public_key=Path(pubkey)
        ).set_hashing_config(
            model_signing.hashing.Config().set_ignored_paths(
                paths=[SIGNATURE], ignore_git_paths=False
            )
        ).verify(root, sig)
    except Exception as e:  # noqa: BLE001 - any failure of the verifier fails closed
        raise IntegrityError(
            f"signature verification failed with {Path(pubkey).name} ({type(e).__name__}: {str(e)[:300]})",
            path=str(sig),
            hint="the artifact was modified or signed by another key; do not deploy it",
        ) from e
    report.signature = "verified"
    report.checks.append(f"signature {SIGNATURE} valid for {Path(pubkey).name}")


# ------------------------------------------------------------------ load probe


def probe_logits(model_dir: Path, prompt_ids: list[int]):
    """Logits [positions, vocab] (float32, CPU) of one forward pass over prompt_ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, device_map="cpu"
    )
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([list(prompt_ids)]), use_cache=False).logits[0].float()


def fingerprint(model_dir: Path, prompt_ids: list[int], *, top_k: int = 5) -> dict:
    """Load the checkpoint with transformers on CPU (float32) and fingerprint one forward pass."""
    import torch

    logits = probe_logits(model_dir, prompt_ids)
    vals, ids = torch.topk(logits, k=min(top_k, logits.shape[-1]), dim=-1)
    return {
        "format": PROBE_FORMAT,
        "prompt_ids": [int(i) for i in prompt_ids],
        "top_k": int(ids.shape[-1]),
        "top_ids": ids.tolist(),
        "top_logits": [[round(float(v), 4) for v in row] for row in vals.tolist()],
    }


def compare_fingerprint(stored: dict, actual_logits, *, atol: float = 0.05) -> list[str]:
    """Problems between a stored fingerprint and fresh logits [positions, vocab] (a tensor)."""
    problems = []
    for p, (ids, vals) in enumerate(zip(stored["top_ids"], stored["top_logits"], strict=True)):
        row = actual_logits[p]
        got = [float(row[i]) for i in ids]
        diff = max(abs(a - b) for a, b in zip(got, vals, strict=True))
        if diff > atol:
            problems.append(f"position {p}: logits differ by {diff:.4f} > {atol}")
        top1 = int(row.argmax())
        gap = vals[0] - vals[1] if len(vals) > 1 else math.inf
        if top1 != ids[0] and gap >= atol:
            problems.append(f"position {p}: top-1 token {top1} != stored {ids[0]}")
    return problems


def check_load(root: Path, report: VerifyReport, *, atol: float) -> None:
    problems = _Problems(root)
    ev = _read_json(root / "eval.json", problems, "eval.json")
    problems.raise_if_any("load smoke test")
    probe = ev.get("probe") if ev else None
    if not isinstance(probe, dict) or probe.get("format") != PROBE_FORMAT:
        raise IntegrityError(
            f"eval.json has no probe fingerprint of format {PROBE_FORMAT}",
            path=str(root / "eval.json"),
            hint="re-package with qship package (it stores the probe)",
        )
    try:
        logits = probe_logits(root, probe["prompt_ids"])
    except Exception as e:  # noqa: BLE001 - a model that does not load fails the gate
        raise IntegrityError(
            f"transformers could not load and run the model ({type(e).__name__}: {str(e)[:300]})",
            path=str(root / "config.json"),
        ) from e
    try:
        mismatches = compare_fingerprint(probe, logits, atol=atol)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        raise IntegrityError(
            f"malformed probe fingerprint ({type(e).__name__}: {str(e)[:200]})",
            path=str(root / "eval.json"),
        ) from e
    for msg in mismatches:
        problems.add("eval.json", f"probe mismatch: {msg}")
    problems.raise_if_any("load smoke test")
    report.load = "matched"
    report.checks.append(
        f"loaded with transformers; probe of {len(probe['prompt_ids'])} tokens matched"
    )


# ------------------------------------------------------------------ entry point


def verify(
    artifact: Path,
    *,
    require_signature: bool = False,
    pubkey: Path | None = None,
    load: bool = False,
    atol: float = 0.05,
) -> VerifyReport:
    """Run every check; raise IntegrityError (exit 3) on the first failing group."""
    root = Path(artifact)
    if not root.exists():
        raise UsageError("artifact directory not found", path=str(root))
    report = VerifyReport(path=str(root))
    check_sums(root, report)
    check_records(root, report)
    check_weights(root, report)
    check_signature(
        root, report, pubkey=Path(pubkey) if pubkey else None, require=require_signature
    )
    if load:
        check_load(root, report, atol=atol)
    return report
