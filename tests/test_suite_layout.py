"""The test suite's own shape: each test module stands alone. What several modules share
lives in conftest.py (fixtures) or in helper modules (factories.py, cli_run.py, ...), so
that a module can be run, moved or deleted without breaking another."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(source: str) -> list[str]:
    """The test modules (test_*) that `source` imports, at any depth of the file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if n.split(".")[-1].startswith("test_")
                  and n.split(".")[0] in ("tests", n.split(".")[-1])]  # fmt: skip
    return found


def test_the_check_sees_every_form_of_import():
    src = (
        "from test_roles import DIMS\nimport test_cli\nfrom tests import test_fetch_gguf\n"
        "from tests.test_fetch_hub import REPO\ndef f():\n    from test_verify import resum\n"
        "from factories import recipe\nfrom tests.cli_run import qship\n"
    )
    assert imported_test_modules(src) == [
        "test_roles", "test_cli", "tests.test_fetch_gguf", "tests.test_fetch_hub",
        "test_verify",
    ]  # fmt: skip


def test_no_test_module_imports_another():
    offenders = {
        p.name: mods
        for p in sorted(TESTS.glob("test_*.py"))
        if (mods := imported_test_modules(p.read_text()))
    }
    assert offenders == {}, (
        f"test modules import other test modules: {offenders}; move what they share into "
        "tests/conftest.py (fixtures) or tests/factories.py (constants and helpers)"
    )
