"""The typed records stages hand each other, in pipeline order:

    Snapshot -> (TokenSetInfo) -> QuantizedCheckpoint -> EvalReport -> Verdict -> Artifact

plus Plan (inside QuantizedCheckpoint), EvalFile (eval.json), Provenance (provenance.json)
and RunRecord (run.json). Each is a frozen pydantic model with one to_json / from_json;
docs/RECORDS.md documents every field (`python -m pipeline.records`).
"""

from .artifact import Artifact, Provenance, PublishResult, QshipVersion, VerifyReport
from .base import SCHEMA_VERSION, Record
from .checkpoint import QuantizedCheckpoint, QuantizeSummary
from .evaluation import EvalFile, EvalReport, Metrics, ModelRef, Probe
from .plan import MappingPlan, ModulePlan, ModuleScheme, Plan
from .run import RunRecord, StageRow
from .snapshot import Snapshot
from .tokens import TokenSetInfo
from .verdict import Check, Verdict

__all__ = [
    "SCHEMA_VERSION",
    "Artifact",
    "Check",
    "EvalFile",
    "EvalReport",
    "MappingPlan",
    "Metrics",
    "ModelRef",
    "ModulePlan",
    "ModuleScheme",
    "Plan",
    "Probe",
    "Provenance",
    "PublishResult",
    "QshipVersion",
    "QuantizeSummary",
    "QuantizedCheckpoint",
    "Record",
    "RunRecord",
    "Snapshot",
    "StageRow",
    "TokenSetInfo",
    "Verdict",
    "VerifyReport",
]
