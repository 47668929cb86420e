"""Plan: every Linear module of the model -> group, method and scheme, before any compute."""

from __future__ import annotations

from collections import Counter
from typing import Literal

from ..recipe import KVCache, Method
from .base import Record
from .estimate import ResourceEstimate


class ActivationScheme(Record):
    """Input activations quantized at inference (the serving kernel's input quantization)."""

    type: Literal["float", "int"]
    """float (FP8 e4m3) or int (INT8)."""
    bits: int
    """8."""
    strategy: Literal["token", "tensor", "group"]
    """One scale per token, per tensor, or per group of a token's values."""
    dynamic: bool
    """Scales computed on the fly (true) or calibrated and stored as input_scale."""
    group_size: int | None = None
    """Values per scale (strategy group)."""

    def label(self) -> str:
        kind = "fp8" if self.type == "float" else f"int{self.bits}"
        how = f"g{self.group_size}" if self.strategy == "group" else self.strategy
        return f"{kind} act/{how}" + ("" if self.dynamic else " static")


class ModuleScheme(Record):
    """A weight scheme as it applies to one module (group size resolved), with the input
    activations the serving kernel quantizes (null: 16-bit activations)."""

    bits: int
    """Bits per weight value (4 or 8)."""
    symmetric: bool
    """Symmetric (no zero point) or asymmetric (a zero point per group)."""
    group_size: int | None
    """Weights per scale along the input dimension (strategy group); null otherwise."""
    observer: str | None = None
    """How scales are chosen: null = min-max of each group; mse = llm-compressor's MSE
    search over shrunken ranges."""
    type: Literal["int", "float"] = "int"
    """int (packed or int8) or float (FP8 e4m3)."""
    strategy: Literal["group", "channel", "tensor", "block"] = "group"
    """One scale per group, output channel, tensor or block."""
    block: list[int] | None = None
    """[rows, columns] per scale (strategy block)."""
    activations: ActivationScheme | None = None
    """The input activations' quantization; null = 16-bit."""

    def label(self) -> str:
        if self.type == "float":
            grp = {"channel": "per-channel", "tensor": "per-tensor"}.get(
                self.strategy, f"block{'x'.join(map(str, self.block or []))}"
            )
            out = f"fp8 {grp}"
        else:
            kind = "sym" if self.symmetric else "asym"
            grp = {"group": f"g{self.group_size}", "tensor": "per-tensor"}.get(
                self.strategy, "per-channel"
            )
            out = f"int{self.bits} {kind} {grp}"
        out += f" {self.observer}" if self.observer else ""
        return out + (f" + {self.activations.label()}" if self.activations else "")

    def stored(self) -> str:
        """How the weight is stored and run (the observer only chose the values)."""
        return self.model_copy(update={"observer": None}).label()

    def saved_format(self) -> str:
        """The compressed-tensors format the weight is saved in: packed int words, int8 or
        FP8 values. W4A8-FP8 is packed (vLLM's CUTLASS W4A8 reads weight_packed), though
        compressed-tensors 0.19 would store it as int8 (modifiers.py sets the format)."""
        a = self.activations
        if self.type == "float":
            return "float-quantized" if a else "naive-quantized"
        if a is not None and (a.type == "int" or self.bits == 8):
            return "int-quantized"
        return "pack-quantized"

    def format_label(self) -> str:
        """W4A16, W8A16-FP8, W8A8-INT8, W8A8-FP8, W4A8-FP8 ..."""
        a = self.activations
        if a is None:
            return f"W{self.bits}A16" + ("-FP8" if self.type == "float" else "")
        return f"W{self.bits}A8-" + ("FP8" if a.type == "float" else "INT8")


class ModulePlan(Record):
    name: str
    """Module path, e.g. model.layers.0.self_attn.q_proj."""
    cls: str
    """Module class name (Linear)."""
    group: str
    """The recipe group that claims it."""
    method: Method
    """awq, gptq, autoround, rtn, or none (kept in 16-bit)."""
    scheme: ModuleScheme | None
    """null: kept in the recipe's dtype."""
    in_features: int
    """Input width (the group size must divide it)."""
    out_features: int
    """Output width."""
    role: str | None = None
    """attention, mlp, experts, router or lm_head (pipeline/model/roles.py); null: none."""
    note: str = ""
    """Why it is kept, or which fallback group size it got."""
    tied: bool
    """Its weight is the input embedding's (stored once, as the embedding)."""
    bits_per_weight: float
    """Stored bits per weight including scales and zero points."""
    stored_bytes: int
    """Bytes this module's weight takes in the checkpoint (0 when tied)."""


class MappingPlan(Record):
    """One AWQ smoothing mapping: `smooth`'s output scales are folded into `balance`."""

    kind: str
    """norm->qkv, v->o, norm->gate/up or up->down."""
    smooth: str
    """The module whose output is rescaled (a norm, or v_proj / up_proj)."""
    balance: list[str]
    """The Linear modules the inverse scale is folded into."""
    applied: bool
    """False when the mapping was skipped (reason says why)."""
    reason: str
    """Why it was skipped (or "shapes compatible")."""


class BitsPerWeight(Record):
    quantized: float
    """Over the quantized Linear weights (the figure recipes are compared by)."""
    linear: float
    """Over all Linear weights (a tied head counted once, as the embedding)."""
    whole_checkpoint: float
    """The expected checkpoint's bits over all parameters."""


class ParamCounts(Record):
    total: int
    """Parameters of the model (a tied head counted once)."""
    dense_bytes: int
    """Size of the unquantized model in the recipe's dtype."""
    quantized_linear: int
    """Weights in quantized Linear modules."""


class Plan(Record):
    recipe_name: str
    """The recipe's name."""
    recipe_hash: str
    """Recipe.hash() of the resolved recipe."""
    architecture: str
    """The model class (Gemma3ForCausalLM ...)."""
    model_type: str
    """config.json's model_type."""
    dtype: str
    """The dtype of everything left unquantized."""
    modules: list[ModulePlan]
    """Every Linear module, in module order."""
    mappings: list[MappingPlan]
    """The AWQ smoothing mappings for the AWQ groups (empty without AWQ)."""
    smoothquant: list[MappingPlan] = []
    """SmoothQuant's norm mappings (recipe `smoothquant`), applied or skipped with why."""
    kv_cache: KVCache | None
    """The KV-cache scheme, or null for a 16-bit KV cache."""
    attention_class: str | None = None
    """The attention modules' class (e.g. LlamaAttention): what a calibrated query scale's
    config group targets, the name vLLM recognises and leaves to its KV-cache method."""
    decoder_layers: list[str]
    """The decoder layers, in order (llm-compressor's sequential pipeline goes layer by layer)."""
    structure_rule: str = ""
    """Which rules resolved the roles (checked family, or the generic structural rules)."""
    roles: dict[str, int] = {}
    """Modules per role."""
    bits_per_weight: BitsPerWeight
    """Stored bits per weight (scales and zero points included)."""
    expected_checkpoint_bytes: int
    """The size the saved checkpoint should have."""
    params: ParamCounts
    """Parameter counts."""
    notes: list[str] = []
    """What the plan could not do as asked (skipped mappings, AWQ modules without smoothing)."""
    estimate: ResourceEstimate | None = None
    """Predicted memory, disk and time of this run on its device (qship plan / run)."""

    def by_name(self) -> dict[str, ModulePlan]:
        return {m.name: m for m in self.modules}

    def groups(self, method: str | None = None) -> dict[str, list[ModulePlan]]:
        out: dict[str, list[ModulePlan]] = {}
        for m in self.modules:
            if method is None or m.method == method:
                out.setdefault(m.group, []).append(m)
        return out

    def applied_mappings(self) -> list[MappingPlan]:
        return [m for m in self.mappings if m.applied]

    def summary(self) -> str:
        """A few lines: each group with its method, schemes and module count; KV; size."""
        lines = [f"{self.recipe_name} on {self.architecture}: {len(self.modules)} Linear modules"]
        if self.roles:
            found = ", ".join(f"{r} {n}" for r, n in self.roles.items() if n)
            lines.append(f"  roles: {found} ({self.structure_rule.split(':')[0]})")
        for group, mods in self.groups().items():
            labels = Counter(m.scheme.label() if m.scheme else f"{self.dtype} (kept)" for m in mods)
            schemes = ", ".join(f"{k} ×{n}" if len(labels) > 1 else k for k, n in labels.items())
            tied = " (tied to the embedding)" if any(m.tied for m in mods) else ""
            n = len(mods)
            lines.append(
                f"  {group:<12} {mods[0].method:<5} {schemes:<24} {n:>4} module{'s' * (n != 1)}"
                + tied
            )
        applied = len(self.applied_mappings())
        kv = (f"KV cache {self.kv_cache.scheme} per "
              f"{'KV head' if self.kv_cache.strategy == 'attn_head' else 'tensor'}"
              f"{', query scale calibrated' if self.kv_cache.query else ''}"
              + (f", 16-bit on layers {', '.join(map(str, self.kv_cache.skip_layers))} (vLLM "
                 "--kv-cache-dtype-skip-layers)" if self.kv_cache.skip_layers else "")
              if self.kv_cache else "KV cache 16-bit")  # fmt: skip
        maps = f"; AWQ mappings {applied} applied, {len(self.mappings) - applied} skipped"
        lines.append(f"  {kv}" + (maps if self.mappings else ""))
        bpw = self.bits_per_weight
        lines.append(
            f"  {bpw.quantized:.3f} bits/weight over quantized weights; checkpoint "
            f"{self.expected_checkpoint_bytes / 1e6:.0f} MB (dense {self.dtype} "
            f"{self.params.dense_bytes / 1e6:.0f} MB)"
        )
        if self.estimate is not None:
            lines.append(self.estimate.summary())
        return "\n".join(lines)
