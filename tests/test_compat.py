"""pipeline/compat: every library attribute qship replaces or reads privately is a row of
its table, checked against the installed (pinned) libraries; nothing outside the package
touches one; a replacement is refused when the library changed and is undone after."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pipeline.compat import table
from pipeline.compat.patching import check, check_all, patched, row
from pipeline.errors import StageError

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = ROOT / "pipeline"
LIBRARIES = ("llmcompressor", "compressed_tensors", "transformers", "torch")


def test_every_row_matches_the_pinned_libraries():
    assert check_all() == []


@pytest.mark.parametrize("p", table.PATCHES, ids=lambda p: p.target)
def test_every_row_says_why_and_names_a_test_that_exists(p):
    assert p.why and p.kind in ("replace", "override", "read", "state", "private")
    path, _, name = p.test.partition("::")
    src = (ROOT / path).read_text()
    assert re.search(rf"^def {re.escape(name.split()[0])}\(", src, re.M), p.test


def test_every_target_named_in_the_package_is_a_row():
    """A target string written out in pipeline/compat is a row, or the holder part of rows
    (patched() refuses any target that is not a row at run time; this finds it before)."""
    rows = {p.target for p in table.PATCHES}
    named = set()
    for f in (PIPELINE / "compat").glob("*.py"):
        named |= set(re.findall(r'"((?:llmcompressor|compressed_tensors|transformers)[\w.]*:'
                                r'[\w.]+)"', f.read_text()))  # fmt: skip
    stray = {n for n in named if n not in rows and not any(r.startswith(n + ".") for r in rows)}
    assert named and not stray, stray


def test_a_target_not_in_the_table_is_refused():
    with pytest.raises(StageError, match="not in pipeline/compat/table.py"):
        row("llmcompressor.core:LifecycleCallbacks.no_such_thing")


def test_a_changed_library_is_refused_naming_it_and_its_version(monkeypatch):
    """Missing, or taking other parameters (a changed llm-compressor), is exit 1 naming the
    library and its version -- never a patch that silently does nothing."""
    import llmcompressor.pipelines.cache as cache_mod

    target = "llmcompressor.pipelines.cache:IntermediatesCache.pin_memory"

    class Fake:  # what a future llm-compressor might ship instead
        def pin_memory(self, batch_index, names, non_blocking=False):
            return None

    monkeypatch.setattr(cache_mod, "IntermediatesCache", Fake)
    with pytest.raises(StageError) as e, patched(target, None):
        pass
    assert e.value.exit_code == 1 and "llmcompressor 0.14.0.1" in e.value.message
    assert "pin_memory takes (self, batch_index, names, non_blocking)" in e.value.message
    del Fake.pin_memory
    with pytest.raises(StageError, match="has no Fake.pin_memory"), patched(target, None):
        pass

    def pin_memory(self, batch_index, input_names=None):  # the pinned library's parameters
        return "pinned"

    Fake.pin_memory = pin_memory  # type: ignore[attr-defined]
    with patched(target, lambda self, batch_index, input_names=None: None):
        assert Fake().pin_memory(0) is None  # replaced inside the block
    assert Fake().pin_memory(0) == "pinned"  # restored after it


def test_a_replacement_is_undone_when_the_block_fails():
    from llmcompressor.utils import helpers

    target = "llmcompressor.utils.helpers:use_eager_attention"
    before = check(target)
    with pytest.raises(ZeroDivisionError), patched(target, lambda model: None):
        assert helpers.use_eager_attention is not before
        _ = 1 / 0
    assert helpers.use_eager_attention is before


def _library_names(tree: ast.Module) -> set[str]:
    """Names a module binds to a library's modules or objects by import."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARIES:
                    names.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in LIBRARIES:
                names |= {a.asname or a.name for a in node.names}
    return names


def _qship_private_names(pipeline: Path) -> set[str]:
    """Private names qship itself defines: functions, methods, class attributes, the
    attributes its classes set on self, and qship's own marks on library objects."""
    names = set()
    for f in pipeline.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):  # fmt: skip
                names.add(node.attr)
    return {n for n in names if n.startswith("_")}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_qship")


def _outside_compat(pipeline: Path) -> list[Path]:
    return [f for f in pipeline.rglob("*.py") if "compat" not in f.relative_to(pipeline).parts]


def private_uses(pipeline: Path) -> list[str]:
    """`x._name` (x not self / cls / super()), getattr / setattr / hasattr of a "_name"
    string and `__dict__["_name"]` outside pipeline/compat, `_name` not one qship defines."""
    own = _qship_private_names(pipeline)
    found = []
    for f in _outside_compat(pipeline):
        for node in ast.walk(ast.parse(f.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                base = node.value
                mine = (isinstance(base, ast.Name) and base.id in ("self", "cls")) or (
                    isinstance(base, ast.Call) and getattr(base.func, "id", "") == "super"
                )
                name = None if mine else node.attr
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") in
                  ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant)):  # fmt: skip
                name = str(node.args[1].value)
            elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                  and node.value.attr == "__dict__" and isinstance(node.slice, ast.Constant)):  # fmt: skip
                name = str(node.slice.value)
            if name and _is_private(name) and name not in own:
                found.append(f"{f.relative_to(pipeline.parent)}:{node.lineno}: {name}")
    return found


def replacements(pipeline: Path) -> list[str]:
    """Outside pipeline/compat: assignments to, setattr on or patch_attr of anything a
    module imported from a library, and patched() calls."""
    found = []
    for f in _outside_compat(pipeline):
        tree = ast.parse(f.read_text())
        lib = _library_names(tree)
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                        and t.value.id in lib):  # fmt: skip
                    where = f"{f.relative_to(pipeline.parent)}:{node.lineno}"
                    found.append(f"{where}: {t.value.id}.{t.attr} =")
            if isinstance(node, ast.Call):
                fn = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                first = node.args[0] if node.args else None
                on_lib = isinstance(first, ast.Name) and first.id in lib
                if fn in ("patch_attr", "patched") or (fn == "setattr" and on_lib):
                    found.append(f"{f.relative_to(pipeline.parent)}:{node.lineno}: {fn}(...)")
    return found


def test_nothing_outside_compat_touches_a_library_private_attribute():
    assert private_uses(PIPELINE) == []


def test_nothing_outside_compat_replaces_a_library_attribute():
    assert replacements(PIPELINE) == []


def test_the_scans_find_what_they_are_for(tmp_path):
    """They flag the kind of site issue 55 found (numerics.py's write into transformers'
    _local_mapping, a module attribute of llm-compressor replaced), had it stayed."""
    bad = tmp_path / "pipeline" / "evaluate"
    bad.mkdir(parents=True)
    (bad / "x.py").write_text(
        "import llmcompressor.utils.helpers as helpers\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry\n"
        "def f(fn):\n"
        "    registry._local_mapping['sdpa'] = fn\n"
        "    helpers.use_eager_attention = fn\n"
        "    setattr(helpers, 'use_eager_attention', fn)\n"
    )
    assert private_uses(tmp_path / "pipeline") == ["pipeline/evaluate/x.py:4: _local_mapping"]
    assert replacements(tmp_path / "pipeline") == [
        "pipeline/evaluate/x.py:5: helpers.use_eager_attention =",
        "pipeline/evaluate/x.py:6: setattr(...)",
    ]
