"""The reload check's host memory: a packed checkpoint loaded with offloading is decompressed
one module at a time for the probe forward (quantize/checks.py), not all at once, and gives
the logits the dense reload gives."""

from __future__ import annotations

import torch
from compressed_tensors.offload import disable_onloading
from transformers import AutoTokenizer

from pipeline.model import loading
from pipeline.model.loading import load_model
from pipeline.model.roles import decoder_layer_list
from pipeline.quantize import quantize
from pipeline.quantize.checks import decompressed_per_module
from pipeline.recipe import parse_recipe


def test_probe_decompresses_as_the_forward_goes_and_drops_what_ran(
    tiny_llama, tmp_path, monkeypatch
):
    from pipeline.data.tokens import build_token_sets

    r = parse_recipe({"name": "rtn-sym", "others": "keep", "groups": [
        {"name": "all", "roles": ["attention", "mlp"], "method": "rtn",
         "scheme": {"bits": 4, "group_size": 32, "symmetric": True,
                    "on_indivisible": "fallback"}}]})  # fmt: skip
    r.evaluation.sequences, r.evaluation.seq_len = 2, 32
    tokens = build_token_sets(AutoTokenizer.from_pretrained(tiny_llama), r.calibration,
                              r.evaluation, cache_dir=tmp_path / "c")  # fmt: skip
    qc = quantize(tiny_llama, r, tmp_path / "q", tokens=tokens, device="cpu")
    assert qc is not None
    ids = tokens.heldout_ids[:1].long()
    with torch.no_grad():
        dense = load_model(qc.path, device="cpu")(input_ids=ids).logits
    # the --offload cpu load of a GPU run (compressed-tensors' offloading, weights packed
    # until the first forward), here with the CPU as the onload device
    monkeypatch.setattr(loading, "_distributed", lambda: True)
    m = load_model(qc.path, device="cpu", offload="cpu", pin=False)
    assert hasattr(m, "ct_decompress_hook")  # packed: the path the 8B reload check takes
    layers = decoder_layer_list(m)[1]
    seen: list[int] = []  # packed tensors left in the layers after each layer's forward

    def packed() -> int:
        with disable_onloading():
            return sum("packed" in n for n, _ in layers.named_parameters())

    hooks = [layer.register_forward_hook(lambda *_: seen.append(packed())) for layer in layers]
    before = packed()
    with torch.no_grad(), decompressed_per_module(m):
        logits = m(input_ids=ids).logits
    for h in hooks:
        h.remove()
    assert before > 0 and not hasattr(m, "ct_decompress_hook")
    step = before // len(layers)
    assert seen == [before - step * (i + 1) for i in range(len(layers))]  # layer by layer
    with disable_onloading():  # what ran is dropped: no Linear weight is left in host memory
        linear = [p for mod in layers.modules() if isinstance(mod, torch.nn.Linear)
                  for p in mod.parameters(recurse=False)]  # fmt: skip
        assert linear and all(p.device.type == "meta" for p in linear)
    torch.testing.assert_close(logits, dense, atol=1e-4, rtol=1e-4)
