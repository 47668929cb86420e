"""RTN's W4A8 weights moved to the int4 values whose served weight is nearest
(quantize/w4a8_rtn.py): on the tiny trained Llama, the data-free W4A8 recipe stores, for
every quantized Linear, q = the nearest served value's level of the unquantized weight (the
library's RTN stores round(w / s), w / s in float32), with the same format and scales."""

from __future__ import annotations

import pytest
import torch
import yaml
from small_recipes import small_recipe, stored_format

from pipeline.model.loading import load_model
from pipeline.model.w4a8 import channel_factor, int4_levels, nearest_served, w4a8_weight


@pytest.fixture(scope="module")
def rtn_w4a8(tmp_path_factory, tiny_llama):
    """The data-free W4A8 recipe (shrunk) with RTN, its tokens and a work folder."""
    from transformers import AutoTokenizer

    from pipeline.data.tokens import build_token_sets
    from pipeline.recipe import load_recipe

    work = tmp_path_factory.mktemp("w4a8rtn")
    path = small_recipe(work, "w4a8-fp8")
    d = yaml.safe_load(path.read_text())
    d["groups"][0].update(method="rtn", options={})
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    r = load_recipe(path)
    tokens = build_token_sets(AutoTokenizer.from_pretrained(tiny_llama), r.calibration,
                              r.evaluation, cache_dir=work / "cache")  # fmt: skip
    return r, tokens, work


@pytest.fixture(scope="module")
def both(rtn_w4a8, tiny_llama):
    """tiny-llama under W4A8 with RTN, with qship's served rounding and without it."""
    import pipeline.quantize.engine as engine
    from pipeline.quantize import quantize

    r, tokens, work = rtn_w4a8
    out = {True: quantize(tiny_llama, r, work / "served", tokens=tokens, device="cpu")}
    mp = pytest.MonkeyPatch()
    mp.setattr(engine, "rtn_rounds_to_served_w4a8", lambda model, names: 0)
    try:
        out[False] = quantize(tiny_llama, r, work / "plain", tokens=tokens, device="cpu")
    finally:
        mp.undo()
    return out


def _nearest_served_levels(checkpoint, reference):
    """For each quantized Linear: (stored q, q of the nearest served weight of the
    unquantized weight, the scales)."""
    m = load_model(checkpoint, device="cpu")
    for name, lin in m.named_modules():
        if hasattr(lin, "weight_scale"):
            s = lin.weight_scale.detach().float()
            w0 = reference.get_submodule(name).weight.detach().float()
            eff = s.repeat_interleave(w0.shape[1] // s.shape[1], 1)
            want, _ = nearest_served(w0, eff, channel_factor(s))
            yield name, int4_levels(lin.weight.detach(), s).reshape(w0.shape), want, s


def test_rtn_w4a8_stores_the_nearest_served_level_of_each_weight(both, tiny_llama):
    rec = both
    assert rec[True].served_rounding_modules == rec[True].checkpoint.quantized_modules == 28
    assert rec[False].served_rounding_modules == 0
    assert stored_format(rec[True].path) == stored_format(rec[False].path)
    ref = load_model(tiny_llama, device="cpu")
    off = load_model(rec[False].path, device="cpu")
    moved = 0
    for name, q_on, want, s in _nearest_served_levels(rec[True].path, ref):
        w0 = ref.get_submodule(name).weight.detach().float()
        assert torch.equal(s, off.get_submodule(name).weight_scale.detach().float())
        q_off = int4_levels(off.get_submodule(name).weight.detach(), s).reshape(w0.shape)
        assert torch.equal(q_on, want), name
        moved += int((q_on != q_off).sum())
        err = [float((w4a8_weight(q.reshape(*s.shape, -1), s).reshape(w0.shape) - w0).square().sum())
               for q in (q_on, q_off)]  # fmt: skip
        assert err[0] <= err[1], name
    assert moved > 0  # the served grid is not the uniform one


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offloaded_weights_move_too(rtn_w4a8, tiny_llama, offload):
    from pipeline.quantize import quantize

    r, tokens, work = rtn_w4a8
    rec = quantize(tiny_llama, r, work / offload, tokens=tokens, device="cpu", offload=offload)
    assert rec is not None and rec.served_rounding_modules == 28
    ref = load_model(tiny_llama, device="cpu")
    for name, q, want, _ in _nearest_served_levels(rec.path, ref):
        assert torch.equal(q, want), name


def test_only_w4a8_linears_move():
    """A W4A16 Linear keeps round(w / s); the same weights under W4AFP8 move."""
    from compressed_tensors.quantization import preset_name_to_scheme

    from pipeline.quantize.w4a8_rtn import rtn_rounds_to_served_w4a8

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 8, bias=False),
                                torch.nn.Linear(256, 8, bias=False))  # fmt: skip
    model[1].weight.data.copy_(model[0].weight.data)
    for lin, preset in zip(model, ("W4A16", "W4AFP8"), strict=True):
        s = lin.weight.detach().reshape(8, 2, 128).abs().amax(-1) / 7
        lin.weight_scale = torch.nn.Parameter(s, requires_grad=False)
        lin.quantization_scheme = preset_name_to_scheme(preset, ["Linear"])
    before = model[0].weight.detach().clone()
    assert rtn_rounds_to_served_w4a8(model, ["0", "1"]) == 1
    assert torch.equal(model[0].weight, before)
    s = model[1].weight_scale.float()
    q = int4_levels(model[1].weight.detach(), s).reshape(8, 256)
    assert (q != torch.round(before / s.repeat_interleave(128, 1)).clamp(-8, 7)).any()
