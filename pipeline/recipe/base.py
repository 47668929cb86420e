"""What every recipe section shares: unknown keys are an error (a typo must not pass as a
default), and no number is NaN or infinite (a NaN limit passes no comparison: a run would
compute, then fail on "limit <= nan"); ranges are each field's own."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)
