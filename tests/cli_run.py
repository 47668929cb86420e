"""Run the qship CLI in-process, the way a CI job reads it: exit code + the --json object."""

from __future__ import annotations

import json

from pipeline.cli import main


def qship(capsys, *args: str) -> tuple[int, dict]:
    """Run `qship <args> --json` in-process; (exit code, the JSON it printed)."""
    capsys.readouterr()
    rc = main([*args, "--json"])
    out = capsys.readouterr().out
    data = json.loads(out) if out.strip() else {}
    if data.get("error") == "ModuleNotFoundError":  # the CLI maps it to exit 1; surface it
        raise ModuleNotFoundError(data["message"])
    return rc, data
