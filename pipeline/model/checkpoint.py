"""The one checkpoint validator: quantize's post-save check and `qship verify` both call it.

`inspect_checkpoint(root)` holds a saved compressed-tensors checkpoint against the model
its own config.json describes (built on the meta device, so no weight is loaded):

1. every *.safetensors header is well-formed, no tensor is stored twice, and the index
   (when sharded) maps every tensor to the shard that holds it;
2. config.json has a quantization_config and transformers can build its architecture;
3. every parameter of that architecture is stored with its shape: a Linear module claimed
   by a config group (compressed-tensors' own matching, `ignore` honoured) as packed int
   weights whose weight_shape / weight_packed / weight_scale / weight_zero_point agree with
   the group's num_bits, strategy, group_size and symmetric; any other parameter dense (an
   output embedding tied to the input one stored once); embeddings, norms and a dense head
   in config.json's dtype;
4. with a kv_cache_scheme, every attention module has its k_scale and v_scale;
5. every stored scale is finite and positive (an uncalibrated module leaves NaN or 0);
6. no tensor that the architecture does not have;
7. the modules vLLM fuses into one layer (q/k/v, gate/up, an MoE block's experts) are
   stored alike (`roles.split_fused`).

It returns the scheme every Linear module was saved with; quantize holds that against its
plan (llm-compressor lets a later modifier silently win on overlapping targets).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, QshipError
from ..io.problems import Problems, read_json_object
from ..io.safetensors_header import (
    FLOAT_DTYPES,
    Header,
    TensorInfo,
    read_header,
    read_int_tensor,
    read_tensor_bytes,
)
from ..records.plan import ActivationScheme, ModuleScheme
from .devices import DTYPES
from .matching import matches
from .moe import saved_name_to_module
from .roles import split_fused

INDEX = "model.safetensors.index.json"
QUANT_PARAMS = (
    "weight_packed",
    "weight_scale",
    "weight_shape",
    "weight_zero_point",
    "weight_g_idx",
)
# int8 / FP8 values stored as `weight` (int-quantized, float-quantized: W8A8, FP8), with
# input_scale for static activations
UNPACKED_PARAMS = ("weight", "weight_scale", "weight_zero_point", "input_scale")
STORED_DTYPE = {"int": "I8", "float": "F8_E4M3"}
KV_SCALES = ("k_scale", "v_scale")
Tensors = dict[str, tuple[str, TensorInfo]]  # name -> (file, header entry)


@dataclass(frozen=True)
class CheckpointInspection:
    architecture: str
    schemes: dict[str, ModuleScheme | None]  # every Linear module -> its saved scheme
    kv_cache: bool
    format: str | None
    config_groups: int
    tensors: int
    bytes: int


def inspect_checkpoint(
    root: Path, *, error: type[QshipError] = IntegrityError, hint: str = ""
) -> CheckpointInspection:
    """Check the checkpoint in `root` (see the module docstring); any problem raises
    `error` listing them all, its path the first offending file."""
    root = Path(root)
    p = Problems(root, error=error, hint=hint)
    config = read_json_object(root / "config.json", p, "config.json")
    p.raise_if_any("config check")
    assert config is not None
    headers = read_headers(root, p)
    p.raise_if_any("safetensors header check")
    tensors = stored_tensors(root, headers, p)
    p.raise_if_any("safetensors index check")
    # a family saved in its Hub layout (Mixtral) is checked under the model's own names
    to_module = saved_name_to_module(text_config(config).get("model_type"))
    tensors = {to_module(n): v for n, v in tensors.items()}
    headers = {rel: dataclasses.replace(h, tensors={to_module(n): t for n, t in h.tensors.items()})
               for rel, h in headers.items()}  # fmt: skip
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        p.add("config.json", "no quantization_config object (not a quantized checkpoint)")
    model = _meta(root, p)
    p.raise_if_any("config check")
    assert isinstance(qc, dict)
    schemes, kv = _check_model(root, config, qc, model, headers, tensors, p)
    p.raise_if_any("weights vs config.json check")
    return CheckpointInspection(
        architecture=type(model).__name__,
        schemes=schemes,
        kv_cache=kv,
        format=qc.get("format"),
        config_groups=len(qc.get("config_groups") or {}),
        tensors=len(tensors),
        bytes=sum(h.file_size for h in headers.values()),
    )


# ------------------------------------------------------------------ files


def read_headers(root: Path, p: Problems) -> dict[str, Header]:
    headers: dict[str, Header] = {}
    # the weights are the top-level shards, as transformers and vLLM load them (an
    # artifact's qship/measured.safetensors is data beside them, covered by SHA256SUMS)
    for rel in sorted(q.name for q in root.glob("*.safetensors")):
        try:
            headers[rel] = read_header(root / rel)
        except IntegrityError as e:
            p.add(rel, e.message)
    if not headers and not p:
        p.add("model.safetensors", "no *.safetensors weight file")
    return headers


def stored_tensors(root: Path, headers: dict[str, Header], p: Problems) -> Tensors:
    owner: dict[str, str] = {}
    for rel, h in headers.items():
        for name in h.tensors:
            if name in owner:
                p.add(rel, f"tensor {name!r} also stored in {owner[name]}")
            owner[name] = rel
    if (root / INDEX).exists():
        index = read_json_object(root / INDEX, p, INDEX)
        wmap = index.get("weight_map") if index else None
        if not isinstance(wmap, dict):
            p.add(INDEX, "no weight_map object")
        else:
            for name, rel in sorted(wmap.items()):
                if owner.get(name) != rel:
                    p.add(INDEX, f"maps {name!r} to {rel!r}, found in {owner.get(name)}")
            for name in sorted(set(owner) - set(wmap)):
                p.add(owner[name], f"tensor {name!r} missing from {INDEX}")
    elif len(headers) > 1:
        p.add(INDEX, f"{len(headers)} shards but no index file")
    return {name: (rel, headers[rel].tensors[name]) for name, rel in owner.items()}


def _meta(root: Path, p: Problems) -> Any:
    from .loading import load_meta_model

    try:
        return load_meta_model(root)
    except Exception as e:  # noqa: BLE001 - any config transformers cannot build is a problem
        p.add("config.json", f"transformers cannot build the model it describes "
                             f"({type(e).__name__}: {str(e)[:200]})")  # fmt: skip
        return None


# ------------------------------------------------------------------ tensors vs the model


def _dims_note(shape: tuple[int, ...], cfg: dict) -> str:
    """Name the config.json fields a shape is made of: '(vocab_size 2048, hidden_size 512)'."""
    ints = {k: v for k, v in cfg.items() if isinstance(v, int) and not isinstance(v, bool)}
    names = [next((f"{k} {d}" for k, v in ints.items() if v == d), str(d)) for d in shape]
    return f"({', '.join(names)})"


def _check_model(root, config, qc, model, headers, tensors: Tensors, p: Problems):
    import torch

    cfg = text_config(config)
    dt = DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("dtype")))
    groups = qc.get("config_groups") or {}
    ignore = [x for x in (qc.get("ignore") or []) if isinstance(x, str)]
    if not isinstance(groups, dict) or not isinstance(qc.get("ignore") or [], list):
        p.add("config.json", "quantization_config.config_groups / ignore malformed")
        return {}, False
    mods = dict(model.named_modules())
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied_head = next(
        (n for n, m in mods.items() if m is out_emb and out_emb.weight is in_emb.weight), None
    )
    expected: set[str] = set()
    schemes: dict[str, ModuleScheme | None] = {}

    def need(name: str, shape: tuple[int, ...], module: Any = None) -> None:
        expected.add(name)
        if name not in tensors:
            p.add("config.json", f"{name}: absent from the weights {_dims_note(shape, cfg)}")
            return
        rel, t = tensors[name]
        if t.shape != shape:
            p.add(rel, f"{name}: shape {list(t.shape)} != expected {list(shape)} "
                       f"{_dims_note(shape, cfg)} from config.json")  # fmt: skip
        norm_or_emb = isinstance(module, torch.nn.Embedding) or "Norm" in type(module).__name__
        if dt and norm_or_emb and t.dtype in FLOAT_DTYPES and t.dtype != dt.safetensors:
            p.add(rel, f"{name}: dtype {t.dtype} != config.json dtype {dt.name}")

    for name, mod in mods.items():
        if isinstance(mod, torch.nn.Linear):
            hits = [
                (g, spec)
                for g, spec in groups.items()
                if isinstance(spec, dict) and matches(name, mod, spec.get("targets") or [], ignore)
            ]
            if len(hits) > 1:
                p.add("config.json", f"{name} is matched by {len(hits)} config groups "
                                     f"({[h[0] for h in hits]}); one at most")  # fmt: skip
            if hits and isinstance(hits[0][1].get("weights"), dict):
                gname, spec = hits[0]
                packed = (spec.get("format") or qc.get("format")) == "pack-quantized"
                shape = (mod.out_features, mod.in_features)
                if packed:
                    expected.update(f"{name}.{q}" for q in QUANT_PARAMS)
                    errs = _check_packed(root, name, spec["weights"], tensors, headers, shape)
                else:
                    expected.update(f"{name}.{q}" for q in UNPACKED_PARAMS)
                    errs = _check_unpacked(name, spec, tensors, shape)
                if errs:
                    p.add(_file_of(tensors, name), f"{name}: [{gname}] " + "; ".join(errs))
                schemes[name] = _scheme(spec["weights"], spec.get("input_activations"))
                if packed and f"{name}.weight" in tensors:
                    p.add(_file_of(tensors, name), f"{name} is claimed by config group {gname} "
                                                   "but stored dense")  # fmt: skip
            else:
                schemes[name] = None
                if f"{name}.weight_packed" in tensors:
                    where = (
                        "listed in quantization_config.ignore"
                        if any(matches(name, mod, [i]) for i in ignore)
                        else "no quantization_config group targets it"
                    )
                    p.add(_file_of(tensors, name), f"{name} is stored quantized but {where}")
                elif name != tied_head:
                    need(f"{name}.weight", (mod.out_features, mod.in_features), mod)
                if f"{name}.weight_scale" in tensors:
                    expected.add(f"{name}.weight_scale")
                    p.add(
                        _file_of(tensors, name), f"{name} has a weight_scale but is not quantized"
                    )
            if mod.bias is not None:
                need(f"{name}.bias", tuple(mod.bias.shape), mod)
            continue
        for pname, _ in mod.named_parameters(recurse=False):
            key = f"{name}.{pname}" if name else pname
            need(key, shapes[key], mod)
        for bname in getattr(mod, "_buffers", {}):
            key = f"{name}.{bname}" if name else bname
            if key in shapes:  # persistent buffers only
                need(key, shapes[key], mod)

    kv = isinstance(qc.get("kv_cache_scheme"), dict)
    attention = sorted({n.rsplit(".", 1)[0] for n in mods if n.endswith((".k_proj", ".qkv_proj"))})
    for attn in attention:
        for s in KV_SCALES:
            name = f"{attn}.{s}"
            expected.add(name)
            if kv and name not in tensors:
                p.add("config.json", f"kv_cache_scheme set but {name} is absent")
    for msg in split_fused(schemes):  # a checkpoint written elsewhere, or before the rule
        p.add("config.json", msg)
    _check_scale_values(root, tensors, headers, p)
    check_layers(cfg, tensors, p)
    for name in sorted(set(tensors) - expected):
        p.add(tensors[name][0], f"{name}: not a tensor of {type(model).__name__}")
    return schemes, kv


def _file_of(tensors: Tensors, module: str) -> str:
    for suffix in ("weight_packed", "weight", "weight_scale"):
        if f"{module}.{suffix}" in tensors:
            return tensors[f"{module}.{suffix}"][0]
    return "config.json"


def _scheme(w: dict, a: Any = None) -> ModuleScheme:
    observer = w.get("observer")
    strategy = w.get("strategy")
    act = None
    if isinstance(a, dict):
        act = ActivationScheme(
            type=a.get("type") or "int", bits=int(a.get("num_bits") or 0),
            strategy=a.get("strategy") or "tensor", dynamic=bool(a.get("dynamic")),
            group_size=a.get("group_size") if a.get("strategy") == "group" else None,
        )  # fmt: skip
    return ModuleScheme(
        bits=int(w.get("num_bits") or 0),
        symmetric=bool(w.get("symmetric")),
        group_size=w.get("group_size") if strategy == "group" else None,
        # min-max in any of its forms is the default (null in a recipe)
        observer=None if observer is None or "minmax" in str(observer) else str(observer),
        type=w.get("type") or "int",
        strategy=strategy if strategy in ("group", "channel", "tensor", "block") else "group",
        block=list(w["block_structure"]) if w.get("block_structure") else None,
        activations=act,
    )


def _scale_shape(w: dict, out: int, inn: int) -> tuple[int, ...] | str:
    """The weight_scale shape a weight's strategy implies (a message when it is malformed)."""
    strategy, gs, block = w.get("strategy"), w.get("group_size"), w.get("block_structure")
    if strategy == "group":
        if not isinstance(gs, int) or gs <= 0:
            return f"strategy group with group_size {gs!r}"
        return (out, math.ceil(inn / gs))
    if strategy == "channel":
        return (out, 1)
    if strategy == "tensor":
        return (1,)
    if strategy == "block":
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                     for b in block)):  # fmt: skip
            return f"strategy block with block_structure {block!r}"
        return (math.ceil(out / block[0]), math.ceil(inn / block[1]))
    return f"unsupported weight strategy {strategy!r}"


def _check_unpacked(module: str, spec: dict, tensors: Tensors, shape: tuple[int, int]) -> list[str]:
    """int8 or FP8 values stored as `weight` (int-quantized / float-quantized)."""
    w = spec["weights"]
    want = STORED_DTYPE.get(str(w.get("type")))
    t = tensors.get(module + ".weight")
    if t is None:
        return ["quantized by config but weight is absent"]
    errs = []
    if t[1].dtype != want:
        errs.append(f"weight is {t[1].dtype}, expected {want} for {w.get('type')} weights")
    if t[1].shape != shape:
        errs.append(f"weight shape {list(t[1].shape)} != expected {list(shape)} from config.json")
    scale = _scale_shape(w, *shape)
    sc = tensors.get(module + ".weight_scale")
    if isinstance(scale, str):
        errs.append(scale)
    elif sc is None:
        errs.append("weight_scale tensor missing")
    elif sc[1].numel != math.prod(scale) or (len(scale) > 1 and sc[1].shape != scale):
        errs.append(f"weight_scale shape {list(sc[1].shape)} != {list(scale)} "
                    f"(strategy {w.get('strategy')})")  # fmt: skip
    a = spec.get("input_activations")
    static = isinstance(a, dict) and not a.get("dynamic")
    if static and module + ".input_scale" not in tensors:
        errs.append("static input activations but input_scale is absent")
    if not static and module + ".input_scale" in tensors:
        errs.append("input_scale stored but the activations are dynamic (or not quantized)")
    if w.get("symmetric") is True and module + ".weight_zero_point" in tensors:
        errs.append("weight_zero_point present but the group is symmetric")
    return errs


def check_layers(cfg: dict, tensors: Tensors, p: Problems) -> None:
    layers = cfg.get("num_hidden_layers")
    ids = {int(m.group(1)) for n in tensors if (m := re.search(r"\.layers\.(\d+)\.", n))}
    if isinstance(layers, int) and ids and max(ids) + 1 != layers:
        p.add("config.json", f"weights hold {max(ids) + 1} decoder layers but "
                             f"num_hidden_layers is {layers}")  # fmt: skip


def _check_scale_values(root: Path, tensors: Tensors, headers, p: Problems) -> None:
    """Stored scales must be finite and positive: a module or expert that calibration never
    reached is saved with NaN or 0 scales, which load fine and then produce garbage."""
    import torch

    ends = (".weight_scale", ".input_scale", *(f".{s}" for s in KV_SCALES))
    names = [n for n in tensors if n.endswith(ends)]
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(tensors[n][0], []).append(n)
    codes = {d.safetensors: d for d in DTYPES.values()}
    for rel, ns in sorted(by_file.items()):
        try:
            # by the header's offsets: the names here are the model's, the file's may differ
            with open(root / rel, "rb") as fh:
                for n in sorted(ns):
                    info = headers[rel].tensors[n]
                    raw = bytearray(read_tensor_bytes(fh, headers[rel], n))
                    t = torch.frombuffer(raw, dtype=codes[info.dtype].torch()).float()
                    bad = int((~(t.isfinite() & (t > 0))).sum())
                    if bad:
                        p.add(rel, f"{n}: {bad} of {t.numel()} scale(s) not finite and positive "
                                   "(a module that calibration did not reach?)")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - an unreadable tensor is a problem, not a crash
            p.add(rel, f"cannot read scales ({type(e).__name__}: {str(e)[:120]})")


def _check_packed(root, module, w, tensors: Tensors, headers, expected) -> list[str]:
    if module + ".weight_packed" not in tensors:
        return ["quantized by config but weight_packed is absent"]
    _, tp = tensors[module + ".weight_packed"]
    if tp.dtype != "I32" or len(tp.shape) != 2:
        return [f"weight_packed is {tp.dtype}{list(tp.shape)}, expected a 2-D I32 tensor"]
    if module + ".weight_shape" not in tensors:
        return ["weight_shape tensor missing"]
    srel, _ = tensors[module + ".weight_shape"]
    try:
        shape = read_int_tensor(root / srel, headers[srel], module + ".weight_shape")
    except IntegrityError as e:
        return [e.message]
    if len(shape) != 2 or min(shape) <= 0:
        return [f"weight_shape {shape} is not [out, in]"]
    out, inn = shape
    errs = []
    if (out, inn) != tuple(expected):
        errs.append(f"weight_shape {shape} != expected {list(expected)} from config.json")
    bits = w.get("num_bits")
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        return errs + [f"num_bits {bits!r} not in 1..8"]
    want = (out, math.ceil(inn * bits / 32))
    if tp.shape != want:
        errs.append(f"weight_packed shape {list(tp.shape)} != {list(want)} for {bits}-bit {shape}")
    scale = _scale_shape(w, out, inn)
    if isinstance(scale, str):
        return errs + [scale]
    ngroups = scale[1] if len(scale) == 2 else None
    if module + ".weight_scale" not in tensors:
        return errs + ["weight_scale tensor missing"]
    _, tsc = tensors[module + ".weight_scale"]
    if tsc.dtype not in FLOAT_DTYPES:
        errs.append(f"weight_scale dtype {tsc.dtype} is not floating point")
    if ngroups is None:
        if tsc.numel != 1:
            errs.append(f"weight_scale shape {list(tsc.shape)} for per-tensor strategy")
    elif tsc.shape != scale:
        errs.append(
            f"weight_scale shape {list(tsc.shape)} != {list(scale)} "
            f"(strategy {w.get('strategy')}, group_size {w.get('group_size')}, in_features {inn})"
        )
    zp = tensors.get(module + ".weight_zero_point")
    if w.get("symmetric") is True and zp is not None:
        errs.append("weight_zero_point present but the group is symmetric")
    if w.get("symmetric") is False:
        if zp is None:
            errs.append("weight_zero_point missing but the group is asymmetric")
        elif ngroups is not None and zp[1].shape not in (
            (math.ceil(out * bits / 32), ngroups),
            (out, ngroups),
        ):
            errs.append(
                f"weight_zero_point shape {list(zp[1].shape)} does not fit [{out}, {ngroups}]"
            )
    return errs


def text_config(config: dict) -> dict:
    """The decoder's part of a config.json (multimodal configs nest it)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config
