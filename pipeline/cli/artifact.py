"""qship package, qship verify, qship publish"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..errors import UsageError
from ..records.artifact import Artifact, PublishResult, VerifyReport
from .common import JsonOpt


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
    shard_size: Annotated[int, typer.Option("--shard-size", help="Max bytes per shard.")] = 0,
    no_probe: Annotated[
        bool, typer.Option("--no-probe", help="Skip the fp32 CPU load-probe fingerprint.")
    ] = False,
    as_json: JsonOpt = False,
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
        out=out, source=src, sign_key=sign_key, shard_size=shard_size or DEFAULT_SHARD_SIZE,
        probe=not no_probe,
    )  # fmt: skip


def verify_cmd(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    require_signature: Annotated[
        bool, typer.Option("--require-signature", help="Fail unless model.sig verifies.")
    ] = False,
    pubkey: Annotated[Path | None, typer.Option("--pubkey", help="EC public key (PEM).")] = None,
    load: Annotated[bool, typer.Option("--load", help="Also load and run the probe.")] = False,
    atol: Annotated[float, typer.Option("--atol", help="Probe logit tolerance.")] = 0.05,
    as_json: JsonOpt = False,
) -> VerifyReport:
    """The pre-deploy gate: checksums, file set, records, weights vs config, signature."""
    from ..artifact.verify import verify

    return verify(artifact, require_signature=require_signature, pubkey=pubkey, load=load,
                  atol=atol)  # fmt: skip


def publish_cmd(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    to: Annotated[str, typer.Option("--to", help="file:///abs/registry or hf://org/name")],
    name: Annotated[str | None, typer.Option("--name", help="Registry name.")] = None,
    version: Annotated[str | None, typer.Option("--version", help="Registry version.")] = None,
    require_signature: Annotated[bool, typer.Option("--require-signature")] = False,
    pubkey: Annotated[Path | None, typer.Option("--pubkey", help="EC public key (PEM).")] = None,
    endpoint: Annotated[str | None, typer.Option("--endpoint", help="Hub endpoint URL.")] = None,
    as_json: JsonOpt = False,
) -> PublishResult:
    """Publish a gated, verified artifact to a local registry or the Hub."""
    from ..artifact.publish import publish

    return publish(artifact, to, name=name, version=version, pubkey=pubkey,
                   require_signature=require_signature, endpoint=endpoint)  # fmt: skip
