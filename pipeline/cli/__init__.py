"""The `qship` command line: parses arguments, calls the Python API, prints the result.

Exit codes (the CI contract, README): 0 ok, 1 unexpected, 2 usage/recipe, 3 integrity,
4 quality gate, 5 transient, 130 interrupted (Ctrl-C / SIGINT), 143 terminated (SIGTERM: see
signals.py; either signal ends the command wherever it lands). A command returns its result
record; `main` prints exactly one JSON object on stdout with `--json` in every outcome (a
failure: the error, with the result the command had when it failed under "result"), or a
summary on stderr for people. `-v` and `--json` work before or after the command's name.

Library output goes to a log file (qship run: <out>.report/run.log; other commands:
<cache>/logs/qship.log) unless `-v`, but only while a command runs: parsing, `--help` and
usage errors happen before that, so click prints them where a person looks.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from .. import log
from ..errors import QshipError
from .artifact import package_cmd, publish_cmd, verify_cmd
from .common import STATE, OneLineJson, default_log
from .compare import compare_cmd, sensitivity_cmd, tune_cmd
from .evaluate import evaluate_cmd
from .fetch import fetch_cmd
from .quantize import plan_cmd, quantize_cmd
from .run import run_cmd
from .signals import exit_code as signal_exit_code
from .signals import interrupts_raise, signal_name

INTERRUPTED = 130  # the shell's code for a process ended by SIGINT (typer's on any interrupt)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: no box drawing cut to the width of a CI log
    help="Quantize, evaluate, gate, package and verify Hugging Face causal LMs.",
)


def versions_text() -> str:
    """`qship --version`: qship's own version and the engines' it runs with."""
    from ..io.cache import library_versions

    v = library_versions()
    rest = ", ".join(f"{k} {val}" for k, val in v.items() if k != "qship")
    return f"qship {v['qship']} ({rest}; python {sys.version.split()[0]})"


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(versions_text() + "\n")
        raise typer.Exit(0)


@app.callback()
def _options(
    verbose: Annotated[
        bool, typer.Option("-v", "--verbose", help="Show library output and qship's details.")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print one JSON object on stdout (also after the command)."),
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print qship's version and its engines' versions.",
        ),
    ] = False,  # fmt: skip
) -> None:
    STATE.verbose = STATE.verbose or verbose
    STATE.as_json = STATE.as_json or as_json


class _Command(TyperCommand):
    """Every subcommand: library output goes to the log only while the command itself runs,
    and an unexpected error's traceback goes there too (the terminal with -v)."""

    def invoke(self, ctx: Any) -> Any:
        from .common import cache_root

        logfile = STATE.logfile = default_log(cache_root(ctx.params.get("cache_dir")))
        with (log.third_party_to(logfile, verbose=STATE.verbose),
              log.traceback_to_log(expected=(QshipError, typer.Exit, *_usage_errors()))):  # fmt: skip
            return super().invoke(ctx)


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
    app.command(_name, cls=_Command)(_fn)


def _usage_errors() -> tuple[type[BaseException], ...]:
    # typer >= 0.25 raises its own vendored click's exceptions (TyperException)
    import click

    return (click.exceptions.ClickException, typer.exceptions.TyperException, typer.Abort)


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


def _interrupted(as_json: bool) -> int:
    code, name = signal_exit_code(), signal_name()
    what = "terminated" if name == "SIGTERM" else "interrupted"
    msg = f"{what} ({name}): nothing was published; finished stages stay in the cache"
    hint = "run the same command again: it resumes from the stage cache"
    _fail({"error": "Interrupted", "exit_code": code, "message": msg, "signal": name,
           "path": None, "hint": hint}, msg, as_json)  # fmt: skip
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and map exceptions to the documented exit codes."""
    args = list(sys.argv[1:] if argv is None else argv)
    head = args[: args.index("--")] if "--" in args else args
    as_json = "--json" in head
    STATE.verbose, STATE.as_json, STATE.logfile = False, False, None
    with interrupts_raise():
        return _main(args, as_json)


def _main(args: list[str], as_json: bool) -> int:
    try:
        result = app(args=args, standalone_mode=False)
        if isinstance(result, int) and not isinstance(result, bool):
            # an Exit: 0 after --help / --version, 130 from typer on KeyboardInterrupt
            return _interrupted(as_json) if result == INTERRUPTED else result
        emit(result, as_json)
        return 0
    except QshipError as e:
        data = e.to_json()
        if e.result is not None and hasattr(e.result, "to_json"):
            data["result"] = e.result.to_json()
        _fail(data, str(e), as_json)
        return e.exit_code
    except KeyboardInterrupt:
        return _interrupted(as_json)
    except typer.Exit as e:
        return int(e.exit_code or 0)
    except _usage_errors() as e:
        show = getattr(e, "show", None)
        if callable(show):
            show()  # click's own: the usage line, "Try 'qship X --help'", the error
        fmt = getattr(e, "format_message", None)
        msg = fmt() if callable(fmt) else "aborted"
        if as_json:
            sys.stdout.write(_json({"error": type(e).__name__, "exit_code": 2, "message": msg}))
        return 2
    except Exception as e:  # noqa: BLE001 - the contract maps anything else to 1
        where = "" if STATE.verbose else f" (traceback in {STATE.logfile or default_log()})"
        data = {"error": type(e).__name__, "exit_code": 1, "message": str(e)}
        _fail(data, f"{type(e).__name__}: {e}{where}", as_json)
        return 1


if __name__ == "__main__":
    sys.exit(main())
