"""The base of every record: frozen, strict, one way to and from JSON.

Fields are documented by the docstring under each of them (pydantic's attribute
docstrings); `python -m pipeline.records` renders them all to docs/RECORDS.md.
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ..errors import QshipError, UsageError

SCHEMA_VERSION = 1  # of the JSON files qship writes (eval.json, provenance.json, run.json)


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _derived_fields_are_not_inputs(cls, data: Any) -> Any:
        """A computed field (Verdict.failed) is written for readers and recomputed on read."""
        if isinstance(data, dict) and cls.model_computed_fields:
            return {k: v for k, v in data.items() if k not in cls.model_computed_fields}
        return data

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, data: Any, *, where: str = "", error: type[QshipError] = UsageError) -> Self:
        """Parse a record; a malformed one raises `error` naming the file and the field."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "<top level>"
            raise error(
                f"not a valid {cls.__name__} record: field `{field}`: {first['msg']}"
                + (f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""),
                path=where or None,
                hint=f"give a {cls.__name__} file written by this version of qship "
                "(docs/RECORDS.md)",
            ) from None
