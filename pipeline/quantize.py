"""quantize: translate the plan into llm-compressor modifiers, run oneshot, save, verify.

Modifiers (one calibration pass, llm-compressor's sequential pipeline, in this order):
  AWQModifier (transform only) with explicit per-layer mappings restricted to AWQ groups
  QuantizationModifier: config_groups for the AWQ groups and the RTN groups + KV scheme
  GPTQModifier per distinct option set: config_groups for the GPTQ groups
`none` groups are matched by no modifier and stay in the recipe's dtype.

After saving, every Linear module's scheme in config.json is checked against the plan
(llm-compressor renames groups to group_0.. and lets a later modifier silently win on
overlaps, so we match on targets + scheme) and the checkpoint is reloaded with
transformers and must give finite logits. Any failure -> StageError naming the module;
the output dir is built with fsutil.atomic_dir so a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import gc
import json
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .devices import default_device
from .errors import StageError, UsageError
from .fsutil import atomic_dir
from .plan import Plan, build_plan
from .recipe import Recipe

REPORT = "quantize_report.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
)
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class QuantizeResult:
    path: Path
    plan: Plan
    report: dict
    seconds: float
    peak_memory: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "path": str(self.path),
            "plan": self.plan.to_json(),
            "report": self.report,
            "seconds": self.seconds,
            "peak_memory": self.peak_memory,
        }

    def summary(self) -> str:
        r = self.report
        return (
            f"quantized {self.plan.recipe_name} → {self.path} in {self.seconds:.1f} s; "
            f"{r['checkpoint']['bits_per_weight_quantized']:.3f} bits/weight over quantized "
            f"Linear weights, checkpoint {r['checkpoint']['bytes'] / 1e6:.2f} MB "
            f"(expected {self.plan.expected_checkpoint_bytes / 1e6:.2f} MB); config and reload checks passed"
        )


def _log(msg: str) -> None:
    print(f"qship quantize: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# modifiers


def qargs(scheme: dict, *, actorder: str | None = None) -> dict:
    d = {
        "num_bits": scheme["bits"],
        "type": "int",
        "symmetric": scheme["symmetric"],
        "strategy": "group" if scheme["group_size"] else "channel",
        "dynamic": False,
    }
    if scheme["group_size"]:
        d["group_size"] = scheme["group_size"]
    if actorder:
        d["actorder"] = actorder
    if scheme.get("observer"):
        d["observer"] = scheme["observer"]
    return d


def build_modifiers(plan: Plan, recipe: Recipe) -> list:
    """The llm-compressor modifiers for this plan (see the module docstring)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier

    groups = {g.name: g for g in recipe.groups}
    present = {m.group for m in plan.modules}
    kv = None
    if recipe.kv_cache is not None:
        kv = QuantizationArgs(
            num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True
        )

    mods: list = []
    # AWQ: one modifier per distinct option set, mappings restricted to its groups
    awq_sets: dict[str, list[str]] = {}
    for g in recipe.groups:
        if g.method == "awq" and g.name in present:
            awq_sets.setdefault(g.options.model_dump_json(), []).append(g.name)
    owner = {m.name: m.group for m in plan.modules}
    for _key, names in awq_sets.items():
        opts = groups[names[0]].options
        maps = [
            AWQMapping(mp.smooth, list(mp.balance))
            for mp in plan.applied_mappings()
            if owner.get(mp.balance[0]) in names
        ]
        kw: dict[str, Any] = {"mappings": maps}
        if opts.n_grid is not None:
            kw["n_grid"] = opts.n_grid
        if opts.duo_scaling is not None:
            kw["duo_scaling"] = opts.duo_scaling
        # AWQ caches every batch's layer inputs for its grid search; in CPU memory they cost
        # a transfer per grid point (+24 % time on an 8B for 0.3 GB less peak GPU memory)
        if opts.offload_cache is not None:
            kw["offload_device"] = torch.device("cpu") if opts.offload_cache else None
        if maps:
            mods.append(AWQModifier(**kw))

    qm_groups = {}
    for g in recipe.groups:
        if g.method in ("awq", "rtn") and g.name in present:
            qm_groups[g.name] = QuantizationScheme(
                targets=list(g.targets), weights=QuantizationArgs(**qargs(g.scheme.planned()))
            )
    gptq_sets: dict[str, list[str]] = {}
    for g in recipe.groups:
        if g.method == "gptq" and g.name in present:
            gptq_sets.setdefault(g.options.model_dump_json(), []).append(g.name)

    if qm_groups or (kv is not None and not gptq_sets):
        kw = {"config_groups": qm_groups or None, "kv_cache_scheme": kv}
        if not qm_groups:  # KV only: a QuantizationModifier needs some config
            kw = {"kv_cache_scheme": kv, "config_groups": {}}
        mods.append(QuantizationModifier(**kw))
        kv = None
    for _key, names in gptq_sets.items():
        opts = groups[names[0]].options
        cg = {
            n: QuantizationScheme(
                targets=list(groups[n].targets),
                weights=QuantizationArgs(**qargs(groups[n].scheme.planned())),
            )
            for n in names
        }
        kw = {"config_groups": cg}
        if opts.dampening_frac is not None:
            kw["dampening_frac"] = opts.dampening_frac
        if opts.actorder is not None:
            kw["actorder"] = opts.actorder
        if opts.block_size is not None:
            kw["block_size"] = opts.block_size
        if kv is not None:
            kw["kv_cache_scheme"] = kv
            kv = None
        mods.append(GPTQModifier(**kw))
    return mods


# ---------------------------------------------------------------------------------------
# narrow patches and metric capture (all scoped, restored on exit)


@contextlib.contextmanager
def _patched(obj: Any, attr: str, value: Any):
    old = obj.__dict__[attr] if attr in obj.__dict__ else getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


@contextlib.contextmanager
def cpu_pin_memory_fix():
    """AWQ pins its cached activations; without an accelerator that raises
    'Cannot access accelerator device when none is available'. Only then (no
    accelerator), and only inside this block, make the pinning a no-op."""
    if torch.accelerator.is_available():
        yield False
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    def _no_pin(self, batch_index, input_names=None):
        return None

    with _patched(IntermediatesCache, "pin_memory", _no_pin):
        yield True


@contextlib.contextmanager
def awq_lean_grid_search():
    """AWQ's grid search with less alive at once; the same scales (tests/test_quantize.py).

    For each smoothing parent (the attention block) llm-compressor 0.14 runs the parent over
    every cached batch once unquantized and once per grid point, and keeps whole lists:
    1. under the eager attention it calibrates with, each output is the tuple (output,
       attention weights) and every batch's tuple lives until the list is built (268 MB at
       Gemma 3 270M's peak): here each output is cut to its first element as it is made;
    2. each grid point's quantized outputs are all built before `_compute_loss` compares
       them batch by batch with the unquantized ones (one full copy of the parent's output,
       537 MB for an 8B at 128 x 512 tokens): here, inside `_compute_best_scale`, they are
       made lazily, so the loss consumes each batch before the next exists.
    """
    from llmcompressor.core import active_session
    from llmcompressor.modifiers.transform.awq import AWQModifier

    grid = AWQModifier.__dict__["_compute_best_scale"]
    in_grid = [0]

    def run_samples(self, module):
        cache = self._parent_args_cache[module]
        batches = cache.iter_prefetch() if active_session().state.sequential_prefetch else cache
        outs = (_first_output(module(**batch)) for batch in batches)
        return outs if in_grid[0] else list(outs)

    def compute_best_scale(self, *args, **kwargs):
        in_grid[0] += 1
        try:
            return grid(self, *args, **kwargs)
        finally:
            in_grid[0] -= 1

    with (
        _patched(AWQModifier, "_run_samples", run_samples),
        _patched(AWQModifier, "_compute_best_scale", compute_best_scale),
    ):
        yield


def _first_output(out):
    return out[0] if isinstance(out, tuple) else out


@contextlib.contextmanager
def _stdout_is_stderr():
    old = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = old


def import_llmcompressor():
    """Import llm-compressor so that its loguru console handler (which it binds to
    sys.stdout at import, and which logs during import) writes to stderr: qship's
    stdout is reserved for `--json` results."""
    if "llmcompressor" not in sys.modules:
        with _stdout_is_stderr():
            import llmcompressor  # noqa: F401


@contextlib.contextmanager
def library_logs_to_stderr():
    """Inside this block llm-compressor's records go to stderr, WARNING and up (or
    LLM_COMPRESSOR_LOG_LEVEL); afterwards its default INFO console handler is put back,
    on stderr as well."""
    import importlib
    import os

    from loguru import logger

    import_llmcompressor()
    # `import llmcompressor.logger` would give the package's `logger` attribute (loguru)
    lcl = importlib.import_module("llmcompressor.logger")
    level = os.environ.get("LLM_COMPRESSOR_LOG_LEVEL", "WARNING").upper()

    def keep(record) -> bool:
        # In one sequential pass GPTQModifier's layer end re-runs update_qparams on the KV
        # observers that QuantizationModifier already consumed; llm-compressor then warns
        # "Attempted to calibrate a module k/v without statistics" and leaves the scale
        # as it was. Spurious here (verify_tensors checks the saved k/v scales instead).
        msg = record["message"]
        if msg.startswith(
            ("Attempted to calibrate a module k ", "Attempted to calibrate a module v ")
        ):
            return False
        return lcl.support_log_once(record)

    logger.remove()
    hid = logger.add(
        sys.stderr,
        level=level,
        format="{time:HH:mm:ss} | {function} | {level} - {message}",
        filter=keep,
    )
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            logger.remove(hid)
        with _stdout_is_stderr():
            lcl.configure_logger(lcl.LOGGER_CONFIG)


@contextlib.contextmanager
def capture_metrics(model, plan: Plan, report: dict, progress: bool = True):
    """Record GPTQ per-module error, AWQ per-mapping loss reduction, time per layer."""
    from llmcompressor.core import LifecycleCallbacks
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.utils.metric_logging import CompressionLogger

    names = {id(m): n for n, m in model.named_modules()}
    layers = set(plan.decoder_layers)
    gptq: dict[str, dict] = {}
    awq: list[dict] = []
    per_layer: list[dict] = []
    t_last = [time.perf_counter()]

    orig_set = CompressionLogger.set_results

    def set_results(self, name=None, loss=None):
        n = names.get(id(self.module), "?")
        if loss is not None:
            gptq[n] = {"error": float(loss)}
        return orig_set(self, name=name, loss=loss)

    orig_log = AWQModifier._log_error_metrics

    def log_error_metrics(self):
        awq.extend(dict(m) for m in self._error_metrics)
        return orig_log(self)

    orig_epoch = LifecycleCallbacks.__dict__["sequential_epoch_end"]

    def epoch_end(cls, modules, **kwargs):
        out = orig_epoch.__func__(cls, modules, **kwargs)
        now = time.perf_counter()
        layer = next((names.get(id(m)) for m in modules if names.get(id(m)) in layers), None)
        if layer is None:
            layer = f"subgraph {len(per_layer) + 1} (no decoder layer)"
        rec = {"layer": layer, "seconds": round(now - t_last[0], 3)}
        if torch.cuda.is_available():
            rec["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        per_layer.append(rec)
        t_last[0] = now
        if progress:
            done = sum(1 for r in per_layer if r["layer"] in layers)
            _log(f"[{done}/{len(layers)} layers] {layer} done in {rec['seconds']:.2f} s")
        return out

    with (
        _patched(CompressionLogger, "set_results", set_results),
        _patched(AWQModifier, "_log_error_metrics", log_error_metrics),
        _patched(LifecycleCallbacks, "sequential_epoch_end", classmethod(epoch_end)),
    ):
        try:
            yield
        finally:
            report["gptq"] = gptq
            report["awq"] = [
                {
                    "smooth": m.get("layer_name"),
                    "parent": m.get("parent_name"),
                    "initial_error": float(m.get("initial_error", 0.0)),
                    "best_error": float(m.get("best_error", 0.0)),
                    "loss_reduction": 1.0 - float(m.get("reduction", 1.0)),
                }
                for m in awq
            ]
            report["layers"] = per_layer


# ---------------------------------------------------------------------------------------
# verification of the saved checkpoint


def _scheme_from_args(w: dict, planned: dict) -> dict:
    gs = w.get("group_size") if w.get("strategy") == "group" else None
    got = {"bits": int(w["num_bits"]), "symmetric": bool(w["symmetric"]), "group_size": gs}
    if "observer" in planned:
        got["observer"] = w.get("observer")
    return got


def verify_saved_config(out_dir: Path, plan: Plan, model_meta) -> dict:
    """Each Linear module must carry exactly its planned scheme in config.json."""
    from compressed_tensors.utils.match import is_match

    cfg = json.loads((out_dir / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if not qc:
        if any(m.scheme for m in plan.modules):
            raise StageError(
                "config.json has no quantization_config", path=str(out_dir / "config.json")
            )
        return {"checked_modules": len(plan.modules)}
    groups = qc.get("config_groups") or {}
    ignore = qc.get("ignore") or []
    mods = dict(model_meta.named_modules())
    for mp in plan.modules:
        mod = mods[mp.name]
        hits = [
            (gname, g)
            for gname, g in groups.items()
            if is_match(mp.name, mod, g.get("targets") or [], ignore)
        ]
        where = f"{out_dir / 'config.json'}: quantization_config"
        if mp.scheme is None:
            if hits:
                raise StageError(
                    f"module {mp.name} was planned to stay {plan.dtype} but config group "
                    f"{hits[0][0]} ({hits[0][1].get('targets')}) quantizes it",
                    path=where,
                    hint="a modifier matched a module outside its group; report this as a bug",
                )
            continue
        if len(hits) != 1:
            raise StageError(
                f"module {mp.name} is matched by {len(hits)} config groups "
                f"({[h[0] for h in hits]}); planned exactly one ({mp.group})",
                path=where,
                hint="targets overlap or were dropped by llm-compressor; check the plan",
            )
        got = _scheme_from_args(hits[0][1].get("weights") or {}, mp.scheme)
        if got != mp.scheme:
            raise StageError(
                f"module {mp.name}: saved scheme {got} differs from the planned {mp.scheme} "
                f"(group {mp.group})",
                path=where,
                hint="llm-compressor silently overrode the scheme; check modifier order/targets",
            )
    kv_saved = qc.get("kv_cache_scheme")
    if (kv_saved is not None) != (plan.kv_cache is not None):
        raise StageError(
            f"kv_cache_scheme is {kv_saved} but the plan has {plan.kv_cache}",
            path=str(out_dir / "config.json"),
        )
    if kv_saved is not None and not (
        kv_saved.get("type") == "float"
        and kv_saved.get("num_bits") == 8
        and kv_saved.get("strategy") == "tensor"
    ):
        raise StageError(
            f"kv_cache_scheme {kv_saved} is not FP8 per-tensor", path=str(out_dir / "config.json")
        )
    return {
        "checked_modules": len(plan.modules),
        "config_groups": len(groups),
        "format": qc.get("format"),
    }


def verify_tensors(out_dir: Path, plan: Plan) -> dict:
    """Quantized modules have packed weights + scales; kept ones a plain weight."""
    from safetensors import safe_open

    keys: set[str] = set()
    total = 0
    for f in sorted(out_dir.glob("*.safetensors")):
        total += f.stat().st_size
        with safe_open(str(f), "pt") as fh:
            keys.update(fh.keys())
    for mp in plan.modules:
        if mp.scheme:
            need = [f"{mp.name}.weight_scale"]
            if not mp.scheme["symmetric"]:
                need.append(f"{mp.name}.weight_zero_point")
            if not any(k in keys for k in (f"{mp.name}.weight_packed", f"{mp.name}.weight")):
                need.append(f"{mp.name}.weight_packed")
            miss = [k for k in need if k not in keys]
            if miss:
                raise StageError(
                    f"module {mp.name}: tensors {miss} missing from the checkpoint",
                    path=str(out_dir),
                )
        elif not mp.tied and f"{mp.name}.weight" not in keys:
            raise StageError(
                f"module {mp.name}: kept weight missing from the checkpoint", path=str(out_dir)
            )
        elif f"{mp.name}.weight_scale" in keys:
            raise StageError(
                f"module {mp.name} was planned unquantized but has weight_scale", path=str(out_dir)
            )
    if plan.kv_cache:
        scales = {}
        for f in sorted(out_dir.glob("*.safetensors")):
            with safe_open(str(f), "pt") as fh:
                scales.update(
                    {k: fh.get_tensor(k) for k in fh.keys() if k.endswith(("k_scale", "v_scale"))}
                )
        for layer in plan.decoder_layers:
            for k in ("k_scale", "v_scale"):
                t = scales.get(f"{layer}.self_attn.{k}")
                if t is not None and not (
                    torch.isfinite(t.float()).all() and (t.float() > 0).all()
                ):
                    raise StageError(
                        f"{layer}.self_attn.{k} = {t.float().tolist()} is not a calibrated FP8 scale",
                        path=str(out_dir),
                        hint="the KV cache observers saw no data; check the calibration set",
                    )
                if t is None:
                    raise StageError(
                        f"{layer}.self_attn.{k} missing (FP8 KV cache planned)", path=str(out_dir)
                    )
    return {"bytes": total, "tensors": len(keys)}


def verify_reload(out_dir: Path, probe_ids: torch.Tensor, device: str = "cpu") -> dict:
    """Reload with transformers (on `device`) and check the logits are finite."""
    from transformers import AutoModelForCausalLM

    probe_ids = probe_ids.to(device)
    try:
        m = AutoModelForCausalLM.from_pretrained(out_dir, device_map=device)
    except Exception as e:  # noqa: BLE001
        raise StageError(
            f"transformers cannot reload the checkpoint: {e}", path=str(out_dir)
        ) from e
    m.eval()
    with torch.no_grad():
        logits = m(input_ids=probe_ids).logits
    if not torch.isfinite(logits).all():
        bad = _first_nonfinite_module(m, probe_ids)
        raise StageError(
            f"reloaded checkpoint gives non-finite logits (first non-finite output: {bad})",
            path=str(out_dir),
            hint="check that module's scheme; Gemma needs bf16, not fp16",
        )
    return {"probe_tokens": int(probe_ids.numel()), "logits_finite": True}


def _first_nonfinite_module(model, ids) -> str:
    found: list[str] = []
    hooks = []
    for n, mod in model.named_modules():

        def hook(_m, _i, out, n=n):
            t = out[0] if isinstance(out, tuple) else out
            if not found and isinstance(t, torch.Tensor) and not torch.isfinite(t).all():
                found.append(n)

        hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return found[0] if found else "?"


# ---------------------------------------------------------------------------------------


def _cuda_phase_peak(device: str) -> dict | None:
    """Peak CUDA allocation since the last call (then the counter starts again)."""
    if not (device.startswith("cuda") and torch.cuda.is_available()):
        return None
    out = {
        "max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
        "max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
    }
    torch.cuda.reset_peak_memory_stats()
    return out


def _release_llmcompressor_session() -> None:
    """llm-compressor's global session keeps the calibrated model (and its modifiers)
    alive after oneshot returns; reset it so the memory can be freed."""
    try:
        from llmcompressor.core import active_session

        active_session().reset()
    except Exception:  # noqa: BLE001 - only memory is at stake, never the result
        pass


def _peak_memory(device: str, cuda_start: int | None, phases: dict | None = None) -> dict:
    """Peak RSS; on CUDA the peak of the whole quantize (the largest of its phases:
    oneshot = calibration + compression, save, verify = reload check) and each phase's."""
    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    phases = {k: v for k, v in (phases or {}).items() if v}
    if phases:
        out["cuda_max_allocated_bytes"] = max(v["max_allocated_bytes"] for v in phases.values())
        out["cuda_max_reserved_bytes"] = max(v["max_reserved_bytes"] for v in phases.values())
        out["cuda_phases"] = phases
        # live before this quantize started (included in the peaks above)
        out["cuda_allocated_at_start_bytes"] = cuda_start
    return out


def load_model(model_dir: Path, recipe: Recipe, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .devices import compute_dtype

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=compute_dtype(recipe.dtype, device)
    )
    model.to(device)
    model.eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    return model, tok


def quantize(
    model_dir: Path,
    recipe: Recipe,
    out_dir: Path,
    *,
    token_sets,
    device: str | None = None,
    progress: bool = True,
    bare: bool = False,
) -> QuantizeResult:
    """Quantize `model_dir` by `recipe` into `out_dir` (complete or absent).

    `bare=True` runs llm-compressor with its defaults (independent pipeline, batch 1)
    instead of qship's (one sequential pass, the recipe's batch size): for benchmarks.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists():
        raise UsageError(
            f"output directory {out_dir} already exists",
            path=str(out_dir),
            hint="remove it or pick another --out",
        )
    device = device or default_device()
    cuda_start = None
    if device.startswith("cuda"):
        # what an earlier stage of this process left unreachable (a compare runs many
        # recipes in one process) must not count as this quantize's peak
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cuda_start = int(torch.cuda.memory_allocated())
    with library_logs_to_stderr():
        return _quantize(model_dir, recipe, out_dir, token_sets, device, progress, bare, cuda_start)


def _quantize(
    model_dir, recipe, out_dir, token_sets, device, progress, bare, cuda_start
) -> QuantizeResult:
    from datasets import Dataset
    from llmcompressor import oneshot

    t0 = time.perf_counter()
    model, tok = load_model(model_dir, recipe, device)
    plan = build_plan(model, recipe)
    modifiers = build_modifiers(plan, recipe)
    t_load = time.perf_counter() - t0
    _log(
        f"{plan.architecture}: {len(plan.modules)} Linear modules, "
        f"{sum(1 for m in plan.modules if m.scheme)} quantized; modifiers: "
        + ", ".join(type(m).__name__ for m in modifiers)
        + f"; device {device}"
    )

    calib = recipe.calibration
    ids = token_sets.calib_ids
    n, L = ids.shape
    ds = Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}
    )
    needs_data = recipe.needs_calibration()
    kwargs: dict[str, Any] = {
        "model": model,
        "tokenizer": tok,
        "recipe": modifiers,
        "num_calibration_samples": n,
        "max_seq_length": L,
    }
    if needs_data:
        kwargs["dataset"] = ds
        if not bare:
            kwargs.update(
                batch_size=calib.batch_size,
                pipeline="sequential",
                shuffle_calibration_samples=False,
            )
    elif not bare:
        kwargs["pipeline"] = "datafree"

    report: dict[str, Any] = {
        "recipe": recipe.name,
        "recipe_hash": recipe.hash(),
        "model_dir": str(model_dir),
        "device": device,
        "mode": "bare llm-compressor defaults" if bare else "qship (sequential pipeline, batched)",
        "calibration": {**token_sets.to_json(), "batch_size": 1 if bare else calib.batch_size},
        "modifiers": [type(m).__name__ for m in modifiers],
    }
    t1 = time.perf_counter()
    lean = contextlib.nullcontext() if bare else awq_lean_grid_search()
    with (
        cpu_pin_memory_fix() as patched,
        lean,
        capture_metrics(model, plan, report, progress=progress),
    ):
        report["cpu_pin_memory_patch"] = patched
        try:
            model = oneshot(**kwargs) or model
        except Exception as e:
            raise StageError(
                f"llm-compressor oneshot failed: {type(e).__name__}: {e}", path=str(model_dir)
            ) from e
    t_oneshot = time.perf_counter() - t1
    phases = {"oneshot": _cuda_phase_peak(device)}
    _log(f"oneshot done in {t_oneshot:.1f} s; saving compressed")

    with atomic_dir(out_dir) as tmp:
        t2 = time.perf_counter()
        model.to(TORCH_DTYPES[recipe.dtype])  # computed in float32 on the CPU (devices.py)
        model.save_pretrained(tmp, save_compressed=True)
        for f in TOKENIZER_FILES:
            if (model_dir / f).is_file():
                shutil.copyfile(model_dir / f, tmp / f)
        if (model_dir / "generation_config.json").is_file():
            shutil.copyfile(model_dir / "generation_config.json", tmp / "generation_config.json")
        # llm-compressor writes its own recipe.yaml; keep it under a name that cannot be
        # taken for qship's resolved recipe (package writes recipe.yaml)
        if (tmp / "recipe.yaml").is_file():
            (tmp / "recipe.yaml").rename(tmp / "llmcompressor_recipe.yaml")
        t_save = time.perf_counter() - t2
        phases["save"] = _cuda_phase_peak(device)
        # the reload check needs only the saved files: drop every reference to the calibrated
        # model first (ours, oneshot's kwargs, llm-compressor's session), so it is not
        # resident beside the reloaded one
        del model
        kwargs.clear()
        _release_llmcompressor_session()
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        from .plan import load_meta_model

        meta = load_meta_model(tmp)
        report["config_check"] = verify_saved_config(tmp, plan, meta)
        tensors = verify_tensors(tmp, plan)
        report["reload_check"] = verify_reload(
            tmp, token_sets.heldout_ids[:1, : min(64, token_sets.heldout_ids.shape[1])], device
        )
        q = [m for m in plan.modules if m.scheme]
        report["checkpoint"] = {
            "bytes": tensors["bytes"],
            "expected_bytes": plan.expected_checkpoint_bytes,
            "bits_per_weight_quantized": plan.bits_per_weight["quantized"],
            "bits_per_weight_linear": plan.bits_per_weight["linear"],
            "quantized_modules": len(q),
            "kept_modules": len(plan.modules) - len(q),
        }
        phases["verify"] = _cuda_phase_peak(device)
        seconds = time.perf_counter() - t0
        peak = _peak_memory(device, cuda_start, phases)
        report["timings"] = {
            "load_and_plan": t_load,
            "oneshot": t_oneshot,
            "save": t_save,
            "total": seconds,
        }
        report["peak_memory"] = peak
        report["plan"] = plan.to_json()
        (tmp / REPORT).write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
    _log(f"wrote {out_dir} ({tensors['bytes'] / 1e6:.2f} MB) in {seconds:.1f} s")
    return QuantizeResult(out_dir, plan, report, seconds, peak)
