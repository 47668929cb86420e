"""The `qship` command line: parses arguments, calls the Python API, prints the result.

Exit codes (the CI contract, README): 0 ok, 1 unexpected, 2 usage/recipe, 3 integrity,
4 quality gate. A command returns its result record; `main` prints exactly one JSON object
on stdout with `--json` in every outcome (a failure: the error, with the result the command
had when it failed under "result"), or a summary on stderr for people. Library output goes
to a log file (qship run: <out>.report/run.log; other commands: <cache>/logs/qship.log)
unless `-v`.
"""

from __future__ import annotations

import json
import sys
import traceback
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from .. import log
from ..errors import QshipError
from .artifact import package_cmd, publish_cmd, verify_cmd
from .common import OneLineJson, default_log
from .compare import compare_cmd, sensitivity_cmd, tune_cmd
from .evaluate import evaluate_cmd
from .fetch import fetch_cmd
from .quantize import plan_cmd, quantize_cmd
from .run import run_cmd


@dataclass
class State:
    verbose: bool = False


STATE = State()

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Quantize, evaluate, gate, package and verify Hugging Face causal LMs.",
)


@app.callback()
def _options(
    verbose: Annotated[
        bool, typer.Option("-v", "--verbose", help="Show library output and qship's details.")
    ] = False,
) -> None:
    STATE.verbose = verbose


for _name, _fn in (
    ("run", run_cmd),
    ("fetch", fetch_cmd),
    ("plan", plan_cmd),
    ("quantize", quantize_cmd),
    ("evaluate", evaluate_cmd),
    ("package", package_cmd),
    ("verify", verify_cmd),
    ("publish", publish_cmd),
    ("compare", compare_cmd),
    ("sensitivity", sensitivity_cmd),
    ("tune", tune_cmd),
):
    app.command(_name)(_fn)


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"


def emit(result: Any, as_json: bool) -> None:
    if result is None:
        return
    if isinstance(result, OneLineJson):
        sys.stdout.write(json.dumps(result, separators=(",", ":")) + "\n")
        return
    data = result.to_json() if hasattr(result, "to_json") else result
    if as_json:
        sys.stdout.write(_json(data))
    elif hasattr(result, "summary"):
        log.info(str(result.summary()))
    else:
        log.console().print_json(json.dumps(data, default=str))


def _fail(data: dict[str, Any], text: str, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(_json(data))
    log.info(f"error: {text}", style="red")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and map exceptions to the documented exit codes."""
    import click
    import typer

    # typer >= 0.25 raises its own vendored click's exceptions (TyperException), not click's
    usage_errors = (click.exceptions.ClickException, click.exceptions.Abort,
                    typer.exceptions.TyperException, typer.Abort)  # fmt: skip
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    verbose = bool({"-v", "--verbose"} & set(args[: next(
        (i for i, a in enumerate(args) if not a.startswith("-")), len(args))]))  # fmt: skip
    STATE.verbose = verbose
    logfile = default_log()
    try:
        with log.third_party_to(logfile, verbose=verbose):
            try:
                result = app(args=args, standalone_mode=False)
            except Exception as e:
                if not isinstance(
                    e, (QshipError, click.exceptions.Exit, typer.Exit, *usage_errors)
                ):
                    traceback.print_exc()  # into the log (the terminal with -v)
                raise
        emit(result if not isinstance(result, int) else None, as_json)
        return 0
    except QshipError as e:
        data = e.to_json()
        if e.result is not None and hasattr(e.result, "to_json"):
            data["result"] = e.result.to_json()
        _fail(data, str(e), as_json)
        return e.exit_code
    except (click.exceptions.Exit, typer.Exit) as e:
        return int(e.exit_code or 0)
    except usage_errors as e:
        fmt = getattr(e, "format_message", None)
        msg = fmt() if callable(fmt) else "aborted"
        _fail({"error": type(e).__name__, "exit_code": 2, "message": msg}, msg, as_json)
        return 2
    except Exception as e:  # noqa: BLE001 - the contract maps anything else to 1
        where = "" if verbose else f" (traceback in {logfile})"
        data = {"error": type(e).__name__, "exit_code": 1, "message": str(e)}
        _fail(data, f"{type(e).__name__}: {e}{where}", as_json)
        return 1


if __name__ == "__main__":
    sys.exit(main())
