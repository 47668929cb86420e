"""What several test modules share, so that no test module imports another: records for
tests that need an evaluation without running a model (built by the same record classes
and the same statistics code, kl_stats.summarise, that evaluate uses, from synthetic
per-token values), a small RTN recipe, the tiny models' dimensions, signing keys, the
`qship` executable and the KL of a checkpoint. Fixtures live in conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipeline.artifact.signing import SIGNATURE
from pipeline.evaluate import kl_stats
from pipeline.io.hashing import format_sha256sums, sha256_file
from pipeline.records.benchmarks import Benchmarks, TaskResult
from pipeline.records.checkpoint import QuantizeSummary
from pipeline.records.evaluation import (
    CandidateRef,
    CorpusRef,
    EvalFile,
    EvalReport,
    EvalSettings,
    Metrics,
    ModelRef,
)


def metrics(kl: np.ndarray, seed: int = 0, **override: float) -> Metrics:
    rng = np.random.default_rng(seed)
    n = kl.size
    m = kl_stats.summarise(
        kl, rng.random(n) < 0.8, rng.random(n) * 3, rng.random(n) * 3.1, rng.normal(0, 0.01, n)
    )
    return Metrics(**{**m, **override}, kl_mode="exact")


def eval_report(
    kl_scale: float = 0.2, *, seed: int = 0, n: int = 2000, tasks=None, **over
) -> EvalReport:
    rng = np.random.default_rng(seed)
    kl = rng.lognormal(np.log(kl_scale) - 1.5, 1.5, n)
    return EvalReport(
        reference=ModelRef(path=Path("ref"), model_hash="a" * 64),
        candidate=CandidateRef(path=Path("cand"), model_hash="b" * 64),
        corpus=CorpusRef(heldout_hash="c" * 64, sequences=n // 100, seq_len=101, tokens_scored=n),
        settings=EvalSettings(
            mode="exact",
            topk=None,
            kl_approximation=None,
            kl_dtype="float64",
            batch_size=4,
            device="cpu",
            dtype="auto",
            kv_cache="none",
            weights_only_pass=False,
        ),  # fmt: skip
        metrics=metrics(kl, seed, **over),
        benchmarks=Benchmarks(
            tasks={k: TaskResult.model_validate(v) for k, v in (tasks or {}).items()}
        ),
    )


def eval_file(
    name: str, bits: float, kl_scale: float, verdict, *, seed: int = 0, tasks=None
) -> EvalFile:
    """An eval.json as `qship run` / `qship compare` write it."""
    report = eval_report(kl_scale, seed=seed, tasks=tasks)
    q = QuantizeSummary(name=name, recipe=f"recipes/{name}.yaml", recipe_hash=f"{seed:064x}",
                        bits_per_weight=bits, size_bytes=int(bits * 1e5), seconds=1.5 + seed,
                        peak_mem_bytes=10**9 + seed, peak_mem_kind="process_peak_rss")  # fmt: skip
    return EvalFile.of(report, verdict=verdict, quantize=q)


# --- the Hub ------------------------------------------------------------------------------
# conftest's `hub` serves tests/hub_server.py; `tiny_repo` publishes tiny-llama there as REPO.
REPO = "qship-tests/tiny-llama"


# --- recipes and models -------------------------------------------------------------------
# A small RTN recipe (int4 g32, every projection) written as JSON, which the YAML loader reads.
RECIPE = {
    "others": "keep",
    "groups": [{"name": "all", "targets": ["re:.*_proj$"], "method": "rtn",
                "scheme": {"bits": 4, "group_size": 32}}],
    "calibration": {"num_samples": 4, "seq_len": 64},
    "evaluation": {"sequences": 2, "seq_len": 64},
}  # fmt: skip


def recipe(tmp: Path, name: str, bits: int = 4) -> Path:
    r = json.loads(json.dumps(RECIPE))
    r["name"] = name
    r["groups"][0]["scheme"]["bits"] = bits
    p = tmp / f"{name}.yaml"
    p.write_text(json.dumps(r))
    return p


# The tiny configs' dimensions (2 layers, 4 heads, 2 KV heads) of test_roles and test_families.
DIMS = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def mean_kl(ref_dir: Path, q_dir: Path, ids) -> float:
    """Mean KL(ref || quant) per token of two checkpoints on `ids` (CPU, fp32 logits)."""
    import torch
    from transformers import AutoModelForCausalLM

    def logp(d):
        m = AutoModelForCausalLM.from_pretrained(d, device_map="cpu").eval()
        with torch.no_grad():
            return torch.log_softmax(m(input_ids=ids).logits.float(), dim=-1)

    p, q = logp(ref_dir), logp(q_dir)
    kl = (p.exp() * (p - q)).sum(-1)  # per token, KL(ref || quant)
    return float(kl.mean())


# --- fetch cache --------------------------------------------------------------------------


def entries(cache: Path) -> list[Path]:
    """Complete fetch cache entries (a stage.json), and anything else left in fetch/."""
    d = cache / "fetch"
    return sorted(d.glob("*/stage.json")) if d.is_dir() else []


# --- artifacts and signing ----------------------------------------------------------------


def resum(art: Path, *, bom: bool = True) -> None:
    """Rewrite SHA256SUMS to match the files, and the unsigned statements' subjects and
    results to match it (restate), so a deeper check is what must fail."""
    from pipeline.artifact.attestation import covered_by_sums

    rels = sorted(
        p.relative_to(art).as_posix()
        for p in art.rglob("*")
        if p.is_file()
        and not p.is_symlink()
        and p.name not in ("SHA256SUMS", SIGNATURE)
        and covered_by_sums(p.relative_to(art).as_posix())
    )
    sums = {r: sha256_file(art / r).sha256 for r in rels}
    (art / "SHA256SUMS").write_text(format_sha256sums(sums))
    restate(art, sums, bom=bom)


def restate(art: Path, sums: dict[str, str], *, bom: bool = True) -> None:
    """The statements as a re-packager who rewrites every record consistently would leave
    them: subjects = SHA256SUMS, results = eval.json (when eval.json is still a record),
    the BOM's file hashes = SHA256SUMS (when the BOM is still JSON; SHA256SUMS re-summed)."""
    from pipeline.artifact import attestation
    from pipeline.artifact.bom import BOM
    from pipeline.errors import UsageError
    from pipeline.records.attestation import QuantResults
    from pipeline.records.evaluation import EvalFile

    try:
        doc = json.loads((art / BOM).read_text()) if bom else None
        for c in doc.get("components", []) if doc else []:
            rel = str(c.get("bom-ref", "")).removeprefix("file:")
            if c.get("bom-ref", "").startswith("file:") and rel in sums and c.get("hashes"):
                c["hashes"][0]["content"] = sums[rel]
        if doc:
            (art / BOM).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
            sums[BOM] = sha256_file(art / BOM).sha256
            (art / "SHA256SUMS").write_text(format_sha256sums(sums))
    except (OSError, ValueError, AttributeError, TypeError):
        pass

    for rel in attestation.STATEMENTS:
        path = art / rel
        if not path.is_file():
            continue
        st = json.loads(path.read_text())
        st["subject"] = attestation.subjects(art, sums)
        if rel == attestation.RESULTS_STATEMENT and "eval.json" in sums:
            try:
                ev = EvalFile.from_json(json.loads((art / "eval.json").read_text()))
                st["predicate"] = QuantResults.of(ev, sums["eval.json"]).to_json()
            except (ValueError, UsageError):
                pass
        path.write_text(json.dumps(st, indent=2, sort_keys=True) + "\n")


def negate_head(art: Path) -> str:
    """lm_head negated in whichever weight file holds it; -> that file's name."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for f in sorted(art.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            if "lm_head.weight" not in fh.keys():
                continue
        sd = load_file(str(f))
        sd["lm_head.weight"] = -sd["lm_head.weight"]
        save_file(sd, str(f), metadata={"format": "pt"})
        return f.name
    raise AssertionError(f"no lm_head.weight in {art}")


def reseal(art: Path, *records: str) -> None:
    """Re-hash `records` into provenance.json and rewrite SHA256SUMS: a forgery that left
    the artifact's own hashes consistent, so a check beyond them is what must fail."""
    prov = json.loads((art / "provenance.json").read_text())
    prov["records"].update({r: sha256_file(art / r).sha256 for r in records})
    (art / "provenance.json").write_text(json.dumps(prov, indent=2, sort_keys=True) + "\n")
    resum(art)


def ec_keypair(dir: Path, name: str) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    priv, pub = dir / f"{name}.pem", dir / f"{name}.pub.pem"
    priv.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pub.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return priv, pub


# --- the installed `qship` executable -----------------------------------------------------
QSHIP = str(Path(sys.executable).with_name("qship"))


def cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
    return subprocess.run([QSHIP, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip
