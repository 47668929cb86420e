"""The one checkpoint validator: quantize's post-save check and `qship verify` both call it.

`inspect_checkpoint(root)` holds a saved compressed-tensors checkpoint against the model
its own config.json describes (built on the meta device, so no weight is loaded):

1. every *.safetensors header is well-formed, no tensor is stored twice, and the index
   (when sharded) maps every tensor to the shard that holds it;
2. config.json has a quantization_config and transformers can build its architecture;
3. every parameter of that architecture is stored with its shape: a Linear module claimed
   by a config group (compressed-tensors' own matching, `ignore` honoured) as its format
   stores it -- packed int words, or int8 / FP8 values -- with scales, zero points and
   input_scale that agree with the group's scheme (quantized_tensors.py); any other
   parameter dense (an
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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, QshipError
from ..io.problems import Problems, read_json_object
from ..io.safetensors_header import (
    FLOAT_DTYPES,
    Header,
    read_header,
)
from ..records.plan import ActivationScheme, ModuleScheme
from .devices import DTYPES
from .files import collect_config_json
from .matching import matches
from .moe import saved_name_to_module
from .quantized_tensors import (
    ATTN_TENSORS,
    KV_SCALES,
    QUANT_PARAMS,
    UNPACKED_PARAMS,
    Tensors,
    check_packed,
    check_scale_values,
    check_unpacked,
)
from .roles import split_fused

INDEX = "model.safetensors.index.json"


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
    config = collect_config_json(root, p)
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
    """Every tensor the model built from `config` needs, against the stored ones; problems
    go to `p`. -> (every Linear module -> its saved scheme, whether a KV cache is quantized)."""
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not isinstance(qc.get("ignore") or [], list):
        p.add("config.json", "quantization_config.config_groups / ignore malformed")
        return {}, False
    check = _ModelCheck(root, config, qc, model, headers, tensors, p)
    mods = dict(model.named_modules())
    for name, mod in mods.items():
        check.module(name, mod)
    kv = isinstance(qc.get("kv_cache_scheme"), dict)
    check.attention(model, mods, kv)
    for msg in split_fused(check.schemes):  # a checkpoint written elsewhere, or before the rule
        p.add("config.json", msg)
    check_scale_values(root, tensors, headers, p)
    check_layers(check.cfg, tensors, p)
    for name in sorted(set(tensors) - check.expected):
        p.add(tensors[name][0], f"{name}: not a tensor of {type(model).__name__}")
    return check.schemes, kv


class _ModelCheck:
    """The walk of `_check_model`: the tensors expected so far, each Linear's scheme."""

    def __init__(self, root, config, qc, model, headers, tensors: Tensors, p: Problems):
        self.root, self.qc, self.headers, self.tensors, self.p = root, qc, headers, tensors, p
        self.cfg = cfg = text_config(config)
        self.dt = DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("dtype")))
        self.groups = qc.get("config_groups") or {}
        self.ignore = [x for x in (qc.get("ignore") or []) if isinstance(x, str)]
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
        self.tied_head = next(
            (n for n, m in model.named_modules()
             if m is out_emb and out_emb.weight is in_emb.weight), None,
        )  # fmt: skip
        self.expected: set[str] = set()
        self.schemes: dict[str, ModuleScheme | None] = {}

    def need(self, name: str, shape: tuple[int, ...], module: Any = None) -> None:
        """`name` must be stored with `shape` (norms and embeddings in config.json's dtype)."""
        import torch

        self.expected.add(name)
        p, cfg, dt = self.p, self.cfg, self.dt
        if name not in self.tensors:
            p.add("config.json", f"{name}: absent from the weights {_dims_note(shape, cfg)}")
            return
        rel, t = self.tensors[name]
        if t.shape != shape:
            p.add(rel, f"{name}: shape {list(t.shape)} != expected {list(shape)} "
                       f"{_dims_note(shape, cfg)} from config.json")  # fmt: skip
        norm_or_emb = isinstance(module, torch.nn.Embedding) or "Norm" in type(module).__name__
        if dt and norm_or_emb and t.dtype in FLOAT_DTYPES and t.dtype != dt.safetensors:
            p.add(rel, f"{name}: dtype {t.dtype} != config.json dtype {dt.name}")

    def module(self, name: str, mod: Any) -> None:
        import torch

        if isinstance(mod, torch.nn.Linear):
            self.linear(name, mod)
            return
        for pname, _ in mod.named_parameters(recurse=False):
            key = f"{name}.{pname}" if name else pname
            self.need(key, self.shapes[key], mod)
        for bname, _ in mod.named_buffers(recurse=False, remove_duplicate=False):
            key = f"{name}.{bname}" if name else bname
            if key in self.shapes:  # persistent buffers only
                self.need(key, self.shapes[key], mod)

    def linear(self, name: str, mod: Any) -> None:
        hits = [
            (g, spec)
            for g, spec in self.groups.items()
            if isinstance(spec, dict) and matches(name, mod, spec.get("targets") or [], self.ignore)
        ]
        if len(hits) > 1:
            self.p.add("config.json", f"{name} is matched by {len(hits)} config groups "
                                      f"({[h[0] for h in hits]}); one at most")  # fmt: skip
        if hits and isinstance(hits[0][1].get("weights"), dict):
            self.quantized_linear(name, mod, *hits[0])
        else:
            self.dense_linear(name, mod)
        if mod.bias is not None:
            self.need(f"{name}.bias", tuple(mod.bias.shape), mod)

    def quantized_linear(self, name: str, mod: Any, gname: str, spec: dict) -> None:
        tensors = self.tensors
        packed = (spec.get("format") or self.qc.get("format")) == "pack-quantized"
        shape = (mod.out_features, mod.in_features)
        if packed:
            self.expected.update(f"{name}.{q}" for q in QUANT_PARAMS)
            errs = check_packed(self.root, name, spec["weights"], tensors, self.headers, shape)
        else:
            self.expected.update(f"{name}.{q}" for q in UNPACKED_PARAMS)
            errs = check_unpacked(name, spec, tensors, shape)
        if errs:
            self.p.add(_file_of(tensors, name), f"{name}: [{gname}] " + "; ".join(errs))
        self.schemes[name] = _scheme(spec["weights"], spec.get("input_activations"))
        if packed and f"{name}.weight" in tensors:
            self.p.add(_file_of(tensors, name), f"{name} is claimed by config group {gname} "
                                                "but stored dense")  # fmt: skip

    def dense_linear(self, name: str, mod: Any) -> None:
        tensors = self.tensors
        self.schemes[name] = None
        if f"{name}.weight_packed" in tensors:
            where = (
                "listed in quantization_config.ignore"
                if any(matches(name, mod, [i]) for i in self.ignore)
                else "no quantization_config group targets it"
            )
            self.p.add(_file_of(tensors, name), f"{name} is stored quantized but {where}")
        elif name != self.tied_head:
            self.need(f"{name}.weight", (mod.out_features, mod.in_features), mod)
        if f"{name}.weight_scale" in tensors:
            self.expected.add(f"{name}.weight_scale")
            self.p.add(_file_of(tensors, name), f"{name} has a weight_scale but is not quantized")

    def attention(self, model: Any, mods: dict[str, Any], kv: bool) -> None:
        """The KV-cache (and attention) scales each attention module must store."""
        attention = sorted(
            {n.rsplit(".", 1)[0] for n in mods if n.endswith((".k_proj", ".qkv_proj"))}
        )
        query = attention and _attention_group(
            self.qc, type(model.get_submodule(attention[0])).__name__
        )
        # q_scale and the zero points belong to attention quantization alone
        allowed = (*KV_SCALES, *ATTN_TENSORS) if query else KV_SCALES
        required = (*KV_SCALES, "q_scale") if query else KV_SCALES
        for attn in attention:
            self.expected.update(f"{attn}.{s}" for s in allowed)
            for s in required:
                if (kv or query) and f"{attn}.{s}" not in self.tensors:
                    self.p.add("config.json", f"{'attention' if query else 'kv_cache_scheme'} "
                                              f"quantization set but {attn}.{s} is absent")  # fmt: skip


def _attention_group(qc: dict, attention_class: str) -> bool:
    return any(query_group(g, attention_class) for g in (qc.get("config_groups") or {}).values())


def query_group(group: Any, attention_class: str | None = None) -> bool:
    """Whether a config group quantizes the attention modules themselves (their query): one
    target, their class name (`attention_class`, or without it any name ending in
    "Attention") -- the form vLLM 0.26 recognises and leaves to its KV method."""
    targets = group.get("targets") if isinstance(group, dict) else None
    if not group or not isinstance(targets, list) or len(targets) != 1:
        return False
    name = str(targets[0])
    return bool(group.get("input_activations")) and (
        name == attention_class if attention_class else name.endswith("Attention")
    )


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


def check_layers(cfg: dict, tensors: Tensors, p: Problems) -> None:
    layers = cfg.get("num_hidden_layers")
    ids = {int(m.group(1)) for n in tensors if (m := re.search(r"\.layers\.(\d+)\.", n))}
    if isinstance(layers, int) and ids and max(ids) + 1 != layers:
        p.add("config.json", f"weights hold {max(ids) + 1} decoder layers but "
                             f"num_hidden_layers is {layers}")  # fmt: skip


def text_config(config: dict) -> dict:
    """The decoder's part of a config.json (multimodal configs nest it)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config
