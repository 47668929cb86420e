"""Recipe schema: one YAML file = one quantization plan + its calibration, evaluation and gates.

Top-level keys (all others are an error):

    name, description
    dtype        bfloat16 | float16 | float32   -- for everything that stays unquantized
    groups       [{name, roles: [attention|mlp|experts|router|embeddings|lm_head],
                   targets: [...], exclude: [...], method: awq|gptq|autoround|rtn|none,
                   scheme: {preset | type, bits, symmetric, group_size, strategy, block,
                            observer, on_indivisible, activations} (formats.py),
                   options: {...}}]
    others       error | keep      -- a Linear no group claims
    kv_cache     {scheme: fp8_e4m3, strategy: tensor|attn_head, dynamic: false, query,
                  skip_layers: [i, ...]} | null
    calibration  {source, num_samples, seq_len, batch_size, seed, all_experts,
                  min_expert_tokens, chat_template, mix: [{source, weight}]}
    evaluation   {sequences, seq_len, batch_size, tasks, hub_tasks, custom_tasks, limit,
                  task_batch_size, max_overlap, greedy_prompts, greedy_tokens}
    gates        {kl_mean_max, kl_p99_max, top1_min, ppl_ratio_max, greedy_agreement_min,
                  tasks: {name: {max_drop}}, origin: {model, source, measured: {gate: figure},
                  note}}
    serve        {engine, kv_cache_dtype, max_kl, min_top1, max_kl_increase, workloads,
                  repeats, seed, gates, long_context} | null (serving.py)
    smoothquant  {strength} | null         -- SmoothQuant before the rounding (INT8 W8A8)
    target       {engine: vllm, gpu: sm90} -- what the plan checks the formats against

Targets are matched exactly as llm-compressor / compressed-tensors match them (the plan
uses the library's own matcher, so plan and engine cannot disagree): `re:<regex>` is
`re.match` against the module name (anchored at the start only; end it with `$` for an
exact suffix), anything else is an exact module name or a module class name (`Linear`).

Each method's group (its options, facts and own checks) is in methods.py. Checks that
need the model (overlaps, unmatched targets, group-size divisibility, fp16 on Gemma) are
the plan's (pipeline/quantize/validate.py): a recipe alone is checked here.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from .base import Strict as _Strict
from .formats import SmoothQuant, Target
from .methods import METHODS, Group
from .serving import ServeGate

DType = Literal["bfloat16", "float16", "float32"]


class KVCache(_Strict):
    """FP8 KV cache with calibrated scales: one per tensor, or one per KV head (attn_head,
    which vLLM 0.26 loads since its PR 30141). query: calibrate the query's FP8 scale too
    (attention quantization; vLLM serves FP8 attention with q_scale 1.0 otherwise).
    skip_layers: decoder layers whose KV cache (and query) stay 16-bit, as vLLM serves them
    with `--kv-cache-dtype-skip-layers`; compressed-tensors still calibrates and stores their
    scales (it hooks every attention module), which vLLM then does not use."""

    scheme: Literal["fp8_e4m3"] = "fp8_e4m3"
    strategy: Literal["tensor", "attn_head"] = "tensor"
    dynamic: Literal[False] = False
    query: bool = False
    skip_layers: list[int] = Field(default_factory=list)

    @field_validator("skip_layers")
    @classmethod
    def _skip_layers(cls, v: list[int]) -> list[int]:
        if any(i < 0 for i in v):
            raise ValueError("decoder layer indices start at 0")
        if len(set(v)) != len(v):
            raise ValueError("a layer is listed twice")
        return sorted(v)


BUILTIN_CORPORA = ("builtin:english", "builtin:python")


def _check_source(v: str) -> str:
    if v.startswith("builtin:") and v not in BUILTIN_CORPORA:
        raise ValueError(f"the builtin corpora are {', '.join(BUILTIN_CORPORA)}")
    if v.startswith("hf:") and len(v) <= 3:
        raise ValueError("write 'hf:<dataset>[:config]'")
    return v


class CorpusShare(_Strict):
    """One corpus of a calibration mix and its weight (its share of the windows)."""

    source: str
    weight: float = Field(gt=0, le=1e6)

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        return _check_source(v)


class CalibrationConfig(_Strict):
    source: str = "builtin:english"
    # bounds: far above any published calibration set (llm-compressor's examples: 512 x 2048)
    num_samples: int = Field(default=128, gt=0, le=65_536)
    seq_len: int = Field(default=512, gt=1, le=131_072)
    batch_size: int = Field(default=16, gt=0, le=4096)
    seed: int = 0
    # MoE: every expert sees every calibration token (the layer's output still uses only the
    # routed experts); off, an expert the router rarely picks may get too few tokens
    all_experts: bool = True
    # MoE: an expert that received fewer calibration tokens than this fails the run (exit 1)
    # instead of being written with scales from (almost) no data
    min_expert_tokens: int = Field(default=64, ge=1, le=1_000_000_000)
    # each calibration document wrapped in the model's chat template (a user turn and the
    # assistant's reply: the document split at its middle line or word), for instruct models
    chat_template: bool = False
    # calibration windows drawn from several corpora by weight (e.g. prose and
    # builtin:python code); the held-out windows still come from `source` alone
    mix: list[CorpusShare] = Field(default_factory=list)

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        return _check_source(v)

    @field_validator("mix")
    @classmethod
    def _mix(cls, v: list[CorpusShare]) -> list[CorpusShare]:
        names = [s.source for s in v]
        if len(set(names)) != len(names):
            raise ValueError("a corpus is listed twice in the mix")
        return v

    def key_fields(self) -> dict[str, Any]:
        """The fields as cache keys hold them: chat_template and mix only when set, so
        the keys of entries made before they existed stay as they were."""
        dump = self.model_dump(mode="json")
        return {k: v for k, v in dump.items() if v or k not in ("chat_template", "mix")}


Match = Literal["exact", "regex", "number", "contains", "choices"]


class CustomTask(_Strict):
    """A team's own task: a JSONL or CSV file of prompts and expected answers (under the
    project's eval/tasks/ folder by convention; a relative path is read from the working
    directory), pinned by its sha256 (docs/CUSTOM-TASKS.md). `match`: how an answer is
    judged unless a row says otherwise -- exact (after stripping), regex (the answer is a
    pattern searched in the completion), number (the first number within `tolerance`),
    contains (case-insensitive), or choices (multiple choice: the rows carry `choices`,
    scored by log-likelihood). Or an lm-eval task YAML (`path: ....yaml`) whose JSON/CSV
    data files are pinned in `data` (its own prompt, metric and generation settings)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")
    path: str = Field(min_length=1)
    # the file's sha256: a mismatch is exit 3 before any compute (`sha256sum FILE`)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    match: Match = "exact"
    tolerance: float = Field(default=0.0, ge=0.0, le=1e12)
    # the prompt wrapped in the model's chat template (a user turn + the generation prompt)
    chat_template: bool = False
    max_new_tokens: int = Field(default=32, gt=0, le=4096)
    # where generation stops (lm-eval's `until`)
    stop: list[str] = Field(default_factory=lambda: ["\n"])
    # an lm-eval task YAML's data files, each with its sha256 (paths as the YAML names them)
    data: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _yaml_or_rows(self) -> CustomTask:
        is_yaml = self.path.endswith((".yaml", ".yml"))
        if is_yaml != bool(self.data):
            raise ValueError(
                "an lm-eval task YAML pins its data files in `data: {path: sha256}`; a JSONL "
                "or CSV task takes no `data`"
                if is_yaml
                else "`data` is for an lm-eval task YAML"
            )
        if is_yaml and self.chat_template:
            raise ValueError("chat_template applies to JSONL/CSV tasks; an lm-eval YAML "
                             "writes its own prompt")  # fmt: skip
        import re

        bad = [d for d in self.data.values() if not re.fullmatch(r"[0-9a-f]{64}", d)]
        if bad:
            raise ValueError(f"data: {bad[0]!r} is not a sha256 (64 hex digits)")
        return self


class EvaluationConfig(_Strict):
    sequences: int = Field(default=32, gt=0, le=65_536)
    seq_len: int = Field(default=512, gt=1, le=131_072)
    batch_size: int = Field(default=4, gt=0, le=4096)
    # benchmarks whose data qship fetches offline (pinned): hellaswag, arc_easy,
    # arc_challenge, piqa, winogrande, lambada_openai, mmlu (or mmlu_<subject>), and the
    # generative gsm8k, humaneval, mbpp (docs/GENERATIVE.md)
    tasks: list[str] = Field(default_factory=list)
    # humaneval / mbpp run model-written code: off (refused, exit 2) unless opted in --
    # sandboxed (each program in its own network namespace, as nobody, with limits), or
    # sandboxed-no-netns (also where the OS gives no namespace); HF_ALLOW_CODE_EVAL=1 =
    # sandboxed
    code_execution: Literal["off", "sandboxed", "sandboxed-no-netns"] = "off"
    # any other lm-eval task, its data from the Hub (skipped with a reason when offline)
    hub_tasks: list[str] = Field(default_factory=list)
    # a team's own prompts and answers, pinned files (docs/CUSTOM-TASKS.md)
    custom_tasks: list[CustomTask] = Field(default_factory=list)
    # the first N items of each task (per subject for mmlu); null = the whole split
    limit: int | None = Field(default=None, gt=0, le=10_000_000)
    # lm-eval's batch size: its float32 log-softmax over the vocabulary is batch x length x
    # vocab (Gemma: 262k) -- 16 long MMLU prompts need 20 GB; raise it on a GPU
    task_batch_size: int = Field(default=4, gt=0, le=4096)
    # largest share of an evaluation set (held-out windows, a task's items) that may share
    # a word 13-gram with the calibration text; above it the run refuses (exit 2)
    max_overlap: float = Field(default=0.01, ge=0.0, le=1.0)
    # the attention arithmetic the KL is measured with when the checkpoint has an FP8 KV
    # cache: "vllm" = as vLLM serves it on CUDA (K, V *and the query* rounded to FP8; the
    # query with scale 1.0), "kv-only" = K and V only (compressed-tensors' hooks alone)
    attention: Literal["vllm", "kv-only"] = "vllm"
    # per position, the top-k log-probs of both models stored for the served check
    # (qship/measured.safetensors in the artifact); 0 = store none
    measured_topk: int = Field(default=32, ge=0, le=1024)
    # greedy agreement (label-free): this many held-out prompts continued greedily for
    # greedy_tokens tokens by both models, compared token by token; 0 = not measured
    greedy_prompts: int = Field(default=8, ge=0, le=4096)
    greedy_tokens: int = Field(default=32, gt=0, le=4096)

    @model_validator(mode="after")
    def _custom_names(self) -> EvaluationConfig:
        seen = {*self.tasks, *self.hub_tasks}
        for t in self.custom_tasks:
            if t.name in seen:
                raise ValueError(
                    f"custom_tasks: the name {t.name!r} is used twice (or by a built-in "
                    "or hub task); give each task its own name"
                )
            seen.add(t.name)
        return self


class TaskGate(_Strict):
    # the largest accuracy drop allowed, percentage points (reference - candidate); below 0:
    # the candidate must gain that much
    max_drop: float = Field(ge=-100, le=100)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "score_drop_max" in data:
            raise ValueError(
                "score_drop_max is now max_drop, in percentage points (a 0.01 drop in "
                "accuracy is max_drop: 1.0)"
            )
        return data


# each metric gate: the figure it holds (the compare report's row key) and which way: "max"
# a ceiling, "min" a floor, "ratio" a ceiling on a figure whose perfect value is 1
GATE_FIGURES = {"kl_mean_max": ("kl_mean", "max"), "kl_p99_max": ("kl_p99", "max"),
                "top1_min": ("top1", "min"), "ppl_ratio_max": ("ppl_ratio", "ratio")}  # fmt: skip


class GateOrigin(_Strict):
    """Where the gate limits came from: the model and run they were measured on, and the
    figure behind each limit. A limit is only as good as that model is like yours; the plan
    prints this, and `qship compare` the limits your own rows support."""

    # the model the limits were measured on (a Hub id or a description)
    model: str = Field(min_length=1)
    # where the figures are written down (bench/RESULTS.md and its section)
    source: str = Field(min_length=1)
    # the measured figure behind each limit, by gate name (kl_mean_max: measured mean KL)
    measured: dict[str, float] = Field(default_factory=dict)
    note: str = ""


class Gates(_Strict):
    # KL in nats (>= 0), top-1 agreement a share, perplexity ratio candidate / reference
    kl_mean_max: float | None = Field(default=None, ge=0)
    kl_p99_max: float | None = Field(default=None, ge=0)
    top1_min: float | None = Field(default=None, ge=0, le=1)
    ppl_ratio_max: float | None = Field(default=None, gt=0)
    # the least share of greedy continuations identical to the reference's (0..1)
    greedy_agreement_min: float | None = Field(default=None, ge=0, le=1)
    tasks: dict[str, TaskGate] = Field(default_factory=dict)
    # not part of the recipe's hash: it explains the limits, it changes no output
    origin: GateOrigin | None = None

    @model_validator(mode="after")
    def _origin_names_set_limits(self) -> Gates:
        for name in self.origin.measured if self.origin else {}:
            if name not in GATE_FIGURES or getattr(self, name) is None:
                set_ = [g for g in GATE_FIGURES if getattr(self, g) is not None]
                raise ValueError(f"gates.origin.measured.{name}: not a limit this recipe sets "
                                 f"(it sets {', '.join(set_) or 'none'})")  # fmt: skip
        return self

    def margins(self) -> list[tuple[str, float, float, float]]:
        """(gate, limit, measured, margin) for each limit with a measured figure in its
        origin; the margin is how far the figure sits inside the limit."""
        out = []
        for name, measured in (self.origin.measured if self.origin else {}).items():
            limit = float(getattr(self, name))
            way = GATE_FIGURES[name][1]
            out.append(
                (name, limit, measured, measured - limit if way == "min" else limit - measured)
            )
        return out

    def origin_lines(self) -> list[str]:
        """What `qship plan` prints about where the limits came from."""
        set_ = [g for g in GATE_FIGURES if getattr(self, g) is not None] + list(self.tasks)
        if not set_:
            return []
        if self.origin is None:
            return ["gates: no origin recorded; measure your model (`qship compare` prints "
                    "the limits its rows support) before trusting them"]  # fmt: skip
        o = self.origin
        lines = [f"gates from {o.model} ({o.source}); set your own from `qship compare` on "
                 "your model"]  # fmt: skip
        lines += [f"  {n} {lim:g}: measured {m:g}, margin {mg:+.3g}"
                  for n, lim, m, mg in self.margins()]  # fmt: skip
        if o.note:
            lines.append(f"  {o.note}")
        return lines


class Recipe(_Strict):
    name: str = Field(min_length=1)
    description: str = ""
    dtype: DType = "bfloat16"
    groups: list[Group] = Field(min_length=1)
    kv_cache: KVCache | None = None
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    gates: Gates = Field(default_factory=Gates)
    serve: ServeGate | None = None
    # a Linear module that no group claims: error (exit 2, naming it), or keep it 16-bit
    others: Literal["error", "keep"] = "error"
    # SmoothQuant before the rounding (for INT8 activations); null = none
    smoothquant: SmoothQuant | None = None
    # the engine and GPU the checkpoint is for: the plan refuses what they cannot run fast
    target: Target = Field(default_factory=Target)

    # where it was read from (for error messages); not part of the hash
    _path: str | None = None

    @model_validator(mode="after")
    def _unique_names(self) -> Recipe:
        seen: set[str] = set()
        for g in self.groups:
            if g.name in seen:
                raise ValueError(f"two groups are named {g.name!r}; give each group its own name")
            seen.add(g.name)
        ev = self.evaluation
        evaluated = {*ev.tasks, *ev.hub_tasks, *(t.name for t in ev.custom_tasks)}
        for t in self.gates.tasks:
            if t not in evaluated:
                raise ValueError(
                    f"gates.tasks.{t}: {t!r} is not evaluated; list it in evaluation.tasks "
                    "(or evaluation.hub_tasks, evaluation.custom_tasks)"
                )
        return self

    @model_validator(mode="after")
    def _no_imatrix_beside_awq(self) -> Recipe:
        # llm-compressor 0.14 fails at layer 0 on such a recipe ("'IMatrixMSEObserver' object
        # has no attribute '_imatrix_sum'"), after the recipe, fetch and tokens stages ran
        if not any(g.method == "awq" for g in self.groups):
            return self
        for i, g in enumerate(self.groups):
            if g.scheme and g.scheme.observer == "imatrix_mse":
                raise ValueError(
                    f"groups[{i}].scheme.observer: imatrix_mse does not run beside an AWQ group "
                    "in llm-compressor 0.14; use observer: mse, or quantize the AWQ group's "
                    "layers with GPTQ"
                )
        return self

    @property
    def path(self) -> str:
        return self._path or "<recipe>"

    def resolved(self) -> dict[str, Any]:
        """The canonical resolved recipe (defaults filled in)."""
        return self.model_dump(mode="json")

    def hash(self) -> str:
        resolved = self.resolved()
        resolved["gates"].pop("origin", None)  # documents the limits, changes no output
        text = json.dumps(resolved, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.resolved(), sort_keys=False)

    def needs_gpu(self) -> bool:
        return any(METHODS[g.method].gpu_only for g in self.groups)

    def needs_calibration(self) -> bool:
        """False for a data-free recipe (RTN weights, dynamic or no activation scales, no
        KV-cache scales, no SmoothQuant, no importance-weighted observer): quantize reads no
        calibration text."""
        static_act = any(g.scheme and g.scheme.activations and not g.scheme.activations.dynamic
                         for g in self.groups)  # fmt: skip
        imatrix = any(g.scheme and g.scheme.observer == "imatrix_mse" for g in self.groups)
        return (
            self.kv_cache is not None
            or self.smoothquant is not None
            or static_act
            or imatrix
            or any(METHODS[g.method].calibrated for g in self.groups)
        )

    def quantizes_activations(self) -> bool:
        return any(g.scheme and g.scheme.activations for g in self.groups)

    def to_json(self) -> dict:
        return {**self.resolved(), "hash": self.hash(), "path": self._path}
