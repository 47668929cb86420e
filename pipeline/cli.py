"""The `qship` command line: parses arguments and calls the Python API, nothing more.

Exit codes (the CI contract, DESIGN.md): 0 ok, 1 unexpected, 2 usage/recipe,
3 integrity, 4 quality gate. `--json` prints one machine-readable object on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from .errors import QshipError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Quantize, evaluate, gate, package and verify Hugging Face causal LMs.",
)
# Human-readable progress goes to stderr so that `--json` stdout stays parseable.
console = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print a JSON result on stdout.")]
CacheOpt = Annotated[
    Path | None,
    typer.Option("--cache-dir", help="Stage cache (default $QSHIP_CACHE or ~/.cache/qship)."),
]


def cache_root(cache_dir: Path | None) -> Path:
    if cache_dir is not None:
        return cache_dir
    env = os.environ.get("QSHIP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "qship"


def emit(result: Any, as_json: bool) -> None:
    """Print a stage result: JSON on stdout for CI, or its summary for people."""
    data = result.to_json() if hasattr(result, "to_json") else result
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    elif hasattr(result, "summary"):
        console.print(result.summary())
    else:
        console.print_json(json.dumps(data, default=str))


# --- commands begin (each stage adds its command below; keep them thin) ---


# package / verify / publish (pipeline.package, pipeline.verify, pipeline.publish)


def _read_json_arg(path: Path, what: str) -> dict:
    from .errors import UsageError

    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {what} JSON ({e})", path=str(path)) from e
    if not isinstance(obj, dict):
        raise UsageError(f"{what} must be a JSON object", path=str(path))
    return obj


@app.command("package")
def package_cmd(
    model_dir: Annotated[Path, typer.Option("--model-dir", help="Quantized checkpoint dir.")],
    recipe: Annotated[str, typer.Option("--recipe", help="Resolved recipe YAML file.")],
    eval_path: Annotated[
        Path, typer.Option("--eval", help="evaluate's JSON; holds 'verdict' unless --verdict.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Artifact directory to create.")],
    verdict_path: Annotated[
        Path | None, typer.Option("--verdict", help="Gate verdict JSON.")
    ] = None,
    provenance_path: Annotated[
        Path | None, typer.Option("--provenance", help="Provenance JSON (source, hashes...).")
    ] = None,
    sign_key: Annotated[
        Path | None, typer.Option("--sign-key", help="EC private key (PEM) to sign with.")
    ] = None,
    shard_size: Annotated[int, typer.Option("--shard-size", help="Max bytes per shard.")] = 0,
    no_probe: Annotated[
        bool, typer.Option("--no-probe", help="Skip the fp32 CPU load-probe fingerprint.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Build the artifact directory (complete or absent)."""
    from .errors import UsageError
    from .package import DEFAULT_SHARD_SIZE, package

    ev = _read_json_arg(eval_path, "eval")
    verdict = _read_json_arg(verdict_path, "verdict") if verdict_path else ev.pop("verdict", None)
    if verdict is None:
        raise UsageError(
            "no verdict: add 'verdict' to the eval JSON or pass --verdict", path=str(eval_path)
        )
    prov = _read_json_arg(provenance_path, "provenance") if provenance_path else {}
    art = package(
        model_dir=model_dir,
        out=out,
        recipe_path_or_text=Path(recipe),
        eval_json=ev,
        verdict=verdict,
        provenance=prov,
        sign_key=sign_key,
        shard_size=shard_size or DEFAULT_SHARD_SIZE,
        probe=not no_probe,
    )
    emit(art, as_json)


@app.command("verify")
def verify_cmd(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    require_signature: Annotated[
        bool, typer.Option("--require-signature", help="Fail unless model.sig verifies.")
    ] = False,
    pubkey: Annotated[Path | None, typer.Option("--pubkey", help="EC public key (PEM).")] = None,
    load: Annotated[bool, typer.Option("--load", help="Also load and run the probe.")] = False,
    atol: Annotated[float, typer.Option("--atol", help="Probe logit tolerance.")] = 0.05,
    as_json: JsonOpt = False,
) -> None:
    """The pre-deploy gate: checksums, file set, safetensors headers, signature."""
    from .verify import verify

    report = verify(
        artifact, require_signature=require_signature, pubkey=pubkey, load=load, atol=atol
    )
    emit(report, as_json)


@app.command("publish")
def publish_cmd(
    artifact: Annotated[Path, typer.Argument(help="Artifact directory.")],
    to: Annotated[str, typer.Option("--to", help="file:///abs/registry or hf://org/name")],
    name: Annotated[str | None, typer.Option("--name", help="Registry name.")] = None,
    version: Annotated[str | None, typer.Option("--version", help="Registry version.")] = None,
    require_signature: Annotated[bool, typer.Option("--require-signature")] = False,
    pubkey: Annotated[Path | None, typer.Option("--pubkey", help="EC public key (PEM).")] = None,
    endpoint: Annotated[str | None, typer.Option("--endpoint", help="Hub endpoint URL.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Publish a gated, verified artifact to a local registry or the Hub."""
    from .publish import publish

    res = publish(
        artifact,
        to,
        name=name,
        version=version,
        pubkey=pubkey,
        require_signature=require_signature,
        endpoint=endpoint,
    )
    emit(res, as_json)


# plan / quantize (pipeline.recipe, pipeline.plan, pipeline.calibration, pipeline.quantize)


@app.command("plan")
def plan_cmd(
    model: Annotated[Path, typer.Option("--model", help="Local checkpoint directory.")],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML.")],
    as_json: JsonOpt = False,
) -> None:
    """Show every Linear module's group, method and scheme, the AWQ mappings and the size."""
    from .plan import plan_for_dir
    from .recipe import load_recipe

    emit(plan_for_dir(model, load_recipe(recipe)), as_json)


@app.command("quantize")
def quantize_cmd(
    model: Annotated[Path, typer.Option("--model", help="Local checkpoint directory.")],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML.")],
    out: Annotated[Path, typer.Option("--out", help="Output directory (must not exist).")],
    device: Annotated[
        str | None, typer.Option("--device", help="cuda / cpu (default: GPU if present).")
    ] = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Calibrate, quantize and save a compressed-tensors checkpoint, checked against the plan."""
    from transformers import AutoTokenizer

    from .calibration import build_token_sets
    from .plan import load_meta_model
    from .quantize import quantize
    from .recipe import load_recipe
    from .recipe import validate_for_model as _validate

    r = load_recipe(recipe)
    _validate(r, load_meta_model(model))  # invalid recipe: exit 2 before any compute
    tokens = build_token_sets(
        AutoTokenizer.from_pretrained(model),
        r.calibration,
        r.evaluation,
        cache_dir=cache_root(cache_dir),
    )
    emit(quantize(model, r, out, token_sets=tokens, device=device), as_json)


# compare (pipeline.compare, pipeline.report)


@app.command("compare")
def compare_cmd(
    items: Annotated[
        list[Path] | None, typer.Argument(help="More recipes (or, with --collect, more dirs).")
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="Source model (as for run).")] = None,
    recipes: Annotated[
        list[Path] | None, typer.Option("--recipes", help="Recipe YAMLs: --recipes R1 R2 …")
    ] = None,
    out: Annotated[Path, typer.Option("--out", help="Report directory.")] = Path("compare"),
    matrix: Annotated[
        bool, typer.Option("--matrix", help="Print a GitHub Actions matrix, one job per recipe.")
    ] = False,
    collect: Annotated[
        list[Path] | None,
        typer.Option("--collect", help="Merge eval.json files under DIR… (CI jobs' results)."),
    ] = None,
    device: Annotated[str | None, typer.Option("--device", help="cuda / cpu.")] = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Compare recipes on one model: md/json/csv/html report with plots; CI matrix/collect."""
    from . import compare as cmp
    from .errors import UsageError

    if matrix:
        mx = cmp.matrix((recipes or []) + (items or []))
        sys.stdout.write(json.dumps(mx, separators=(",", ":")) + "\n")
        return
    if collect:
        res = cmp.collect(collect + (items or []), out)
    else:
        if not model:
            raise UsageError("--model is required (or use --matrix / --collect)", path="--model")
        res = cmp.compare(
            model,
            cmp.recipe_paths((recipes or []) + (items or [])),
            out,
            cache_dir=cache_root(cache_dir),
            device=device,
        )
    emit(res, as_json)
    res.require_pass()


# sensitivity (pipeline.sensitivity)


@app.command("sensitivity")
def sensitivity_cmd(
    model: Annotated[str, typer.Option("--model", help="Source model (as for run).")],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML (schemes, held-out set).")],
    sequences: Annotated[
        int | None, typer.Option("--sequences", help="Score only the first N held-out sequences.")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the result JSON here.")] = None,
    write_recipe: Annotated[
        Path | None,
        typer.Option(
            "--write-recipe", help="Write the recipe with the most sensitive modules at int8."
        ),
    ] = None,
    max_bits: Annotated[
        float | None, typer.Option("--max-bits", help="Bits-per-weight budget for --write-recipe.")
    ] = None,
    device: Annotated[str | None, typer.Option("--device", help="cuda / cpu.")] = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """KL when each quantized module alone is rounded (RTN): where the bits matter."""
    from contextlib import redirect_stdout

    from .sensitivity import run

    with redirect_stdout(sys.stderr):
        res = run(
            model,
            recipe,
            cache_dir=cache_root(cache_dir),
            device=device,
            sequences=sequences,
            out=out,
            write_recipe=write_recipe,
            max_bits=max_bits,
        )
    emit(res, as_json)


# evaluate (pipeline.evaluate, pipeline.gate)


@app.command("evaluate")
def evaluate_cmd(
    reference: Annotated[Path, typer.Option("--reference", help="Unquantized checkpoint dir.")],
    candidate: Annotated[Path, typer.Option("--candidate", help="Quantized checkpoint dir.")],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML (evaluation + gates).")],
    out: Annotated[Path | None, typer.Option("--out", help="Where eval.json / eval.md go.")] = None,
    exact: Annotated[
        bool,
        typer.Option("--exact", help="Full-vocabulary KL, reference and candidate in lockstep."),
    ] = False,
    topk: Annotated[
        int | None,
        typer.Option("--topk", min=1, help="Reference tokens stored per position (cached mode)."),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="Compute dtype of both models: bfloat16 / float16 / float32 "
            "(default: the checkpoint's on a GPU, float32 on the CPU).",
        ),
    ] = None,
    device: Annotated[str | None, typer.Option("--device", help="cuda / cpu.")] = None,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """KL / top-1 / ppl vs the reference on held-out tokens, lm-eval scores, gate (exit 4)."""
    from transformers import AutoTokenizer

    from .calibration import build_token_sets
    from .evaluate import evaluate_and_gate, require_pass
    from .recipe import load_recipe
    from .reference_cache import DEFAULT_TOPK

    if dtype not in (None, "bfloat16", "float16", "float32"):
        from .errors import UsageError

        raise UsageError(
            f"--dtype {dtype!r} is not a compute dtype", path="--dtype",
            hint="use bfloat16, float16 or float32",
        )  # fmt: skip
    r = load_recipe(recipe)
    root = cache_root(cache_dir)
    ts = build_token_sets(
        AutoTokenizer.from_pretrained(reference), r.calibration, r.evaluation, cache_dir=root
    )
    ev = r.evaluation
    out = out or Path("out") / "eval" / candidate.name
    res, verdict = evaluate_and_gate(
        reference,
        candidate,
        gates=r.gates,
        out_dir=out,
        raise_on_fail=False,
        heldout_ids=ts.heldout_ids,
        heldout_hash=ts.heldout_hash,
        corpus={"source": ts.source, "corpus_hash": ts.corpus_hash, "recipe": str(recipe)},
        cache_dir=root,
        tasks=ev.tasks,
        hub_tasks=ev.hub_tasks,
        limit=ev.limit,
        batch_size=ev.batch_size,
        exact=exact,
        topk=topk or DEFAULT_TOPK,
        device=device,
        dtype=dtype,
    )
    if as_json:
        emit({**res.to_json(), "verdict": verdict.to_json(), "outputs": str(out)}, True)
    else:
        console.print(res.summary())
        console.print(verdict.summary())
    require_pass(verdict, out_dir=out)


# fetch (pipeline.fetch)


@app.command("fetch")
def fetch_cmd(
    source: Annotated[
        str, typer.Argument(help="hf://org/name[@rev], a folder, a .gguf, or gguf-pkg://NAME.")
    ],
    pin: Annotated[
        bool, typer.Option("--pin", help="Write the manifest of a model seen the first time.")
    ] = False,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Accept .bin/.pt/.pth weights.")
    ] = False,
    checksums: Annotated[Path, typer.Option("--checksums", help="Pinned manifests folder.")] = Path(
        "checksums"
    ),
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Download / read a model, verify every file's SHA-256, and store the snapshot."""
    from .fetch import fetch

    emit(
        fetch(
            source,
            cache_dir=cache_root(cache_dir),
            checksums_dir=checksums,
            allow_pickle=allow_pickle,
            pin=pin,
        ),
        as_json,
    )


# run (pipeline.runner)


@app.command("run")
def run_cmd(
    model: Annotated[
        str, typer.Option("--model", help="hf://org/name[@rev], a dir, a .gguf or gguf-pkg://NAME.")
    ],
    recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML.")],
    out: Annotated[Path, typer.Option("--out", help="Artifact directory (must not exist).")],
    publish_to: Annotated[
        str | None,
        typer.Option("--publish-to", help="file:///registry or hf://org/name, if the gate passes."),
    ] = None,
    sign_key: Annotated[
        Path | None, typer.Option("--sign-key", help="PEM private key to sign with.")
    ] = None,
    device: Annotated[
        str | None, typer.Option("--device", help="cuda / cpu (default: GPU if present).")
    ] = None,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Accept .bin/.pt weights.")
    ] = False,
    cache_dir: CacheOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """fetch → quantize → evaluate → gate → package (→ publish); resumable through the cache."""
    from .runner import run

    res = run(
        model,
        recipe,
        out,
        cache_dir=cache_root(cache_dir),
        publish_to=publish_to,
        sign_key=sign_key,
        device=device,
        allow_pickle=allow_pickle,
    )
    emit(res, as_json)


# --- commands end ---


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and map exceptions to the documented exit codes."""
    as_json = "--json" in (argv if argv is not None else sys.argv[1:])
    try:
        app(args=argv, standalone_mode=False)
        return 0
    except QshipError as e:
        _report(e.to_json(), str(e), as_json)
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except (typer.BadParameter, typer.Abort) as e:
        console.print(f"[red]usage error:[/] {e}")
        return 2
    except Exception as e:  # noqa: BLE001 - the contract maps anything else to 1
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            return 2
        traceback.print_exc()
        _report({"error": type(e).__name__, "exit_code": 1, "message": str(e)}, str(e), as_json)
        return 1


def _report(data: dict, text: str, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    console.print(f"[red]error:[/] {text}", highlight=False)


if __name__ == "__main__":
    sys.exit(main())
