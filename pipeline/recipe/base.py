"""What every recipe section shares: unknown keys are an error (a typo must not pass as a
default)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)
