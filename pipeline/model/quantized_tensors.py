"""The tensors one quantized Linear is stored as, checked against its config group
(checkpoint.py's validator calls these per module): packed int words with weight_shape
(pack-quantized), int8 or FP8 values (int-quantized, float-quantized) with input_scale for
static activations; and every stored scale finite and positive."""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import IntegrityError
from ..io.problems import Problems
from ..io.safetensors_header import FLOAT_DTYPES, TensorInfo, read_int_tensor, read_tensor_bytes
from .devices import DTYPES

Tensors = dict[str, tuple[str, TensorInfo]]  # name -> (file, header entry)
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
# attention quantization (a calibrated query scale) adds q_scale; llm-compressor also writes
# zero points for all three, which vLLM loads and ignores (symmetric FP8)
ATTN_TENSORS = ("q_scale", "q_zero_point", "k_zero_point", "v_zero_point")
# an FP8 attention scale is amax / 448: anything outside this was never calibrated (memory
# left as it was allocated: 1e-43 and 8e21 seen from llm-compressor 0.14's query scale)
ATTN_SCALE_RANGE = (1e-10, 1e4)


def scale_shape(w: dict, out: int, inn: int) -> tuple[int, ...] | str:
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


def check_unpacked(module: str, spec: dict, tensors: Tensors, shape: tuple[int, int]) -> list[str]:
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
    scale = scale_shape(w, *shape)
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


def check_scale_values(root: Path, tensors: Tensors, headers, p: Problems) -> None:
    """Stored scales must be finite and positive: a module or expert that calibration never
    reached is saved with NaN or 0 scales, which load fine and then produce garbage."""
    import torch

    attn = (*(f".{s}" for s in KV_SCALES), ".q_scale")
    lo, hi = ATTN_SCALE_RANGE
    ends = (".weight_scale", ".input_scale", *attn)
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
                    elif n.endswith(attn) and not bool(((t >= lo) & (t <= hi)).all()):
                        p.add(rel, f"{n}: scale {t.min().item():.3g}..{t.max().item():.3g} is "
                                   "no calibrated FP8 attention scale (never observed?)")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - an unreadable tensor is a problem, not a crash
            p.add(rel, f"cannot read scales ({type(e).__name__}: {str(e)[:120]})")


def check_packed(root, module, w, tensors: Tensors, headers, expected) -> list[str]:
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
    scale = scale_shape(w, out, inn)
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
