"""The formats that quantize activations (FP8 W8A8, FP8 block, INT8 W8A8 + SmoothQuant,
W4A8-FP8): the recipe schema and its presets, the plan's serving-target checks, the
checkpoint each writes (format, tensors, reload, the validator), and the evaluation's
simulation of vLLM's kernels against reference implementations written here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from cli_run import qship
from small_recipes import small_recipe

from pipeline.errors import IntegrityError, RecipeError
from pipeline.evaluate.scoring import quantizes_activations
from pipeline.model.checkpoint import inspect_checkpoint
from pipeline.model.loading import load_meta_model, load_model
from pipeline.quantize.plan import build_plan, module_scheme
from pipeline.recipe import PRESETS, Scheme, load_recipe, parse_recipe

ROOT = Path(__file__).resolve().parent.parent
NEW = ["fp8-dynamic", "fp8-dynamic-gptq", "fp8-block", "w8a8-int8-sq", "w4a8-fp8"]


def _recipe(tmp_path: Path, base: str, **changes) -> Path:
    d = yaml.safe_load((ROOT / "recipes" / f"{base}.yaml").read_text())
    for k, v in changes.items():
        d[k] = v
    p = tmp_path / f"{base}-x.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return p


# ------------------------------------------------------------------ schema and presets


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_is_the_librarys_own(name):
    """qship's preset table written in its own fields gives exactly compressed-tensors'
    QuantizationArgs for that preset (weights and input activations)."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    from pipeline.quantize.modifiers import act_args, qargs

    lib = PRESET_SCHEMES[name]
    ms = module_scheme(Scheme(preset=name), Scheme(preset=name).group_size)
    keys = ("num_bits", "type", "strategy", "symmetric", "group_size", "block_structure",
            "dynamic")  # fmt: skip

    def fields(args) -> dict:
        return {k: getattr(args, k).value if hasattr(getattr(args, k), "value")
                else getattr(args, k) for k in keys}  # fmt: skip

    from compressed_tensors.quantization import QuantizationArgs

    assert fields(QuantizationArgs(**qargs(ms))) == fields(lib["weights"])
    mine = act_args(ms)
    theirs = lib.get("input_activations")
    assert (mine is None) == (theirs is None)
    if mine:
        assert fields(QuantizationArgs(**mine)) == fields(theirs)


def test_a_preset_and_its_long_form_are_one_recipe():
    short = Scheme(preset="FP8_DYNAMIC")
    long = Scheme(type="float", bits=8, strategy="channel",
                  activations={"type": "float", "strategy": "token"})  # fmt: skip
    assert short == long and short.model_dump() == long.model_dump()
    assert Scheme(preset="W4AFP8", group_size=64).group_size == 64  # written keys win


@pytest.mark.parametrize(
    "scheme,words",
    [
        ({"preset": "NVFP4"}, "Hopper"),
        ({"preset": "FP9"}, "not one of"),
        ({"type": "float", "bits": 4, "group_size": None}, "FP8"),
        ({"type": "float", "bits": 8, "symmetric": False, "group_size": None}, "symmetric"),
        ({"type": "float", "bits": 8, "strategy": "block"}, "block: [rows, columns]"),
        ({"bits": 8, "strategy": "block", "block": [128, 128]}, "FP8 weights"),
        (
            {
                "preset": "W8A8",
                "activations": {"type": "int", "strategy": "token", "dynamic": False},
            },
            "static",
        ),
        # a key that changes what the preset is (it used to pass, silently another format)
        ({"preset": "FP8_DYNAMIC", "type": "int"}, "preset 'FP8_DYNAMIC' has type 'float'"),
        ({"preset": "W4A16", "bits": 8}, "has bits 4"),
        ({"preset": "W4A16", "activations": {"type": "float"}}, "no activation quantization"),
        ({"preset": "W4AFP8", "activations": None}, "float activations"),
        ({"preset": "W8A8", "activations": {"strategy": "token"}}, "int activations"),
        ({"preset": "FP8_BLOCK", "activations": {"strategy": "group"}}, "group_size"),
        ({"preset": "W4AFP8", "observer": "imatrix_mse"}, "weight-only"),
        ({"preset": "FP8_DYNAMIC", "observer": "imatrix_mse"}, "weight-only"),
        ({"bits": 4, "strategy": "tensor", "observer": "imatrix_mse"}, "group or channel"),
    ],
)
def test_bad_schemes_name_the_field(tmp_path, scheme, words):
    p = _recipe(tmp_path, "fp8-dynamic")
    d = yaml.safe_load(p.read_text())
    d["groups"][0]["scheme"] = scheme
    with pytest.raises(RecipeError) as e:
        parse_recipe(d, path=str(p))
    assert "groups" in e.value.message and words in e.value.message


def test_data_free_is_only_what_needs_no_data():
    r = {n: load_recipe(ROOT / "recipes" / f"{n}.yaml") for n in NEW}
    assert not r["fp8-dynamic"].needs_calibration() and not r["fp8-block"].needs_calibration()
    assert r["w8a8-int8-sq"].needs_calibration() and r["w4a8-fp8"].needs_calibration()
    static = parse_recipe(
        ({**yaml.safe_load((ROOT / "recipes" / "fp8-dynamic.yaml").read_text()),
                        "groups": [{"name": "d", "roles": ["attention", "mlp"], "method": "rtn",
                                    "scheme": {"preset": "FP8"}},
                                   {"name": "h", "roles": ["lm_head"], "method": "none"}]}),
        path="static.yaml",
    )  # fmt: skip
    assert static.needs_calibration()  # a static activation scale is calibrated


# ------------------------------------------------------------------ the plan and the target


def test_plan_says_data_free_and_smoothquant_maps_every_norm(tiny_llama, tiny_gemma):
    fp8 = build_plan(load_meta_model(tiny_llama), load_recipe(ROOT / "recipes/fp8-dynamic.yaml"))
    assert any("data-free" in n for n in fp8.notes) and not fp8.smoothquant
    assert {m.scheme.format_label() for m in fp8.modules if m.scheme} == {"W8A8-FP8"}
    for model in (tiny_llama, tiny_gemma):
        sq = build_plan(load_meta_model(model), load_recipe(ROOT / "recipes/w8a8-int8-sq.yaml"))
        layers = len(sq.decoder_layers)
        assert [m.kind for m in sq.smoothquant].count("norm->qkv") == layers
        assert [m.kind for m in sq.smoothquant].count("norm->gate/up") == layers
        assert all(m.applied for m in sq.smoothquant)


def test_the_stored_bytes_follow_the_format(tiny_llama):
    meta = load_meta_model(tiny_llama)
    size = {n: build_plan(meta, load_recipe(ROOT / f"recipes/{n}.yaml")).bits_per_weight.quantized
            for n in [*NEW, "gptq-w4"]}  # fmt: skip
    # int8/fp8 values + one 16-bit scale per output channel (inputs: 128, down_proj 384)
    assert size["fp8-dynamic"] == size["w8a8-int8-sq"]
    assert 8 + 16 / 384 < size["fp8-dynamic"] < 8 + 16 / 128
    assert size["fp8-block"] < size["fp8-dynamic"]  # one scale per 128x128 block
    assert 4 < size["w4a8-fp8"] < 4.2 and size["w4a8-fp8"] == pytest.approx(size["gptq-w4"], 0.01)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"target": {"engine": "vllm", "gpu": "sm89"}}, "activations"),  # W4A8: Hopper only
        ({"groups.0.scheme.symmetric": False}, "symmetric"),
        ({"groups.0.scheme.group_size": 64}, "group_size"),
        ({"dtype": "float16"}, "dtype"),
    ],
)
def test_w4a8_outside_what_vllm_runs_is_refused_before_compute(tmp_path, tiny_llama, capsys,
                                                               change, field):  # fmt: skip
    d = yaml.safe_load((ROOT / "recipes" / "w4a8-fp8.yaml").read_text())
    for k, v in change.items():
        if k.startswith("groups."):
            d["groups"][0]["scheme"][k.rsplit(".", 1)[1]] = v
        else:
            d[k] = v
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    rc, out = qship(capsys, "plan", "--model", str(tiny_llama), "--recipe", str(p))
    assert rc == 2 and field in out["message"], out


def test_other_target_rules(tmp_path, tiny_llama, capsys):
    meta = load_meta_model(tiny_llama)
    r = load_recipe(ROOT / "recipes" / "w8a8-int8-sq.yaml")
    r.groups[0].scheme.group_size, r.groups[0].scheme.strategy = 128, "group"
    with pytest.raises(RecipeError, match="int8 kernels take one scale per channel"):
        build_plan(meta, r)
    r = load_recipe(ROOT / "recipes" / "fp8-dynamic.yaml")
    r.target.gpu = "sm80"
    assert any("weight-only (Marlin)" in n for n in build_plan(meta, r).notes)  # flagged, runs
    # one activation scheme per fused set: q/k/v may not split W8A8 and W8A16
    d = yaml.safe_load((ROOT / "recipes" / "w8a8-int8-sq.yaml").read_text())
    d["groups"].insert(0, {"name": "k", "targets": ["re:.*k_proj$"], "method": "gptq",
                           "scheme": {"bits": 8, "group_size": None}})  # fmt: skip
    d["groups"][1]["exclude"] = ["re:.*k_proj$"]
    p = tmp_path / "split.yaml"
    p.write_text(yaml.safe_dump(d))
    rc, out = qship(capsys, "plan", "--model", str(tiny_llama), "--recipe", str(p))
    assert rc == 2 and "fused" in out["message"] and "act" in out["message"], out


def test_an_activation_scheme_on_the_embedding_is_refused(tmp_path, tiny_llama, capsys):
    d = yaml.safe_load((ROOT / "recipes" / "fp8-dynamic.yaml").read_text())
    d["groups"].append({"name": "emb", "roles": ["embeddings"], "method": "rtn",
                        "scheme": {"preset": "FP8_DYNAMIC"}})  # fmt: skip
    p = tmp_path / "emb.yaml"
    p.write_text(yaml.safe_dump(d))
    rc, out = qship(capsys, "plan", "--model", str(tiny_llama), "--recipe", str(p))
    assert rc == 2 and "groups[2]" in out["message"] and "embedding" in out["message"]


# ------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_llama):
    """Each new recipe (shrunk) run end to end on the tiny Llama: {name: (rc, json, out)}."""
    from pipeline.cli import main

    work = tmp_path_factory.mktemp("formats")
    res = {}
    for name in NEW:
        out = work / name
        rc = main(["run", "--model", str(tiny_llama), "--recipe", str(small_recipe(work, name)),
                   "--out", str(out), "--cache-dir", str(work / "cache")])  # fmt: skip
        res[name] = (rc, out)
    return res


FORMATS = {"fp8-dynamic": ("float-quantized", "F8_E4M3"),
           "fp8-dynamic-gptq": ("float-quantized", "F8_E4M3"), "fp8-block": ("float-quantized", "F8_E4M3"),
           "w8a8-int8-sq": ("int-quantized", "I8"), "w4a8-fp8": ("pack-quantized", "I32")}  # fmt: skip


@pytest.mark.parametrize("name", NEW)
def test_each_format_is_written_checked_and_reloads(written, name):
    from safetensors import safe_open

    rc, out = written[name]
    assert rc == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    fmt, dtype = FORMATS[name]
    (group,) = qc["config_groups"].values()
    assert qc["format"] == group["format"] == fmt
    assert group["input_activations"]["dynamic"] is True
    assert quantizes_activations(out, query=False)  # the served check's rounding floor applies
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        key = "model.layers.0.mlp.down_proj." + ("weight_packed" if fmt == "pack-quantized"
                                                 else "weight")  # fmt: skip
        assert f.get_slice(key).get_dtype() == dtype
    insp = inspect_checkpoint(out)
    labels = {s.format_label() for s in insp.schemes.values() if s}
    assert labels == {{"fp8-dynamic": "W8A8-FP8", "fp8-dynamic-gptq": "W8A8-FP8", "fp8-block": "W8A8-FP8",
                       "w8a8-int8-sq": "W8A8-INT8", "w4a8-fp8": "W4A8-FP8"}[name]}  # fmt: skip
    m = load_model(out, device="cpu")
    assert m(torch.tensor([[1, 2, 3, 4]])).logits.isfinite().all()
    ev = json.loads((out / "eval.json").read_text())
    assert ev["candidate"]["served_linear_modules"] == 28
    # only W4A8 is rounded to the served weights, and its model card says so
    card = (out / "README.md").read_text()
    rounded = 28 if name == "w4a8-fp8" else 0
    assert ev["quantize"]["served_rounding_modules"] == rounded
    assert ("the int4 values of its 28 W4A8 Linears were chosen" in card) == bool(rounded)


@pytest.mark.parametrize("name", ["fp8-dynamic", "w8a8-int8-sq"])
def test_a_model_on_one_device_is_not_saved_as_offloaded(tmp_path, tiny_llama, name):
    """llm-compressor's save gave every module of a model held whole on one device the
    device "cpu" in `hf_device_map`, and transformers warned "Attempting to save a model
    with offloaded modules" (patches.device_map_only_when_offloaded)."""
    import warnings

    from transformers import AutoTokenizer

    from pipeline.data.tokens import build_token_sets
    from pipeline.quantize import quantize

    r = load_recipe(small_recipe(tmp_path, name))
    tokens = build_token_sets(AutoTokenizer.from_pretrained(tiny_llama), r.calibration,
                              r.evaluation, cache_dir=tmp_path / "c")  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        qc = quantize(tiny_llama, r, tmp_path / "q", tokens=tokens, device="cpu")
    assert qc is not None and qc.offload == "none"
    assert [str(w.message) for w in seen if "offloaded modules" in str(w.message)] == []


def test_quality_orders_as_the_bits_say(written):
    kl = {n: json.loads((written[n][1] / "eval.json").read_text())["metrics"]
          ["kl"]["mean"] for n in NEW}  # fmt: skip
    assert kl["w8a8-int8-sq"] < kl["w4a8-fp8"] and kl["fp8-dynamic"] < kl["w4a8-fp8"]
    assert max(kl["fp8-dynamic"], kl["fp8-block"], kl["w8a8-int8-sq"]) < 0.02


def test_gptq_rounded_fp8_is_fp8_dynamics_checkpoint_with_less_error(written):
    """Same quantization_config (so vLLM serves both with the same kernels), other weights,
    and less KL than rounding to nearest."""
    from safetensors import safe_open

    def qc(name):  # GPTQ records its column order (static: nothing stored, nothing to undo)
        c = json.loads((written[name][1] / "config.json").read_text())["quantization_config"]
        for g in c["config_groups"].values():
            assert g["weights"].pop("actorder") in (None, "static")
        return {k: v for k, v in c.items() if k not in ("version", "global_compression_ratio")}

    def kl(name):
        return json.loads((written[name][1] / "eval.json").read_text())["metrics"]["kl"]["mean"]

    assert qc("fp8-dynamic-gptq") == qc("fp8-dynamic")
    key = "model.layers.0.mlp.down_proj.weight"
    with safe_open(str(written["fp8-dynamic"][1] / "model.safetensors"), "pt") as a, \
         safe_open(str(written["fp8-dynamic-gptq"][1] / "model.safetensors"), "pt") as b:  # fmt: skip
        assert not torch.equal(a.get_tensor(key).float(), b.get_tensor(key).float())
    assert kl("fp8-dynamic-gptq") < kl("fp8-dynamic")


def test_the_validator_catches_a_wrong_fp8_scale(written, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = written["fp8-dynamic"][1]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.1.mlp.up_proj.weight_scale"] = t["model.layers.1.mlp.up_proj.weight_scale"][:5]
    t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"].to(
        torch.bfloat16
    )
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(IntegrityError) as e:
        inspect_checkpoint(bad)
    assert "up_proj: " in e.value.message and "weight_scale shape" in e.value.message
    assert "q_proj: " in e.value.message and "expected F8_E4M3" in e.value.message


# ------------------------------------------------------------------ the served numerics


def _ref_fp8_rows(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """Reference: each row (or each group of a row) on its own, as vLLM's kernels do."""
    out = torch.empty_like(x, dtype=torch.float32)
    n = group or x.shape[-1]
    for i, row in enumerate(x.float().reshape(-1, x.shape[-1])):
        for j in range(0, row.numel(), n):
            v = row[j : j + n]
            amax = float(v.abs().max())
            s = max(amax, 1e-10) / 448.0 if group else max(amax / 448.0, 1.0 / (448 * 512))
            out.view(-1, x.shape[-1])[i, j : j + n] = (v / s).clamp(-448, 448).to(
                torch.float8_e4m3fn
            ).float() * s
    return out


def test_activation_rounding_matches_the_reference():
    from pipeline.evaluate.numerics import fp8_token_quant, int8_token_quant

    torch.manual_seed(0)
    x = torch.randn(3, 5, 256) * torch.logspace(-3, 2, 256)  # outlier channels
    x[0, 0] = 0.0  # an all-zero token: the lower bound on the scale keeps it finite
    assert torch.equal(fp8_token_quant(x), _ref_fp8_rows(x, None).reshape(x.shape))
    assert torch.equal(fp8_token_quant(x, 128), _ref_fp8_rows(x, 128).reshape(x.shape))
    q = int8_token_quant(x)
    for row, qrow in zip(x.reshape(-1, 256), q.reshape(-1, 256), strict=True):
        s = float(row.abs().max()) / 127 or 1.0
        want = torch.round(row / s).clamp(-128, 127) * s
        assert torch.allclose(qrow, want, rtol=1e-6, atol=0)
        assert len(torch.unique(torch.round(qrow / s))) <= 256  # 8 bits


def test_serve_linears_reproduces_the_kernels_on_a_checkpoint(written):
    """On the W4A8 checkpoint: every Linear's input is rounded per token to FP8, its weight
    is q * (vLLM's FP8 group scale); the layer's output equals that arithmetic by hand."""
    from pipeline.evaluate.numerics import fp8_token_quant, serve_linears
    from pipeline.model.w4a8 import w4a8_scales

    out = written["w4a8-fp8"][1]
    m = load_model(out, device="cpu")
    lin = m.model.layers[1].mlp.down_proj
    w0, s = lin.weight.detach().clone(), lin.weight_scale.detach().clone()
    assert serve_linears(m) == 28 and serve_linears(m) == 0  # idempotent
    q = torch.round(w0.reshape(w0.shape[0], -1, 128) / s.float().unsqueeze(-1))
    assert q.abs().max() <= 8
    s8, chan = w4a8_scales(s)
    want_w = (q * s8.unsqueeze(-1)).to(torch.float8_e4m3fn).float() * chan.unsqueeze(-1)
    want_w = want_w.reshape(w0.shape)
    assert torch.equal(lin.weight.detach(), want_w.to(lin.weight.dtype))
    x = torch.randn(2, 7, lin.in_features)
    with torch.no_grad():
        got = lin(x)
    want = torch.nn.functional.linear(fp8_token_quant(x), want_w.to(x.dtype))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # the inputs' rounding matters: the served weights on unrounded inputs give otherwise
    raw = torch.nn.functional.linear(x, want_w.to(x.dtype))
    assert not torch.allclose(raw, got, rtol=1e-5, atol=1e-6)


def test_int8_served_rounding_differs_from_compressed_tensors_where_vllm_does(written):
    """compressed-tensors scales INT8 activations by amax / 127.5 (its range's half width);
    vLLM by amax / 127. The served simulation follows vLLM: the outputs differ."""
    from pipeline.evaluate.numerics import serve_linears

    out = written["w8a8-int8-sq"][1]
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 11]])
    m = load_model(out, device="cpu")
    with torch.no_grad():
        a = m(ids).logits
        serve_linears(m)
        b = m(ids).logits
    assert not torch.equal(a, b) and (a - b).abs().max() < 1.0
    assert math.isfinite(float(b.sum()))


def test_tune_refuses_an_activation_format_rather_than_mismeasure(tiny_llama, tmp_path, capsys):
    rc, out = qship(capsys, "sensitivity", "--model", str(tiny_llama), "--recipe",
                    str(small_recipe(tmp_path, "fp8-dynamic")), "--cache-dir", str(tmp_path / "c"))  # fmt: skip
    assert rc == 2 and "W8A8-FP8" in out["message"] and "weights only" in out["message"]
