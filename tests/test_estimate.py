"""The resource estimate (pipeline/quantize/estimate.py) held against measured rows and
planned on paper: several GPUs, another host, the MoE term."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from make_random_llama import llama8b_config, moe_config  # noqa: E402


def test_plan_on_paper_for_several_gpus_and_another_host(tmp_path, capsys, monkeypatch):
    """`qship plan --gpu-memory --host-memory --gpus N` plans for a machine not at hand: the
    host size given decides --offload auto (not this machine's), and N ranks each cache
    their share of the calibration inputs, take their share of the time and bring their own
    process overhead; the basis says the split is assumed."""
    from pipeline.model import devices
    from tests.cli_run import qship

    model = tmp_path / "llama-8b-dims"
    llama8b_config().save_pretrained(model)
    monkeypatch.setattr(devices, "free_gpu_bytes", lambda d: None)  # no GPU here
    monkeypatch.setattr(devices, "free_cpu_bytes", lambda: int(4e9))  # nor much memory
    base = ["plan", "--model", str(model), "--recipe", str(ROOT / "recipes" / "gemma-mixed-w4.yaml"),
            "--device", "cuda", "--offload", "auto", "--cache-dir", str(tmp_path / "c")]  # fmt: skip
    est = {}
    for n in (1, 4):
        rc, p = qship(
            capsys, *base, "--gpu-memory", "12GB", "--host-memory", "128GiB", "--gpus", str(n)
        )
        assert rc == 0, p
        est[n] = p["estimate"]
    assert est[1]["offload"] == est[4]["offload"] == "cpu"  # 128 GiB holds the host copies
    assert est[4]["ranks"] == 4 and est[4]["quantize_gpu_bytes"] < est[1]["quantize_gpu_bytes"]
    assert est[4]["quantize_s"] < 0.6 * est[1]["quantize_s"]  # per-layer fixed costs stay
    assert est[4]["quantize_cpu_bytes"] == est[1]["quantize_cpu_bytes"] + 3 * 2_000_000_000
    assert "assumed" in est[4]["basis"] and "assumed" not in est[1]["basis"]
    rc, p = qship(capsys, *base, "--gpu-memory", "12GB", "--host-memory", "8GB")
    assert rc == 0 and p["estimate"]["offload"] == "disk"
    rc, err = qship(capsys, *base, "--host-memory", "much")
    assert rc == 2 and err["path"] == "--host-memory"


def test_the_moe_term_holds_the_measured_moe_row(tmp_path, capsys, monkeypatch):
    """2 layers of Qwen3-30B-A3B dims (128 experts of 2048x768), gemma-mixed-w4, weights on
    the GPU: 18.67 GB measured (H200, 2026-12-04, bench/RESULTS.md). Without GPTQ's batched
    compression of the 256 same-shape expert Linears the estimate said 9.44 GB; with it the
    prediction is within 25 %, and a dense layer's (two or three modules) adds little."""
    from pipeline.model import devices
    from tests.cli_run import qship

    moe_config(2).save_pretrained(tmp_path / "moe2")
    monkeypatch.setattr(devices, "free_gpu_bytes", lambda d: int(140e9))
    monkeypatch.setattr(devices, "free_cpu_bytes", lambda: int(100e9))
    rc, p = qship(capsys, "plan", "--model", str(tmp_path / "moe2"), "--recipe",
                  str(ROOT / "recipes" / "gemma-mixed-w4.yaml"), "--device", "cuda",
                  "--cache-dir", str(tmp_path / "c"))  # fmt: skip
    assert rc == 0, p
    predicted, measured = p["estimate"]["quantize_gpu_bytes"], 18.67e9
    assert abs(predicted - measured) < 0.25 * measured, predicted


def test_quantize_alone_needs_disk_for_its_checkpoint_only(tmp_path, capsys, monkeypatch):
    """`qship run` keeps cache entries (the snapshot, the resume store, the reference) beside
    the artifact; `qship quantize` writes the checkpoint alone. On the H100 (2026-12-05) the
    8B-dims quantize was refused for the run's 44.1 GB with 35 GB free and a 5.6 GB checkpoint."""
    from collections import namedtuple

    from pipeline.model import devices
    from pipeline.runner import stages
    from tests.cli_run import qship

    model = tmp_path / "llama-8b-dims"
    llama8b_config().save_pretrained(model)
    monkeypatch.setattr(devices, "free_gpu_bytes", lambda d: int(80e9))
    monkeypatch.setattr(devices, "free_cpu_bytes", lambda: int(100e9))
    usage = namedtuple("usage", "total used free")
    free = {"bytes": int(35e9)}
    monkeypatch.setattr(stages.shutil, "disk_usage", lambda p: usage(0, 0, free["bytes"]))
    base = ["--model", str(model), "--recipe", str(ROOT / "recipes" / "gemma-mixed-w4.yaml"),
            "--device", "cuda", "--cache-dir", str(tmp_path / "c")]  # fmt: skip
    rc, err = qship(capsys, "run", *base, "--out", str(tmp_path / "art"))
    assert rc == 2 and "cache entries and the artifact" in err["message"], err
    # quantize passes the disk check (the config-only folder has no tokenizer: a later error)
    rc, err = qship(capsys, "quantize", *base, "--out", str(tmp_path / "q"))
    assert "disk" not in err.get("message", ""), err
    free["bytes"] = int(3e9)  # under the ~5.6 GB checkpoint: refused, naming what it is for
    rc, err = qship(capsys, "quantize", *base, "--out", str(tmp_path / "q"))
    assert rc == 2 and "of disk (the checkpoint, predicted)" in err["message"], err
    assert not (tmp_path / "q").exists()


def test_gpu_cap_on_a_device_named_without_index(monkeypatch):
    """`--device cuda --gpu-memory 12GB`: torch's per-process fraction needs a device index
    ("Expected a torch.device with a specified index", the H100, 2026-12-05): the cap goes
    to the current device; an explicit index is kept."""
    import torch

    from pipeline.model import devices

    class Props:
        total_memory = int(80e9)

    calls = []

    def set_fraction(frac, dev):  # torch's own check, without a GPU
        if torch.device(dev).index is None:
            raise ValueError("Expected a torch.device with a specified index")
        calls.append((round(frac, 3), torch.device(dev).index))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    devices.apply_gpu_cap("cuda", int(12e9))
    devices.apply_gpu_cap("cuda:1", int(100e9))
    devices.apply_gpu_cap("cuda", None)
    assert calls == [(0.15, 2), (1.0, 1)]


def test_the_time_term_holds_the_measured_dense_rows():
    """gemma-mixed-w4 on the H200 with the weights on the GPU: Gemma 3 270M 10.5 s and the
    8B-dims Llama 79.5 s (bench/RESULTS.md, "Resource estimate"), --offload cpu on the 8B
    86.7 s; 2 layers of Qwen3-30B-A3B dims 81.2 s (the GPU shared), 8 layers 378.1 s and
    385.0 s with --offload cpu (H100, both at once). The method-weighted parameters with the
    constants fitted before them predicted 54 s for the 8B (-32 %); a dense Linear's cost for
    an expert's predicted the 8 MoE layers at 266 s (-30 %)."""
    from transformers import Gemma3TextConfig

    from pipeline.quantize import plan_for_config
    from pipeline.quantize.estimate import estimate
    from pipeline.recipe import load_recipe

    r = load_recipe(ROOT / "recipes" / "gemma-mixed-w4.yaml")
    gemma = Gemma3TextConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                             vocab_size=262144)  # fmt: skip
    llama = llama8b_config()
    rows = [(gemma, "none", 10.5, 0.10), (llama, "none", 79.5, 0.10), (llama, "cpu", 86.7, 0.10),
            (moe_config(2), "none", 81.2, 0.25), (moe_config(8), "none", 378.1, 0.25),
            (moe_config(8), "cpu", 385.0, 0.25)]  # fmt: skip
    for cfg, offload, measured, within in rows:
        s = estimate(plan_for_config(cfg, r), cfg, r, "cuda", offload=offload).quantize_s
        assert abs(s - measured) <= within * measured, (cfg.model_type, offload, s, measured)


def test_an_moe_models_host_and_gpu_peaks_hold_the_measured_rows():
    """8 layers of Qwen3-30B-A3B dims, gemma-mixed-w4 (H100, 2026-12-06, bench/RESULTS.md):
    GPU 26.16 GB with the weights on it, 16.96 GB with --offload cpu; host anonymous peaks
    20.0 and 35.3 GB, which W (+ Q) + R alone predicted at 13.2 and 17.0 GB: a plan would
    have admitted the offloaded run on a host with 20 GB free."""
    from pipeline.quantize import plan_for_config
    from pipeline.quantize.estimate import estimate
    from pipeline.recipe import load_recipe

    r = load_recipe(ROOT / "recipes" / "gemma-mixed-w4.yaml")
    cfg = moe_config(8)
    for offload, gpu, host in (("none", 26.16e9, 20.0e9), ("cpu", 16.96e9, 35.3e9)):
        est = estimate(plan_for_config(cfg, r), cfg, r, "cuda", offload=offload)
        assert abs(est.quantize_gpu_bytes - gpu) <= 0.1 * gpu, (offload, est.quantize_gpu_bytes)
        assert abs(est.quantize_cpu_bytes - host) <= 0.1 * host, (offload, est.quantize_cpu_bytes)
    dense = estimate(plan_for_config(llama8b_config(), r), llama8b_config(), r, "cuda",
                     offload="cpu")  # fmt: skip
    assert dense.quantize_cpu_bytes < 1.6 * 16.06e9  # no MoE term on a dense model


def test_disk_offload_holds_the_packed_checkpoint_for_the_reload_check():
    """With --offload disk the reload check reads the packed checkpoint into host memory
    (checks.verify_reload loads it with offload cpu): the host peak is at least Q, not the
    one layer the calibration holds (a 70B's ~37 GB checkpoint was planned at 4 GB)."""
    from pipeline.quantize import plan_for_config
    from pipeline.quantize.estimate import estimate
    from pipeline.recipe import load_recipe

    r = load_recipe(ROOT / "recipes" / "gemma-mixed-w4.yaml")
    for cfg in (llama8b_config(), moe_config(8)):
        plan = plan_for_config(cfg, r)
        est = estimate(plan, cfg, r, "cuda", offload="disk")
        q = plan.expected_checkpoint_bytes
        assert q + 2e9 <= est.quantize_cpu_bytes <= q + 2e9 + 2.5e9, (cfg.model_type, est)
