"""GPU hosts without internet: the locks agree with the tested pins, and big files split
and join back sha256-checked (tools/offline.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import offline  # noqa: E402


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def test_gpu_lock_is_the_tested_set_with_cuda_torch():
    """Every package both files pin has the same version, except torch (CUDA 2.11.0 on the
    GPU, CPU 2.13.0 here), and every pin carries hashes."""
    lock, tested = pins(ROOT / "requirements" / "gpu.lock"), pins(ROOT / "constraints.txt")
    shared = lock.keys() & tested.keys()
    assert {"llmcompressor", "compressed-tensors", "transformers", "lm-eval"} <= shared
    drift = {k: (lock[k], tested[k]) for k in shared if lock[k] != tested[k] and k != "torch"}
    assert drift == {}, drift
    assert lock["torch"] == "2.11.0"
    hashed = offline.parse_lock((ROOT / "requirements" / "gpu.lock").read_text())
    assert len(hashed) == len(lock) and all(hashed.values())


def test_serve_lock_is_vllm_026_with_its_own_pins():
    lock = pins(ROOT / "requirements" / "serve.lock")
    assert lock["vllm"] == "0.26.0" and lock["torch"] == "2.11.0"
    assert lock["apache-tvm-ffi"] == "0.1.11"  # the override xgrammar 0.2.9 needs
    assert all(offline.parse_lock((ROOT / "requirements" / "serve.lock").read_text()).values())


def test_split_join_roundtrip_and_damage(tmp_path):
    big = tmp_path / "model.gguf"
    big.write_bytes(bytes(range(256)) * 4001)  # 1,024,256 bytes
    parts = tmp_path / "parts"
    offline.main(["split", str(big), str(parts), "--size", "300000"])
    assert len(list(parts.glob("model.gguf.part*"))) == 4
    out = offline.join(parts, tmp_path / "joined.gguf")
    assert out.read_bytes() == big.read_bytes()
    for rc, args in ((0, [parts]), (1, [tmp_path])):  # `complete`: every part in / no manifest
        with pytest.raises(SystemExit) as done:
            offline.main(["complete", *map(str, args)])
        assert done.value.code == rc
    # a damaged part: refused, nothing written
    p1 = parts / "model.gguf.part001"
    data = bytearray(p1.read_bytes())
    data[7] ^= 1
    p1.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="part001: sha256 differs"):
        offline.join(parts, tmp_path / "again.gguf")
    assert not (tmp_path / "again.gguf").exists()
    p1.unlink()
    with pytest.raises(SystemExit, match="part001: missing"):
        offline.join(parts, tmp_path / "again.gguf")
    with pytest.raises(SystemExit) as done:
        offline.main(["complete", str(parts)])
    assert done.value.code == 1
    (parts / "manifest.json").unlink()  # the carry that holds it not staged yet: said so
    with pytest.raises(SystemExit, match="no manifest.json: stage the carry that holds it"):
        offline.join(parts, tmp_path / "again.gguf")


def test_cli_help_runs():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "offline.py"), "--help"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and "wheelhouse" in r.stdout
