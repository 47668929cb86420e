"""The records are documented field by field, and every JSON file qship writes reads back."""

from __future__ import annotations

import json

from pydantic import BaseModel

from pipeline.records import __main__ as records_doc


def test_records_doc_is_current(repo_root):
    doc = (repo_root / "docs" / "RECORDS.md").read_text()
    assert doc == records_doc.render(), "run: python -m pipeline.records > docs/RECORDS.md"


def test_every_field_is_documented():
    missing = [
        f"{cls.__name__}.{name}"
        for cls in records_doc._all()
        for name, f in cls.model_fields.items()
        if not (f.description or "").strip()
    ]
    assert missing == []


def test_files_of_a_real_artifact_read_back(packaged_artifact):
    """eval.json and provenance.json of an artifact parse as their records and write back
    to the same JSON (no field lost or invented)."""
    from pipeline.records import EvalFile, Provenance

    for name, cls in (("eval.json", EvalFile), ("provenance.json", Provenance)):
        data = json.loads((packaged_artifact / name).read_text())
        rec = cls.from_json(data)
        assert isinstance(rec, BaseModel) and rec.to_json() == data
        assert data["schema_version"] == 1
