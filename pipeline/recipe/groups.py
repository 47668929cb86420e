"""What every recipe group has, whatever its method: a name, what it claims (roles,
targets, exclude) and the checks on those; and the base of each method's options. Each
method's own group and options are in methods.py."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_serializer, model_validator

from .base import Strict

if TYPE_CHECKING:
    from .formats import Scheme

Role = Literal["attention", "mlp", "experts", "router", "embeddings", "lm_head"]

# the keys of the one flat options class the per-method ones replaced: every group's
# resolved options carry them (null where they do not apply), so the recipe hashes and
# cache keys of existing recipes stay what they were; a new method's own keys appear in
# its groups alone (and so change no other recipe's hash)
FLAT_KEYS = ("dampening_frac", "actorder", "block_size", "n_grid", "duo_scaling",
             "offload_cache", "awq_scales", "iters")  # fmt: skip


class MethodOptions(Strict):
    """A method's options (each method's own class, methods.py, lists its keys)."""

    method: ClassVar[str]
    # every method's option keys (set by methods.py): another method's key is named as such
    every_key: ClassVar[frozenset[str]] = frozenset(FLAT_KEYS)

    @model_validator(mode="before")
    @classmethod
    def _other_methods_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        own = set(cls.model_fields)
        foreign = {k for k in data if k in cls.every_key and k not in own}
        bad = sorted(k for k in foreign if data[k] is not None)
        if bad:
            raise ValueError(
                f"options {bad} do not apply to method '{cls.method}' "
                f"(allowed: {sorted(own) or 'none'}); delete them"
            )
        # a resolved recipe writes every flat key (null where it does not apply): read back
        return {k: v for k, v in data.items() if k not in foreign}

    @model_serializer(mode="wrap")
    def _flat_shape(self, handler: Any) -> dict[str, Any]:
        own = handler(self)
        return {**{k: own.get(k) for k in FLAT_KEYS}, **own}

    def given(self) -> set[str]:
        return {k for k in type(self).model_fields if getattr(self, k) is not None}


class GroupBase(Strict):
    """One recipe group. The class variables are the method's facts, which the plan, the
    estimate and `Recipe.needs_*` read (methods.py sets them per method)."""

    name: str = Field(min_length=1)
    # what the group claims: roles (resolved from the model's structure, pipeline/model/
    # roles.py: one recipe fits every family) and/or targets (module names, class names or
    # 're:' regexes, matched as llm-compressor matches them)
    roles: list[Role] = Field(default_factory=list)
    targets: list[str] = Field(default_factory=list)
    # modules taken out of what roles/targets claim (another group takes them), same syntax
    exclude: list[str] = Field(default_factory=list)

    # whether the rounding reads calibration data
    calibrated: ClassVar[bool] = False
    # whether a CPU runner cannot afford it (refused there)
    gpu_only: ClassVar[bool] = False
    # whether it quantizes at all (`none` keeps the weights 16-bit, with no scheme)
    quantizes: ClassVar[bool] = True
    # whether it writes integer weights only (no FP8, no activation quantization)
    integer_only: ClassVar[bool] = False

    if TYPE_CHECKING:  # each method's class declares these (in the dump's field order)
        method: str
        scheme: Scheme | None
        options: MethodOptions

    @property
    def smoothed(self) -> bool:
        """Whether AWQ's smoothing scales are applied to this group's modules."""
        return False

    @model_validator(mode="after")
    def _consistent(self) -> GroupBase:
        if not self.roles and not self.targets:
            raise ValueError("a group needs `roles` or `targets` (or both)")
        sch = self.scheme
        if not self.quantizes and sch is not None:
            raise ValueError(
                f"method '{self.method}' keeps weights in 16-bit and takes no scheme; "
                "delete `scheme` or choose awq/gptq/rtn"
            )
        if self.quantizes and sch is None:
            raise ValueError(
                f"method '{self.method}' needs a `scheme` (bits, symmetric, group_size)"
            )
        if sch is not None and sch.activations is not None and "embeddings" in self.roles:
            raise ValueError(
                "scheme.activations on a group with role embeddings: an embedding reads "
                "token ids, not activations; move embeddings to a group without activations"
            )
        if (
            sch is not None
            and self.integer_only
            and (sch.type == "float" or sch.activations is not None)
        ):
            raise ValueError(
                f"method '{self.method}' writes integer weights without activation "
                "quantization here; for FP8 or W8A8/W4A8 use method rtn (FP8) or gptq"
            )
        for t in [*self.targets, *self.exclude]:
            if t.startswith("re:"):
                try:
                    re.compile(t[3:])
                except re.error as e:
                    raise ValueError(f"target {t!r} is not a valid regex ({e})") from e
        return self
