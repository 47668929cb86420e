"""Property tests: the safetensors and SHA256SUMS readers reject bad input, never crash.

Any input either parses or raises IntegrityError; nothing else may escape. Where the
safetensors reader accepts a file, the safetensors library must load it too (our reader
is at least as strict as the one transformers uses).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.artifact.verify import check_weights
from pipeline.errors import IntegrityError
from pipeline.io.hashing import check_relpath, parse_sha256sums
from pipeline.io.safetensors_header import (
    DTYPE_SIZES,
    header_bytes,
    layout,
    parse_header,
    read_header,
)

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
TORCH_DTYPES = ["F32", "F16", "BF16", "I32", "I64", "U8", "I8", "BOOL"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

tensor_specs = st.dictionaries(
    st.text(alphabet="abcdefgh._0123", min_size=1, max_size=12),
    st.tuples(st.sampled_from(TORCH_DTYPES), st.lists(st.integers(0, 5), max_size=3).map(tuple)),
    min_size=1,
    max_size=5,
)


def build_file(specs) -> bytes:
    lay = layout(specs)
    hb = header_bytes(lay, {"format": "pt"})
    size = max((t.end for t in lay.values()), default=0)
    return struct.pack("<Q", len(hb)) + hb + bytes(range(256)) * (size // 256) + bytes(size % 256)


def parse_or_reject(data: bytes):
    try:
        return parse_header(data, len(data), where="fuzz.safetensors")
    except IntegrityError as e:
        assert e.path == "fuzz.safetensors" and e.exit_code == 3
        return None


def library_accepts(data: bytes) -> bool:
    from safetensors.torch import load

    try:
        load(data)
        return True
    except Exception:  # noqa: BLE001
        return False


# ------------------------------------------------------------------ safetensors


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes(data):
    parse_or_reject(data)


@FUZZ
@given(st.integers(0, 2**64 - 1), st.binary(max_size=512))
def test_random_length_prefix(n, rest):
    parse_or_reject(struct.pack("<Q", n) + rest)


@FUZZ
@given(json_values, st.integers(0, 64))
def test_random_json_header(obj, pad):
    raw = json.dumps(obj).encode() + b" " * pad
    data = struct.pack("<Q", len(raw)) + raw + b"\0" * 64
    h = parse_or_reject(data)
    if h is not None:
        assert library_accepts(data)


@FUZZ
@given(tensor_specs)
def test_valid_files_roundtrip(specs):
    data = build_file(specs)
    h = parse_or_reject(data)
    assert h is not None
    assert {n: (t.dtype, t.shape) for n, t in h.tensors.items()} == specs
    assert library_accepts(data)


@FUZZ
@given(tensor_specs, st.data())
def test_mutated_files(specs, data):
    raw = bytearray(build_file(specs))
    (n,) = struct.unpack("<Q", raw[:8])
    kind = data.draw(st.sampled_from(["flip", "truncate", "length", "field", "extend"]))
    if kind == "flip":
        i = data.draw(st.integers(0, 8 + n - 1))
        raw[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "length":
        raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    elif kind == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=64))
    else:
        header = json.loads(raw[8 : 8 + n])
        name = data.draw(st.sampled_from(sorted(header)))
        if name == "__metadata__":
            header[name] = data.draw(json_values)
        else:
            field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
            header[name][field] = data.draw(
                json_values | st.sampled_from(sorted(DTYPE_SIZES)) | st.lists(st.integers(-3, 9))
            )
        hb = json.dumps(header).encode()
        raw = bytearray(struct.pack("<Q", len(hb)) + hb + raw[8 + n :])
    h = parse_or_reject(bytes(raw))
    if h is not None and all(t.dtype in TORCH_DTYPES for t in h.tensors.values()):
        assert library_accepts(bytes(raw)), h


def test_read_header_on_disk(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(IntegrityError, match="header length"):
        read_header(p)
    p.write_bytes(b"")
    with pytest.raises(IntegrityError):
        read_header(p)
    with pytest.raises(IntegrityError):
        read_header(tmp_path / "absent.safetensors")


# ------------------------------------------------------------------ weights vs config


CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 16,
    "vocab_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "dtype": "bfloat16",
    "quantization_config": {
        "format": "pack-quantized",
        "quant_method": "compressed-tensors",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "strategy": "group", "group_size": 8, "symmetric": True},
            }
        },
    },
}


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.integers(-(2**40), 2**40), min_size=0, max_size=4),
    st.sampled_from(["I64", "I32", "F32", "U8"]),
    st.lists(st.integers(0, 40), min_size=1, max_size=3),
    st.lists(st.integers(0, 40), min_size=0, max_size=3),
    json_values,
)
def test_quantized_tensors_vs_config_never_crash(tmp_path, wshape, sdtype, packed, scale, group):
    """Random weight_shape values / packed and scale shapes / group configs: pass or reject."""
    d = tmp_path / "art"
    d.mkdir(exist_ok=True)
    cfg = json.loads(json.dumps(CONFIG))
    if isinstance(group, dict):
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(group)
    (d / "config.json").write_text(json.dumps(cfg))
    m = "model.layers.0.self_attn.q_proj"
    fmt = {"I64": "q", "I32": "i", "F32": "f", "U8": "B"}[sdtype]
    vals = [v for v in wshape if sdtype in ("I64",) or -(2**31) <= v < 2**31]
    if sdtype == "U8":
        vals = [v % 256 for v in vals]
    if sdtype == "F32":
        vals = [float(v) for v in vals]
    specs = {
        f"{m}.weight_packed": ("I32", tuple(packed)),
        f"{m}.weight_scale": ("BF16", tuple(scale)),
        f"{m}.weight_shape": (sdtype, (len(vals),)),
    }
    lay = layout(specs)
    hb = header_bytes(lay, {"format": "pt"})
    blobs = {
        f"{m}.weight_shape": struct.pack(f"<{len(vals)}{fmt}", *vals),
    }
    body = b"".join(
        blobs.get(name, b"\1" * (lay[name].end - lay[name].begin)) for name in sorted(lay)
    )
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(hb)) + hb + body)
    try:
        check_weights(d, [])
    except IntegrityError as e:
        assert e.exit_code == 3 and str(d) in e.path


# ------------------------------------------------------------------ SHA256SUMS


def sums_or_reject(data: bytes):
    try:
        out = parse_sha256sums(data, where="SHA256SUMS")
    except IntegrityError as e:
        assert e.exit_code == 3 and "SHA256SUMS" in e.path
        return None
    for rel, digest in out.items():
        assert check_relpath(rel, where="x") == rel and len(digest) == 64
        assert ".." not in Path(rel).parts and not rel.startswith("/")
    return out


@FUZZ
@given(st.binary(max_size=1024))
def test_sums_random_bytes(data):
    sums_or_reject(data)


line = st.tuples(
    st.text(alphabet="0123456789abcdefABCDEF xz", min_size=60, max_size=68),
    st.sampled_from(["  ", " *", " ", "\t", "   "]),
    st.text(min_size=0, max_size=30),
).map(lambda t: "".join(t))


@FUZZ
@given(st.lists(line, max_size=6), st.sampled_from(["\n", "\r\n", ""]))
def test_sums_random_lines(lines, end):
    sums_or_reject((end.join(lines) + end).encode("utf-8", "surrogatepass"))


@FUZZ
@given(
    st.lists(
        st.text(alphabet=st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=20),
        min_size=1,
        max_size=5,
    ),
    st.data(),
)
def test_sums_mutated_valid_file(names, data):
    valid = "".join(f"{'ab' * 32}  {n}\n" for n in names)
    raw = bytearray(valid.encode())
    if data.draw(st.booleans()) and raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    out = sums_or_reject(bytes(raw))
    if out is not None:
        assert all("\n" not in r for r in out)


@pytest.mark.parametrize(
    "text",
    [
        f"{'0' * 64}  ../x\n",
        f"{'0' * 64}  /etc/passwd\n",
        f"{'0' * 64}  a/../../b\n",
        f"{'0' * 64}  a\\b\n",
        f"{'0' * 64}  a\n{'1' * 64}  a\n",
        f"{'0' * 63}  a\n",
        f"{'0' * 64}  a/./b\n",
    ],
)
def test_sums_known_bad(text):
    assert sums_or_reject(text.encode()) is None


@pytest.fixture(scope="module")
def tiny_gguf_bytes(tmp_path_factory) -> bytes:
    from tiny_gguf import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "t.gguf").read_bytes()


@FUZZ
@given(cut=st.integers(0, 2**16), flips=st.lists(st.tuples(st.integers(0, 4095),
                                                           st.integers(1, 255)), max_size=4))  # fmt: skip
def test_gguf_header_check_refuses_or_passes_never_crashes(tiny_gguf_bytes, tmp_path, cut, flips):
    """Any truncation and byte flips in the header region: the GGUF header check passes or
    raises IntegrityError (exit 3), nothing else; a file cut short never passes."""
    from pipeline.fetch.gguf_header import check_gguf

    p = tmp_path / "f.gguf"
    p.write_bytes(tiny_gguf_bytes[: cut % len(tiny_gguf_bytes)])
    with pytest.raises(IntegrityError):  # its last tensor ends at the file's end
        check_gguf(p)
    data = bytearray(tiny_gguf_bytes)
    for at, x in flips:
        data[at % len(data)] ^= x
    p.write_bytes(bytes(data[: len(data) - cut % 64]))
    try:
        check_gguf(p)
    except IntegrityError:
        pass


_YAML_BITS = st.sampled_from([b"name: a\n", b"groups:\n", b"  - ", b"{", b"}", b"[", b"]", b": ",
                              b"&a ", b"*a ", b"!!python/object ", b"\xff", b"\xc3", b"\t",
                              b"- [1, 2]\n", b"gates: {top1_min: .nan}\n", b"\n", b"name: b\n"])  # fmt: skip


@FUZZ
@given(parts=st.lists(_YAML_BITS | st.binary(max_size=8), max_size=40))
def test_recipe_reader_refuses_or_parses_never_crashes(tmp_path, parts):
    """Any bytes as a recipe file: a Recipe or RecipeError (exit 2), nothing else -- no
    UnicodeDecodeError, RecursionError, constructor or pydantic error escapes."""
    from pipeline.errors import RecipeError
    from pipeline.recipe import load_recipe

    p = tmp_path / "r.yaml"
    p.write_bytes(b"".join(parts))
    try:
        load_recipe(p)
    except RecipeError as e:
        assert e.path == str(p)
