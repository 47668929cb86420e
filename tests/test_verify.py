"""`qship verify`: every integrity fault ends with exit 3 and a message naming the file."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from factories import ec_keypair, negate_head, reseal, resum

from pipeline.artifact.signing import SIGNATURE
from pipeline.artifact.signing import sign_artifact as sign
from pipeline.artifact.verify import verify
from pipeline.cli import main
from pipeline.errors import IntegrityError, UsageError
from pipeline.io.hashing import sha256_file

ROOT = Path(__file__).resolve().parent.parent


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(src, dst, symlinks=True)
    return dst


def cli_verify(art: Path, *extra: str, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["verify", str(art), "--json", *extra])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def shard(art: Path, i: int = 2) -> Path:
    return next(iter(sorted(art.glob(f"model-0000{i}-of-*.safetensors"))))


# ------------------------------------------------------------------ the good case


def test_clean_artifact_passes_and_sha256sum_accepts_it(packaged_artifact, capsys):
    rep = verify(packaged_artifact)
    assert rep.tensors > 50 and rep.signature == "absent"
    rc, out = cli_verify(packaged_artifact, capsys=capsys)
    assert rc == 0 and out["ok"] is True
    r = subprocess.run(
        ["sha256sum", "--strict", "-c", "SHA256SUMS"],
        cwd=packaged_artifact,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_real_subprocess_exit_code(packaged_artifact, tmp_path):
    art = copy(packaged_artifact, tmp_path)
    (art / "README.md").write_text("tampered\n")
    r = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "verify", str(art)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 3
    assert "README.md" in r.stderr


# ------------------------------------------------------------------ file-set faults


def test_flipped_byte_in_a_shard(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    s = shard(art)
    data = bytearray(s.read_bytes())
    data[len(data) // 2] ^= 0x01
    s.write_bytes(bytes(data))
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and out["exit_code"] == 3
    assert s.name in out["path"] and "sha256" in out["message"]


def test_missing_file(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    (art / "tokenizer.json").unlink()
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3
    assert "tokenizer.json" in out["path"] and "absent" in out["message"]


def test_missing_file_and_its_line(packaged_artifact, tmp_path, capsys):
    """Deleting a required file together with its SHA256SUMS line is still caught."""
    art = copy(packaged_artifact, tmp_path)
    (art / "provenance.json").unlink()
    resum(art)
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and "provenance.json" in out["message"]


def test_extra_file(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    (art / "notes.txt").write_text("hello\n")
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3
    assert "notes.txt" in out["path"] and "not listed" in out["message"]


def test_extra_file_in_a_subfolder(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    (art / "sub").mkdir()
    (art / "sub" / "payload.py").write_text("import os\n")
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and "sub/payload.py" in out["message"]


def test_renamed_file_names_both(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    os.rename(art / "generation_config.json", art / "generation-config.json")
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3
    assert "generation_config.json" in out["message"]
    assert "generation-config.json" in out["message"]
    assert "renamed" in out["message"]


@pytest.mark.parametrize("bad", ["../evil.txt", "/etc/passwd", "sub/../../x", "./config.json"])
def test_unsafe_sha256sums_entry(packaged_artifact, tmp_path, capsys, bad):
    art = copy(packaged_artifact, tmp_path)
    with open(art / "SHA256SUMS", "a") as fh:
        fh.write(f"{'0' * 64}  {bad}\n")
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3
    assert "SHA256SUMS" in out["path"] and "unsafe path" in out["message"]


def test_sha256sums_missing_or_garbage(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    (art / "SHA256SUMS").write_bytes(b"\xff\xfe not text")
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and "SHA256SUMS" in out["path"]
    (art / "SHA256SUMS").unlink()
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and "SHA256SUMS" in out["path"]


def test_symlink_in_the_artifact(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    target = art / "tokenizer.json"
    moved = tmp_path / "outside.json"
    shutil.move(target, moved)
    target.symlink_to(moved)  # same bytes, so only the symlink rule catches it
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3
    assert "tokenizer.json" in out["path"] and "symlink" in out["message"]


def test_symlinked_folder_in_the_artifact(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    (art / "extras").symlink_to(tmp_path)
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and "extras" in out["path"] and "symlink" in out["message"]


# ------------------------------------------------------------------ safetensors faults


def test_truncated_safetensors(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    s = shard(art)
    data = s.read_bytes()
    s.write_bytes(data[: len(data) - 1000])
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and s.name in out["path"]
    resum(art)  # even with matching checksums the header check rejects it
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and s.name in out["path"] and "truncated" in out["message"]


@pytest.mark.parametrize("length", [2**63, 100 * 1024 * 1024 + 1, 10**9])
def test_absurd_header_length(packaged_artifact, tmp_path, capsys, length):
    art = copy(packaged_artifact, tmp_path)
    s = shard(art, 1)
    data = bytearray(s.read_bytes())
    data[:8] = struct.pack("<Q", length)
    s.write_bytes(bytes(data))
    resum(art)
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and s.name in out["path"] and "header length" in out["message"]


def _rewrite_header(path: Path, edit) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_overlapping_offsets(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    s = shard(art, 2)

    def edit(h):
        names = sorted(k for k in h if k != "__metadata__")
        a, b = h[names[0]], h[names[1]]
        # make b claim a's bytes (same span length is not guaranteed: use a's span)
        b["data_offsets"] = list(a["data_offsets"])
        b["shape"], b["dtype"] = a["shape"], a["dtype"]

    _rewrite_header(s, edit)
    resum(art)
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and s.name in out["path"]
    assert "overlaps" in out["message"] or "gap" in out["message"]


def _edit_config(art: Path, edit) -> None:
    cfg = json.loads((art / "config.json").read_text())
    edit(cfg)
    (art / "config.json").write_text(json.dumps(cfg, indent=2))
    resum(art)


@pytest.mark.parametrize(
    "edit,expect",
    [
        (lambda c: c.update(hidden_size=256), "hidden_size"),
        (lambda c: c.update(vocab_size=4096), "vocab_size"),
        (lambda c: c.update(num_hidden_layers=6), "num_hidden_layers"),
        (lambda c: c.update(intermediate_size=512), "expected"),
        (lambda c: c.update(dtype="float16"), "dtype"),
        (
            lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
                group_size=64
            ),
            "weight_scale shape",
        ),
        (
            lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
                num_bits=8
            ),
            "weight_packed shape",
        ),
        (
            lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
                symmetric=False
            ),
            "weight_zero_point missing",
        ),
        (lambda c: c["quantization_config"].update(ignore=["lm_head", "re:.*q_proj"]), "ignore"),
        (lambda c: c.pop("quantization_config"), "quantization_config"),
        (
            lambda c: c["quantization_config"].update(
                kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}
            ),
            "self_attn.k_scale",
        ),
    ],
)
def test_weights_inconsistent_with_config(packaged_artifact, tmp_path, capsys, edit, expect):
    art = copy(packaged_artifact, tmp_path)
    _edit_config(art, edit)
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3, out
    assert expect in out["message"]
    assert out["path"].startswith(str(art))


def test_index_pointing_at_the_wrong_shard(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    idx = json.loads((art / "model.safetensors.index.json").read_text())
    name = sorted(idx["weight_map"])[0]
    idx["weight_map"][name] = "model-00003-of-00003.safetensors"
    (art / "model.safetensors.index.json").write_text(json.dumps(idx))
    resum(art)
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and "model.safetensors.index.json" in out["path"]


# ------------------------------------------------------------------ records against each other


def _weights(art: Path) -> tuple[str, str]:
    rel = negate_head(art)
    resum(art)
    return rel, "quantized_model_hash"


def _recipe_gate(art: Path) -> tuple[str, str]:
    text = (art / "recipe.yaml").read_text()
    assert "kl_mean_max: 5.0" in text
    (art / "recipe.yaml").write_text(text.replace("kl_mean_max: 5.0", "kl_mean_max: 500.0"))
    reseal(art, "recipe.yaml")  # its file hash re-recorded: the recipe hash still disagrees
    return "recipe.yaml", "not the recipe hash"


def _card_figure(art: Path) -> tuple[str, str]:
    lines = (art / "README.md").read_text().splitlines(keepends=True)
    (i,) = [i for i, ln in enumerate(lines) if ln.startswith("| KL(reference ‖ quantized)")]
    lines[i] = "| KL(reference ‖ quantized), mean ± stderr | 0.0001 ± 0.0001 |\n"
    (art / "README.md").write_text("".join(lines))
    reseal(art, "README.md")  # its file hash re-recorded: the figures still disagree
    return "README.md", "figures differ from eval.json"


def _eval_figure(art: Path) -> tuple[str, str]:
    ev = json.loads((art / "eval.json").read_text())
    ev["metrics"]["kl"]["mean"] = 0.0
    (art / "eval.json").write_text(json.dumps(ev, indent=2, sort_keys=True) + "\n")
    resum(art)
    return "eval.json", "recorded in provenance.json"


def _provenance_recipe_hash(art: Path) -> tuple[str, str]:
    prov = json.loads((art / "provenance.json").read_text())
    prov["recipe"]["hash"] = "0" * 64
    (art / "provenance.json").write_text(json.dumps(prov, indent=2, sort_keys=True) + "\n")
    resum(art)
    return "recipe.yaml", "not the recipe hash"


@pytest.mark.parametrize(
    "edit", [_weights, _recipe_gate, _card_figure, _eval_figure, _provenance_recipe_hash],
    ids=["weights", "recipe-gates", "card-figures", "eval-figures", "provenance-recipe-hash"],
)  # fmt: skip
def test_a_record_edited_and_resummed_is_exit_3_naming_it(
    packaged_artifact, tmp_path, capsys, edit
):
    """SHA256SUMS rewritten to match (and, for the card and the recipe, provenance's file
    hash too): the artifact's records still disagree with one another, and verify names
    the file that does."""
    art = copy(packaged_artifact, tmp_path)
    rel, said = edit(art)
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and out["path"].endswith(rel), out
    assert said in out["message"] and "record cross-check" in out["message"], out["message"]


# ------------------------------------------------------------------ signatures


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {"a": ec_keypair(d, "a"), "b": ec_keypair(d, "b")}


def test_signature_roundtrip_and_faults(packaged_artifact, tmp_path, capsys, keys):
    (priv_a, pub_a), (priv_b, pub_b) = keys["a"], keys["b"]
    art = copy(packaged_artifact, tmp_path)

    def sign_artifact(art: Path, key: Path) -> None:  # as `qship package --sign-key` does
        from pipeline.artifact import attestation

        attestation.sign(art, attestation.SigningKey(key))
        sign(art, key)

    # unsigned + --require-signature -> 3
    rc, out = cli_verify(art, "--require-signature", "--pubkey", str(pub_a), capsys=capsys)
    assert rc == 3 and SIGNATURE in out["path"] and "unsigned" in out["message"]

    sign_artifact(art, priv_a)
    rc, out = cli_verify(art, "--require-signature", "--pubkey", str(pub_a), capsys=capsys)
    assert rc == 0 and out["signature"] == "verified"
    # present but no key: passes with a warning; required without a key: usage error
    assert verify(art).signature == "present-unverified"
    with pytest.raises(UsageError):
        verify(art, require_signature=True)

    # re-signed by another key -> 3 with key a
    sign_artifact(art, priv_b)
    rc, out = cli_verify(art, "--require-signature", "--pubkey", str(pub_a), capsys=capsys)
    assert (
        rc == 3 and SIGNATURE in out["path"] and "signature verification failed" in out["message"]
    )
    assert verify(art, require_signature=True, pubkey=pub_b).signature == "verified"

    # signed by a, then modified with SHA256SUMS regenerated: only the signature catches it
    sign_artifact(art, priv_a)
    (art / "README.md").write_text((art / "README.md").read_text() + "\nextra claims\n")
    resum(art)
    rc, out = cli_verify(art, "--pubkey", str(pub_a), capsys=capsys)
    assert rc == 3 and SIGNATURE in out["path"]


def test_sha256sums_may_not_list_the_signature(packaged_artifact, tmp_path, capsys):
    art = copy(packaged_artifact, tmp_path)
    (art / SIGNATURE).write_text("{}")
    with open(art / "SHA256SUMS", "a") as fh:
        fh.write(f"{sha256_file(art / SIGNATURE).sha256}  {SIGNATURE}\n")
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and "never covered" in out["message"]


# ------------------------------------------------------------------ --load


def test_load_smoke_test(packaged_artifact, tmp_path, capsys):
    rep = verify(packaged_artifact, load=True)
    assert rep.load == "matched"
    art = copy(packaged_artifact, tmp_path)
    ev = json.loads((art / "eval.json").read_text())
    ev["probe"]["top_logits"][0][0] += 1.0
    (art / "eval.json").write_text(json.dumps(ev))
    reseal(art, "eval.json")  # provenance re-hashed too: only the probe can tell
    with pytest.raises(IntegrityError) as e:
        verify(art, load=True)
    assert "probe mismatch" in e.value.message and "eval.json" in e.value.path


def test_load_without_stored_probe(package_inputs, tmp_path):
    from pipeline.artifact.package import package

    art = package(out=tmp_path / "noprobe", probe=False, **package_inputs).path
    assert json.loads((art / "eval.json").read_text())["probe"] is None
    assert verify(art).ok
    with pytest.raises(IntegrityError) as e:
        verify(art, load=True)
    assert e.value.path.endswith("eval.json") and "probe" in e.value.message


# ------------------------------------------------------------------ mixed recipe checkpoint


@pytest.fixture(scope="module")
def mixed_artifact(tmp_path_factory, tiny_llama, package_inputs):
    """A real mixed checkpoint made by qship: attention int4 asym (packed zero points), MLP
    int4 sym, regex targets, FP8 KV cache with static scales, evaluated and gated."""
    import torch
    import yaml
    from conftest import gated

    from pipeline.artifact.package import package
    from pipeline.evaluate import evaluate
    from pipeline.quantize import quantize
    from pipeline.recipe import parse_recipe
    from pipeline.records import ModelRef
    from pipeline.records.evaluation import EvalOptions

    d = tmp_path_factory.mktemp("mixed")
    data = yaml.safe_load((ROOT / "recipes" / "rtn-w4.yaml").read_text())
    data.update(calibration={"num_samples": 4, "seq_len": 64, "batch_size": 4},
                evaluation={"sequences": 4, "seq_len": 64, "batch_size": 4},
                gates={"kl_mean_max": 5.0})  # fmt: skip
    recipe = parse_recipe(data, path="rtn-w4 (small)")
    snap = package_inputs["source"]
    from transformers import AutoTokenizer

    from pipeline.data.tokens import build_token_sets

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokens = build_token_sets(AutoTokenizer.from_pretrained(snap.path), recipe.calibration,
                                  recipe.evaluation, cache_dir=d / "cache")  # fmt: skip
        qc = quantize(snap.path, recipe, d / "model", tokens=tokens, device="cpu")
        report = evaluate(ModelRef(path=snap.path, model_hash=snap.model_hash),
                          ModelRef(path=qc.path, model_hash=qc.model_hash),
                          heldout_ids=tokens.heldout_ids, cache_dir=d / "cache",
                          options=EvalOptions(device="cpu"))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return package(checkpoint=qc, recipe=recipe, evaluation=report,
                   verdict=gated(report, recipe=recipe), out=d / "art", source=snap).path  # fmt: skip


def test_mixed_checkpoint_verifies_and_is_checked_strictly(mixed_artifact, tmp_path, capsys):
    rep = verify(mixed_artifact, load=True)
    assert rep.load == "matched"
    text = (mixed_artifact / "README.md").read_text()
    assert "fp8-kv-cache" in text and 'kv_cache_dtype="auto"' in text and "query to FP8" in text

    def swap(c):
        g = c["quantization_config"]["config_groups"]
        g["group_0"]["weights"]["symmetric"], g["group_1"]["weights"]["symmetric"] = True, False

    art = copy(mixed_artifact, tmp_path)
    _edit_config(art, swap)
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and "weight_zero_point present but the group is symmetric" in out["message"]
    assert "weight_zero_point missing but the group is asymmetric" in out["message"]


@pytest.mark.parametrize(
    "edit",
    [
        lambda ev: ev["probe"].update(top_ids=[[10**9]]),
        lambda ev: ev["probe"].update(top_logits="x"),
        lambda ev: ev["probe"].update(prompt_ids=[10**9]),
    ],
)
def test_malformed_probe_is_an_integrity_failure(packaged_artifact, tmp_path, edit):
    art = copy(packaged_artifact, tmp_path)
    ev = json.loads((art / "eval.json").read_text())
    edit(ev)
    (art / "eval.json").write_text(json.dumps(ev))
    resum(art)
    with pytest.raises(IntegrityError) as e:
        verify(art, load=True)
    assert e.value.path.endswith(("eval.json", "config.json"))


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", '{"verdict": {"passed": "yes"}}'])
def test_malformed_eval_json(packaged_artifact, tmp_path, capsys, text):
    art = copy(packaged_artifact, tmp_path)
    (art / "eval.json").write_text(text)
    resum(art)
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3 and out["path"].endswith("eval.json")


def test_a_checkpoint_storing_a_fused_set_two_ways_is_refused(tiny_llama, tmp_path, monkeypatch):
    """q/k/v stored two ways (a checkpoint from before the plan refused such recipes, or from
    another tool) cannot be served by vLLM: the one checkpoint validator -- quantize's
    post-save check, and `qship verify` -- names the set; nothing is kept."""
    import torch
    import yaml
    from transformers import AutoTokenizer

    import pipeline.quantize.plan as plan_mod
    from pipeline.data.tokens import build_token_sets
    from pipeline.errors import StageError
    from pipeline.quantize import quantize
    from pipeline.recipe import parse_recipe

    data = yaml.safe_load((ROOT / "recipes" / "rtn-w4.yaml").read_text())
    data.update(kv_cache=None, calibration={"num_samples": 2, "seq_len": 32, "batch_size": 2},
                evaluation={"sequences": 2, "seq_len": 32, "batch_size": 2})  # fmt: skip
    attn = data["groups"][0]
    attn["exclude"] = ["re:.*v_proj$"]
    data["groups"].insert(1, {"name": "v8", "targets": ["re:.*v_proj$"], "method": "rtn",
                              "scheme": {**attn["scheme"], "bits": 8}})  # fmt: skip
    recipe = parse_recipe(data, path="split.yaml")
    monkeypatch.setattr(plan_mod, "check_fused", lambda *a: None)  # as before the rule
    tokens = build_token_sets(AutoTokenizer.from_pretrained(tiny_llama), recipe.calibration,
                              recipe.evaluation, cache_dir=tmp_path / "cache")  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(StageError) as e:
            quantize(tiny_llama, recipe, tmp_path / "q", tokens=tokens, device="cpu")
    finally:
        torch.set_num_threads(threads)
    msg = str(e.value)
    assert "q_proj is int4 asym g128 but model.layers.0.self_attn.v_proj is int8" in msg, msg
    assert "self_attn.qkv_proj as one fused layer" in msg
    assert not (tmp_path / "q").exists()
