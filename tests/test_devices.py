"""--device and --gpu-memory are checked before any stage runs: exit 2 naming the flag."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from pipeline.errors import UsageError
from pipeline.model import devices
from tests.cli_run import qship

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "recipes" / "fp8-dynamic.yaml")
GIB = 2**30


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch.cuda as on a machine with two 80 GiB GPUs."""
    import torch

    props = types.SimpleNamespace(total_memory=80 * GIB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "H100")


@pytest.mark.parametrize("device, says", [("cuda", "no usable CUDA"), ("cuda:0", "no usable"),
                                          ("tpu", "not a device"), ("cpu:1", "not a device")])  # fmt: skip
def test_run_with_a_device_this_machine_lacks_exits_2_at_once(capsys, tmp_path, tiny_llama,
                                                              monkeypatch, device, says):  # fmt: skip
    """`--device cuda` without CUDA used to run stages for ~20 s, then exit 1 (torch's
    AssertionError); `--device tpu` was exit 1: now exit 2 before any stage."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU box
    out = tmp_path / "art"
    rc, err = qship(capsys, "run", "--model", str(tiny_llama), "--recipe", RECIPE, "--out",
                    str(out), "--device", device, "--cache-dir", str(tmp_path / "cache"))  # fmt: skip
    assert rc == 2 and err["path"] == "--device" and says in err["message"], err
    assert not out.exists() and not Path(f"{out}.report").exists()


def test_gpu_memory_beyond_any_gpu_exits_2(capsys, tiny_llama):
    rc, err = qship(capsys, "plan", "--model", str(tiny_llama), "--recipe", RECIPE,
                    "--gpu-memory", "10TB")  # fmt: skip
    assert rc == 2 and err["path"] == "--gpu-memory" and "any GPU" in err["message"], err
    rc, plan = qship(capsys, "plan", "--model", str(tiny_llama), "--recipe", RECIPE,
                     "--gpu-memory", "80GB")  # fmt: skip
    assert rc == 0, plan


def test_gpu_memory_and_index_held_to_the_gpus_here(fake_gpus):
    assert devices.check_gpu_cap("cuda", 40 * GIB) == 40 * GIB
    with pytest.raises(UsageError, match=r"more than the H100's 80\.0 GiB") as ei:
        devices.check_gpu_cap("cuda:1", 81 * GIB)
    assert ei.value.path == "--gpu-memory"
    assert devices.check_device("cuda:1") == "cuda:1"
    with pytest.raises(UsageError, match="has 2 GPU") as ei:
        devices.check_device("cuda:2")
    assert ei.value.path == "--device"


def test_plan_on_paper_takes_a_cuda_device_but_not_a_bad_name(capsys, tiny_llama, tmp_path,
                                                               monkeypatch):  # fmt: skip
    """`qship plan` and `compare --matrix` plan for a GPU not at hand; `compare` itself
    computes, so it needs the GPU here."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = ["--model", str(tiny_llama), "--recipe", RECIPE]
    assert qship(capsys, "plan", *base, "--device", "cuda")[0] == 0
    rc, err = qship(capsys, "plan", *base, "--device", "tpu")
    assert rc == 2 and err["path"] == "--device", err
    rc, err = qship(capsys, "compare", "--model", str(tiny_llama), RECIPE, "--device", "cuda",
                    "--out", str(tmp_path / "cmp"))  # fmt: skip
    assert rc == 2 and err["path"] == "--device" and not (tmp_path / "cmp").exists(), err
