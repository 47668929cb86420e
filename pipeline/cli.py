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
