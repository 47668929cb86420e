"""qship package, qship verify, qship publish"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError
from ..records.artifact import Artifact, PublishResult, VerifyReport
from ..records.served import LongContextCheck
from .common import DeviceOpt, JsonOpt, VerboseOpt

Step = Callable[[VerifyReport], VerifyReport]  # one served gate: report in, report out


def _read_json(path: Path, what: str) -> object:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {what} JSON ({e})", path=str(path)) from e


def package_cmd(
    model_dir: Annotated[
        Path, typer.Option("--model-dir", help="Quantized checkpoint dir (qship quantize --out).")
    ],
    recipe: Annotated[Path, typer.Option("--recipe", help="The recipe it was quantized with.")],
    eval_path: Annotated[
        Path, typer.Option("--eval", help="Its eval.json (qship evaluate), with the verdict.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Artifact directory to create.")],
    snapshot: Annotated[
        Path | None,
        typer.Option("--snapshot", help="The source's record (`qship fetch --json` output)."),
    ] = None,
    sign_key: Annotated[
        Path | None, typer.Option("--sign-key", help="EC private key (PEM) to sign with.")
    ] = None,
    sign_cert: Annotated[
        Path | None,
        typer.Option(
            "--sign-cert",
            help="With --sign-key: its certificate (PEM), for the "
            "attestations' certificate method.",
        ),
    ] = None,  # fmt: skip
    cert_chain: Annotated[
        list[Path] | None,
        typer.Option("--cert-chain", help="With --sign-cert: the chain's certificates (PEM)."),
    ] = None,
    shard_size: Annotated[int, typer.Option("--shard-size", help="Max bytes per shard.")] = 0,
    no_probe: Annotated[
        bool, typer.Option("--no-probe", help="Skip the fp32 CPU load-probe fingerprint.")
    ] = False,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> Artifact:
    """Build the artifact directory (complete or absent) from quantize's and evaluate's outputs."""
    from ..artifact.package import package
    from ..artifact.weights import DEFAULT_SHARD_SIZE
    from ..recipe import load_recipe
    from ..records.checkpoint import QuantizedCheckpoint
    from ..records.evaluation import EvalFile, EvalReport
    from ..records.snapshot import Snapshot

    qc = QuantizedCheckpoint.read(model_dir)
    if qc is None:
        raise UsageError(
            "no quantize_report.json in the model directory",
            path=str(model_dir),
            hint="package the output folder of `qship quantize`",
        )
    ev = EvalFile.from_json(_read_json(eval_path, "eval"), where=str(eval_path))
    if ev.verdict is None:
        raise UsageError("eval.json has no verdict", path=str(eval_path),
                         hint="give the eval.json that `qship evaluate` wrote")  # fmt: skip
    src = (
        Snapshot.from_json(_read_json(snapshot, "snapshot"), where=str(snapshot))
        if snapshot
        else None
    )
    report = EvalReport(**{k: getattr(ev, k) for k in EvalReport.model_fields})
    return package(
        checkpoint=qc, recipe=load_recipe(recipe), evaluation=report, verdict=ev.verdict,
        out=out, source=src, sign_key=sign_key, sign_cert=sign_cert,
        cert_chain=tuple(cert_chain or ()), shard_size=shard_size or DEFAULT_SHARD_SIZE,
        probe=not no_probe,
    )  # fmt: skip


def verify_cmd(
    target: Annotated[
        str, typer.Argument(help="Artifact directory, or oci://HOST/REPO@sha256:… (or :TAG).")
    ],
    require_signature: Annotated[
        bool, typer.Option("--require-signature", help="Fail unless model.sig verifies.")
    ] = False,
    pubkey: Annotated[Path | None, typer.Option("--pubkey", help="EC public key (PEM).")] = None,
    cert_chain: Annotated[
        list[Path] | None,
        typer.Option(
            "--cert-chain",
            help="Certificates (PEM) the attestations' signing "
            "certificate must chain to (certificate method).",
        ),
    ] = None,  # fmt: skip
    load: Annotated[bool, typer.Option("--load", help="Also load and run the probe.")] = False,
    atol: Annotated[float, typer.Option("--atol", help="Probe logit tolerance.")] = 0.05,
    serve: Annotated[
        str | None,
        typer.Option(
            "--serve",
            help="Also serve it (vllm | transformers) on the held-out "
            "tokens evaluate measured and compare (exit 4 beyond the recipe's "
            "serve: limits, or the defaults).",
        ),
    ] = None,  # fmt: skip
    serve_kv: Annotated[
        str | None,
        typer.Option(
            "--serve-kv",
            help="KV-cache dtype to serve with: auto | fp8 | bfloat16 "
            "(default: the recipe's serve.kv_cache_dtype, else auto).",
        ),
    ] = None,  # fmt: skip
    perf: Annotated[
        bool,
        typer.Option(
            "--perf",
            help="With --serve vllm: also measure served speed and memory with vLLM's own "
            "benchmark on the recipe's serve.workloads, beside the 16-bit --reference "
            "(exit 4 below the recipe's serve.gates).",
        ),
    ] = False,
    reference: Annotated[
        Path | None,
        typer.Option(
            "--reference",
            help="The 16-bit model this artifact was made from "
            "(a folder; held against the artifact's provenance), for --perf and the "
            "recipe's serve.long_context.",
        ),
    ] = None,  # fmt: skip
    raw_dir: Annotated[
        Path | None,
        typer.Option(
            "--perf-raw",
            help="Keep each benchmark pass's raw JSON and the "
            "server logs here, written as they complete.",
        ),
    ] = None,  # fmt: skip
    device: DeviceOpt = None,
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> VerifyReport:
    """The pre-deploy gate: checksums, file set, records, weights vs config, signature;
    with --serve, the served model against the measured one; with --perf, what it buys in
    served speed and memory."""
    from ..artifact.verify import verify

    if target.startswith("oci://"):
        if serve is not None:
            raise UsageError("--serve runs on a folder: pull it first", path="--serve")
        from ..artifact.oci import verify_remote

        return verify_remote(target, require_signature=require_signature, pubkey=pubkey,
                             load=load, atol=atol, cert_chain=list(cert_chain or []))  # fmt: skip
    artifact = Path(target)
    if perf and (serve != "vllm" or reference is None):
        raise UsageError("--perf needs --serve vllm and --reference MODEL_DIR", path="--perf",
                         hint="pass the 16-bit model the artifact was quantized from")  # fmt: skip
    report = verify(artifact, require_signature=require_signature, pubkey=pubkey, load=load,
                    atol=atol, cert_chain=list(cert_chain or []))  # fmt: skip
    if serve is None:
        return report
    if reference is not None:
        _same_source(artifact, reference)
    # every served gate runs and is reported, then the first failure names them all: an
    # engine start is minutes of GPU time, and a CI job needs every figure of the artifact
    steps: list[Step] = [lambda r: _serve_check(artifact, r, serve, serve_kv, device)]
    if reference is not None:
        steps.append(lambda r: _long_context(artifact, r, reference, serve, serve_kv, device))
        if perf:
            steps.append(lambda r: _perf(artifact, r, reference, raw_dir))
    return _all_gates(report, steps)


def _all_gates(report: VerifyReport, steps: list[Step]) -> VerifyReport:
    """Run each step (report -> report, GateFailed carrying its report), then raise the
    first failure with every failure's message and the report holding all the figures."""
    from ..errors import GateFailed

    failed: list[GateFailed] = []
    for step in steps:
        try:
            report = step(report)
        except GateFailed as e:
            failed.append(e)
            report = e.result if e.result is not None else report
    if failed:
        first = failed[0]
        raise GateFailed(" · ".join(e.message for e in failed), path=first.path,
                         hint=first.hint, result=report)  # fmt: skip
    return report


def _same_source(artifact: Path, reference: Path) -> None:
    from ..artifact.verify import read_provenance
    from ..evaluate.engine import model_ref

    src = read_provenance(artifact).source
    ref_hash = model_ref(reference).model_hash
    if src is not None and src.model_hash != ref_hash:
        raise UsageError(f"{reference} is not the model this artifact was quantized from "
                         f"(model hash {ref_hash[:12]}, provenance {src.model_hash[:12]})",
                         path="--reference", hint="pass the source model's folder (as "
                         "`qship fetch` wrote it)")  # fmt: skip


def _long_context(
    artifact: Path, report: VerifyReport, reference: Path, engine: str, kv: str | None,
    device: str | None,
) -> VerifyReport:  # fmt: skip
    """The recipe's serve.long_context, when it has one: retrieval at long context as
    served beside the reference (exit 4 beyond its max_drop)."""
    from .. import gate
    from ..artifact.verify import read_eval
    from ..errors import GateFailed
    from ..evaluate.long_context import check_artifact
    from ..recipe import load_recipe

    r = load_recipe(artifact / "recipe.yaml")
    if r.serve is None or r.serve.long_context is None:
        return report
    sg = r.serve.model_copy(
        update={"engine": engine, "kv_cache_dtype": kv or r.serve.kv_cache_dtype}
    )
    measured = read_eval(artifact).measured
    lc = check_artifact(artifact, reference, sg, r.calibration.source, device=device,
                        attention=measured.attention if measured else "kv-only")  # fmt: skip
    report = report.model_copy(update={"long_context": lc})
    failed = [c for c in gate.long_context_checks(lc) if not c.passed]
    if failed:
        raise GateFailed("long-context retrieval as served fell beyond serve.long_context."
                         "max_drop: " + "; ".join(lc.failures), path=str(artifact / "recipe.yaml"),
                         hint=_long_context_hint(lc), result=report)  # fmt: skip
    return report


def _long_context_hint(lc: LongContextCheck) -> str:
    if lc.kv_cache_at_fault():
        return (
            "the quantized KV cache loses it (with a 16-bit one it holds): a 16-bit KV "
            "cache (kv_cache: null), calibrated per-head scales (kv_cache.strategy: "
            "attn_head) or 16-bit KV on chosen layers (kv_cache.skip_layers)"
        )
    return (
        "the weights lose it (a 16-bit KV cache does not bring it back, see the figure "
        "beside each length): more bits per weight where it matters (`qship tune`), or, "
        "where the reference itself retrieves rarely, more serve.long_context.trials"
    )


def _perf(artifact: Path, report: VerifyReport, reference: Path, raw: Path | None) -> VerifyReport:
    """Served speed beside the reference; exit 4 below the recipe's serve.gates."""
    from .. import gate
    from ..errors import GateFailed
    from ..evaluate import perf
    from ..recipe import ServeGate, load_recipe

    sg = load_recipe(artifact / "recipe.yaml").serve or ServeGate()
    # the served check ran first (it walked vLLM's modules): its Linears per kernel
    counts = report.served.kernel_counts() if report.served else None
    from ..artifact.verify import read_provenance
    from ..io.cache import StageCache
    from .common import cache_root

    source = read_provenance(artifact).source  # its model hash: the reference's (_same_source)
    res = perf.measure(artifact, reference, sg, perf.runner_for("vllm")(), raw_dir=raw,
                       kernel_counts=counts, ref_cache=perf.ReferenceCache(StageCache(cache_root())),
                       reference_hash=source.model_hash if source else None)  # fmt: skip
    report = report.model_copy(update={"served_perf": res})
    checks = gate.speed_checks(res, sg.gates)
    failed = [c for c in checks if not c.passed]
    if failed:
        raise GateFailed(
            "served speed below the recipe's serve.gates: "
            + "; ".join(f"{c.name} = {c.value:.3g} (limit {c.op} {c.limit:.3g})" for c in failed),
            path=str(artifact / "recipe.yaml"),
            hint="a faster format for this workload (see `qship compare --serve vllm`), or "
            "relax serve.gates",
            result=report,
        )
    return report


def _serve_check(
    artifact: Path, report: VerifyReport, engine: str, kv: str | None, device: str | None
) -> VerifyReport:
    """After the integrity checks passed: the served check with the artifact's own
    recipe limits (`serve:`), else the defaults (exit 4 on failure)."""
    from ..artifact.package import MEASURED_IN_ARTIFACT
    from ..errors import GateFailed
    from ..evaluate.served import run_check
    from ..recipe import ServeGate, load_recipe

    sg = load_recipe(artifact / "recipe.yaml").serve or ServeGate()
    # the engine named here (an unknown name is engines.make's usage error); the limits
    # are the recipe's
    sg = sg.model_copy(update={"engine": engine, "kv_cache_dtype": kv or sg.kv_cache_dtype})
    from ..artifact.verify import read_eval

    ev = read_eval(artifact)
    measured = ev.measured  # its sha256: the file must be what was measured
    chk = run_check(artifact, artifact / MEASURED_IN_ARTIFACT, sg, device=device,
                    sha256=measured.sha256 if measured else None,
                    kv_share=ev.kv_cache_share)  # fmt: skip
    report = report.model_copy(update={"served": chk})
    if not chk.passed:
        raise GateFailed(
            "the served model differs from the measured one: " + "; ".join(chk.failures),
            path=str(artifact / MEASURED_IN_ARTIFACT),
            hint="do not deploy: the engine serves other numbers than eval.json claims (a "
            "corrupted or altered artifact, or an engine/version that computes differently)",
            result=report,
        )
    return report


def publish_cmd(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    to: Annotated[
        str, typer.Option("--to", help="file:///abs/registry, hf://org/name or oci://HOST/REPO:TAG")
    ],
    name: Annotated[str | None, typer.Option("--name", help="Registry name.")] = None,
    version: Annotated[str | None, typer.Option("--version", help="Registry version.")] = None,
    require_signature: Annotated[bool, typer.Option("--require-signature")] = False,
    pubkey: Annotated[Path | None, typer.Option("--pubkey", help="EC public key (PEM).")] = None,
    endpoint: Annotated[str | None, typer.Option("--endpoint", help="Hub endpoint URL.")] = None,
    layout: Annotated[
        str,
        typer.Option(
            "--as",
            help="oci:// only: artifact (a layer per file) or modelcar (a "
            "KServe Modelcar image, the files under /models).",
        ),
    ] = "artifact",  # fmt: skip
    as_json: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> PublishResult:
    """Publish a gated, verified artifact to a local registry or the Hub."""
    from ..artifact.publish import publish

    return publish(artifact, to, name=name, version=version, pubkey=pubkey,
                   require_signature=require_signature, endpoint=endpoint, layout=layout)  # fmt: skip
