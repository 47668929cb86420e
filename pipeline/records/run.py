"""RunRecord: run.json, the record of one `qship run`, whatever its outcome."""

from __future__ import annotations

from pathlib import Path

from .artifact import PublishResult
from .base import SCHEMA_VERSION, Record
from .verdict import Verdict


class StageRow(Record):
    stage: str
    """recipe, fetch, tokens, quantize, evaluate, gate, package or publish."""
    seconds: float
    """Wall time of the stage."""
    cache_hit: bool = False
    """The stage's result came from the stage cache."""
    key: str | None = None
    """The stage's entry in the stage cache."""
    note: str = ""
    """The stage's one-line summary."""
    error: str | None = None
    """Why the stage failed: the error's class, exit code and message (null when it
    finished). A failed stage has its row, with the time it ran."""


class ErrorInfo(Record):
    error: str
    """The exception class (GateFailed, IntegrityError ...)."""
    exit_code: int
    """The CLI's exit code for it."""
    message: str
    """What failed, naming the file or field."""
    path: str | None = None
    """The file or field at fault."""
    hint: str | None = None
    """What to do."""


class RunRecord(Record):
    schema_version: int = SCHEMA_VERSION
    """Version of this record's layout."""
    model: str
    """The --model source."""
    recipe: str
    """The recipe file."""
    recipe_name: str
    """The recipe's name."""
    artifact: Path | None = None
    """The artifact folder; null unless the gate passed and packaging finished."""
    report_dir: Path
    """<out>.report: eval.json, eval.md, plan.json, quantize_report.json, run.json, run.log."""
    passed: bool | None = None
    """The gate's verdict (null when the run stopped before the gate)."""
    verdict: Verdict | None = None
    """The gate's verdict (null before the gate)."""
    stages: list[StageRow] = []
    """One row per stage run, in order."""
    published: PublishResult | None = None
    """Where the artifact was published (null unless --publish-to)."""
    error: ErrorInfo | None = None
    """The error that ended the run (null on success)."""

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
