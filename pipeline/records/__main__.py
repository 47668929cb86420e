"""Render docs/RECORDS.md from the record classes: `python -m pipeline.records > docs/RECORDS.md`
(tests/test_records.py checks the committed file is current)."""

from __future__ import annotations

import re
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel

from . import (
    artifact,
    attestation,
    benchmarks,
    checkpoint,
    estimate,
    evaluation,
    perf,
    plan,
    run,
    served,
    snapshot,
    tokens,
    verdict,
)
from .base import SCHEMA_VERSION

# (module, its top record) in pipeline order; each record's nested records follow it
SECTIONS = [
    (snapshot, "Snapshot", "fetch → every stage", "stage.json of a fetch cache entry"),
    (tokens, "TokenSetInfo", "tokens → quantize, evaluate", "inside QuantizedCheckpoint"),
    (plan, "Plan", "quantize (and `qship plan`)", "plan.json in the report folder"),
    (checkpoint, "QuantizedCheckpoint", "quantize → evaluate, package", "quantize_report.json"),
    (evaluation, "EvalReport", "evaluate → gate, package", "eval.json (as EvalFile)"),
    (evaluation, "EvalFile", "report folder, artifact, compare", "eval.json"),
    (verdict, "Verdict", "gate → package, run.json", "inside eval.json and run.json"),
    (artifact, "Provenance", "package", "provenance.json"),
    (
        attestation,
        "QuantResults",
        "package → a deploy system's policy",
        "predicate of attestation/results.json (`urn:qship:predicate:results:v1`)",
    ),
    (artifact, "Artifact", "package → publish", "`qship package --json`"),
    (artifact, "VerifyReport", "verify", "`qship verify --json`"),
    (artifact, "PublishResult", "publish", "`qship publish --json`"),
    (run, "RunRecord", "the runner", "run.json"),
]


def _type(ann: Any) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin in (types.UnionType, typing.Union):
        return " \\| ".join(_type(a) for a in args)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type(a) for a in args)}]"
    if ann is type(None):
        return "null"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        if ann not in _all():  # a recipe type (pipeline.recipe): named, documented there
            return ann.__name__
        return f"[{ann.__name__}](#{ann.__name__.lower()})"
    return getattr(ann, "__name__", str(ann))


def _nested(cls: type[BaseModel], seen: set[str]) -> list[type[BaseModel]]:
    out = []
    for f in cls.model_fields.values():
        for name in re.findall(r"\[(\w+)\]\(#", _type(f.annotation)):
            sub = next((m for m in _all() if m.__name__ == name), None)
            if sub is not None and name not in seen:
                seen.add(name)
                out += [sub, *_nested(sub, seen)]
    return out


def _all() -> list[type[BaseModel]]:
    mods = (snapshot, tokens, plan, estimate, checkpoint, evaluation, benchmarks, perf, served,
            verdict, artifact, attestation, run)  # fmt: skip
    return [
        v
        for m in mods
        for v in vars(m).values()
        if isinstance(v, type) and issubclass(v, BaseModel) and v.__module__ == m.__name__
    ]


def _table(cls: type[BaseModel]) -> list[str]:
    doc = (cls.__doc__ or "").strip()
    lines = [f"### {cls.__name__}", ""]
    if doc and not doc.startswith("!!!") and "Usage docs" not in doc:
        lines += [" ".join(doc.split()), ""]
    lines += ["| field | type | meaning |", "|---|---|---|"]
    for name, f in cls.model_fields.items():
        desc = " ".join((f.description or "").split()).replace("|", "\\|")
        lines.append(f"| `{name}` | {_type(f.annotation)} | {desc} |")
    for name in cls.model_computed_fields:
        lines.append(f"| `{name}` | derived | computed when written (not read back) |")
    return [*lines, ""]


def render() -> str:
    out = [
        "# Records",
        "",
        "The typed records the stages hand each other, and the JSON files qship writes from "
        f"them (schema_version {SCHEMA_VERSION}). Generated from pipeline/records/ by "
        "`python -m pipeline.records > docs/RECORDS.md`; do not edit by hand.",
        "",
    ]
    seen: set[str] = set()
    for module, name, flow, where in SECTIONS:
        cls = getattr(module, name)
        if name in seen:
            continue
        seen.add(name)
        out += [f"## {name}", "", f"Flow: {flow}. Stored as: {where}.", ""]
        for c in [cls, *_nested(cls, seen)]:
            out += _table(c)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
