"""RunRecord: run.json, the record of one `qship run`, whatever its outcome."""

from __future__ import annotations

from pathlib import Path

from .artifact import PublishResult
from .base import SCHEMA_VERSION, Record
from .verdict import Verdict


class StageRow(Record):
    stage: str
    seconds: float
    cache_hit: bool = False
    key: str | None = None
    """The stage's entry in the stage cache."""
    note: str = ""


class ErrorInfo(Record):
    error: str
    """The exception class (GateFailed, IntegrityError ...)."""
    exit_code: int
    message: str
    path: str | None = None
    hint: str | None = None


class RunRecord(Record):
    schema_version: int = SCHEMA_VERSION
    model: str
    recipe: str
    recipe_name: str
    artifact: Path | None = None
    """The artifact folder; null unless the gate passed and packaging finished."""
    report_dir: Path
    """<out>.report: eval.json, eval.md, plan.json, quantize_report.json, run.json, run.log."""
    passed: bool | None = None
    """The gate's verdict (null when the run stopped before the gate)."""
    verdict: Verdict | None = None
    stages: list[StageRow] = []
    published: PublishResult | None = None
    error: ErrorInfo | None = None

    def summary(self) -> str:
        if self.artifact:
            tail = f"artifact {self.artifact}" + (
                f"; published to {self.published.location}" if self.published else ""
            )
        elif self.passed is False:
            tail = f"no artifact (gate failed); report in {self.report_dir}"
        else:
            tail = f"no artifact; report in {self.report_dir}"
        total = sum(s.seconds for s in self.stages)
        return f"{tail} ({total:.0f} s in all)"
