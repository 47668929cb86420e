"""quantize on the tiny trained models: every recipe, saved config == plan, reload, KL.

CPU only and small calibration (16 × 128 tokens, batch 16) so that the module runs in a
few minutes on 2 cores. The KL comparison computes KL(ref‖quant) over held-out tokens
with torch directly (it does not use pipeline.evaluate).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from factories import mean_kl as _mean_kl
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.cli import main
from pipeline.data.tokens import build_token_sets
from pipeline.errors import StageError
from pipeline.model.checkpoint import inspect_checkpoint
from pipeline.model.loading import load_meta_model
from pipeline.quantize import quantize
from pipeline.quantize.checks import check_against_plan
from pipeline.recipe import load_recipe, parse_recipe
from pipeline.records import Plan, QuantizedCheckpoint

ROOT = Path(__file__).resolve().parent.parent
R = ROOT / "recipes"
ALL = ["gemma-mixed-w4", "awq-w4", "gptq-w4", "rtn-w4", "mixed-w4-nokv", "w8-int8"]
CASES = [("tiny_gemma", r) for r in ALL] + [
    ("tiny_llama", r) for r in ("gemma-mixed-w4", "awq-w4", "w8-int8")
]
KL_RESULTS: dict = {}


pytestmark = pytest.mark.usefixtures("two_threads")


def _small(recipe_name: str):
    r = load_recipe(R / f"{recipe_name}.yaml")
    r.calibration.num_samples, r.calibration.seq_len, r.calibration.batch_size = 16, 128, 16
    r.evaluation.sequences, r.evaluation.seq_len = 8, 128
    for g in r.groups:  # AWQ's grid search dominates CPU time (bf16 matmuls): 8 points, not 20
        if g.method == "awq":
            g.options.n_grid = 8
    return r


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("quantize")


@pytest.fixture(scope="module")
def tokens(work):
    cache: dict = {}

    def get(model_dir: Path, recipe):
        key = str(model_dir)
        if key not in cache:
            tok = AutoTokenizer.from_pretrained(model_dir)
            cache[key] = build_token_sets(
                tok, recipe.calibration, recipe.evaluation, cache_dir=work / "cache"
            )
        return cache[key]

    return get


@pytest.fixture(scope="module")
def quantized(work, tokens):
    done: dict = {}

    def get(model_dir: Path, recipe_name: str):
        key = (str(model_dir), recipe_name)
        if key not in done:
            r = _small(recipe_name)
            out = work / f"{Path(model_dir).name}--{recipe_name}"
            done[key] = quantize(model_dir, r, out, tokens=tokens(model_dir, r), device="cpu")
        return done[key]

    return get


def _config_schemes(out: Path) -> dict[str, dict | None]:
    """Module -> scheme as written in config.json, read independently of pipeline code."""
    import re

    qc = json.loads((out / "config.json").read_text()).get("quantization_config") or {}
    meta = load_meta_model(out)
    res = {}
    for name, mod in meta.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        hits = []
        for g in (qc.get("config_groups") or {}).values():
            for t in g["targets"]:
                ok = (
                    re.match(t[3:], name)
                    if t.startswith("re:")
                    else (t == name or t == type(mod).__name__)
                )
                if ok and name not in (qc.get("ignore") or []):
                    hits.append(g)
                    break
        assert len(hits) <= 1, f"{name} in {len(hits)} config groups"
        if hits:
            w, a = hits[0]["weights"], hits[0].get("input_activations")
            res[name] = {
                "bits": w["num_bits"],
                "symmetric": w["symmetric"],
                "group_size": w["group_size"] if w["strategy"] == "group" else None,
                "type": w["type"],
                "strategy": w["strategy"],
                "block": w["block_structure"],
                "activations": a and {
                    "type": a["type"], "bits": a["num_bits"], "strategy": a["strategy"],
                    "dynamic": a["dynamic"], "group_size": a["group_size"],
                },
            }  # fmt: skip
        else:
            res[name] = None
    return res


@pytest.mark.parametrize("model,recipe_name", CASES)
def test_recipe_quantizes_as_planned(model, recipe_name, request, quantized):
    model_dir = request.getfixturevalue(model)
    res = quantized(model_dir, recipe_name)
    out = res.path
    plan = res.plan
    # the saved config carries exactly the planned scheme for every Linear
    planned = {m.name: m.scheme.model_dump(exclude={"observer"}) if m.scheme else None
               for m in plan.modules}  # fmt: skip
    assert _config_schemes(out) == planned
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    assert (qc.get("kv_cache_scheme") is not None) == (plan.kv_cache is not None)
    # tensors: packed weights for quantized modules, KV scales when planned
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
    for m in plan.modules:
        assert (f"{m.name}.weight_packed" in keys) == bool(m.scheme), m.name
    assert all(
        (f"{lay}.self_attn.k_scale" in keys) == bool(plan.kv_cache) for lay in plan.decoder_layers
    )
    # report: per-module GPTQ error, AWQ per-mapping loss reduction, per-layer time, memory
    rep = QuantizedCheckpoint.read(out)
    assert rep is not None and rep.model_dump(exclude={"path"}) == res.model_dump(exclude={"path"})
    gptq_mods = {m.name for m in plan.modules if m.method == "gptq"}
    assert set(rep.gptq) == gptq_mods
    assert all(v >= 0 for v in rep.gptq.values())
    assert [a.smooth for a in rep.awq] == [mp.smooth for mp in plan.applied_mappings()]
    assert all(a.best_error <= a.initial_error for a in rep.awq)
    if plan.applied_mappings() or gptq_mods or plan.kv_cache:
        layers = [x.layer for x in rep.layers if x.layer.startswith("model.layers")]
        assert layers == plan.decoder_layers
    assert rep.peak_memory.peak_rss_bytes > 0
    # host peaks by phase (Linux): each phase recorded, none above the process's peak
    hp = rep.peak_memory.host_phases
    assert list(hp) == ["load", "oneshot", "save", "verify"]
    assert all(0 < h.resident_bytes <= rep.peak_memory.peak_rss_bytes for h in hp.values())
    assert all(h.anonymous_bytes and h.anonymous_bytes <= h.resident_bytes for h in hp.values())
    assert rep.checks.checked_modules == len(plan.modules) and rep.checks.reload_probe_tokens > 0
    # size matches the plan's estimate within 3 % (safetensors header, metadata)
    assert (
        abs(rep.checkpoint.bytes - plan.expected_checkpoint_bytes)
        < 0.03 * plan.expected_checkpoint_bytes
    )
    # tokenizer and generation config travel with the checkpoint
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (Path(model_dir) / f).read_bytes()
    # reload with transformers; kept parts in bf16; finite logits
    m = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    assert m.get_input_embeddings().weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(m(input_ids=torch.tensor([[2, 100, 200, 300]])).logits).all()


@pytest.mark.parametrize("model", ["tiny_gemma", "tiny_llama"])
def test_mixed_has_lower_kl_than_rtn_with_same_schemes(model, request, quantized, tokens):
    model_dir = request.getfixturevalue(model)
    mixed = quantized(model_dir, "gemma-mixed-w4")
    rtn = quantized(model_dir, "rtn-w4")
    # rtn-w4 is the mixed recipe's schemes with round-to-nearest
    sm = {m.name: m.scheme for m in mixed.plan.modules}
    assert sm == {m.name: m.scheme for m in rtn.plan.modules}
    assert mixed.plan.kv_cache == rtn.plan.kv_cache
    ts = tokens(model_dir, _small("rtn-w4"))
    assert ts.heldout_hash != ts.calib_hash
    kl_mixed = _mean_kl(model_dir, mixed.path, ts.heldout_ids)
    kl_rtn = _mean_kl(model_dir, rtn.path, ts.heldout_ids)
    KL_RESULTS[model] = {"mixed": kl_mixed, "rtn": kl_rtn}
    print(
        f"\n{model}: mean KL mixed {kl_mixed:.5f} vs RTN {kl_rtn:.5f} ({1 - kl_mixed / kl_rtn:.1%} lower)"
    )
    assert 0 < kl_mixed < kl_rtn


def test_silent_override_is_caught(quantized, tiny_gemma):
    res = quantized(tiny_gemma, "gemma-mixed-w4")
    insp = inspect_checkpoint(res.path)

    def with_scheme(name: str, scheme) -> Plan:
        mods = [m.model_copy(update={"scheme": scheme}) if m.name == name else m
                for m in res.plan.modules]  # fmt: skip
        return res.plan.model_copy(update={"modules": mods})

    check_against_plan(insp, res.plan, where="x")  # the real plan holds
    up = "model.layers.1.mlp.up_proj"
    asym = res.plan.by_name()[up].scheme.model_copy(update={"symmetric": False})
    with pytest.raises(StageError) as ei:  # what an AWQ-group override would give
        check_against_plan(insp, with_scheme(up, asym), where="x")
    assert up in ei.value.message and "differs from the planned" in ei.value.message
    with pytest.raises(StageError, match="model.layers.0.self_attn.q_proj was planned to stay"):
        check_against_plan(insp, with_scheme("model.layers.0.self_attn.q_proj", None), where="x")


def test_failed_check_leaves_nothing(tiny_gemma, tmp_path, tokens, monkeypatch):
    import pipeline.quantize.engine as q

    def boom(out_dir, ids, device="cpu", offload="none"):
        raise StageError("reloaded checkpoint gives non-finite logits (first non-finite output: x)")

    monkeypatch.setattr(q, "verify_reload", boom)
    r = _small("rtn-w4")
    r.kv_cache = None
    out = tmp_path / "out"
    with pytest.raises(StageError):
        quantize(tiny_gemma, r, out, tokens=tokens(tiny_gemma, r), device="cpu")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_quantize_cli(tiny_gemma, tmp_path, capsys):
    d = yaml.safe_load((R / "rtn-w4.yaml").read_text())
    d["calibration"].update(num_samples=8, seq_len=64, batch_size=8)
    d["evaluation"].update(sequences=4, seq_len=64)
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(d))
    out = tmp_path / "q"
    args = ["quantize", "--model", str(tiny_gemma), "--recipe", str(p), "--out", str(out)]
    assert main([*args, "--cache-dir", str(tmp_path / "c"), "--json"]) == 0
    cap = capsys.readouterr()
    res = json.loads(cap.out)  # stdout holds only the JSON (library output goes to the log)
    assert res["path"] == str(out) and res["checks"]["checked_modules"] == 29
    assert "✓ quantize" in cap.err and "Loading weights" not in cap.err
    log = (tmp_path / "c" / "logs" / "qship.log").read_text()  # the --cache-dir's log
    assert "[4/4 layers] model.layers.3 done" in log  # per-layer lines in the log
    # the output exists now: a second run is a usage error, nothing overwritten
    assert main([*args, "--cache-dir", str(tmp_path / "c"), "--json"]) == 2
    assert "already exists" in json.loads(capsys.readouterr().out)["message"]
    # an invalid recipe exits 2 before any compute
    d["dtype"] = "float16"
    p.write_text(yaml.safe_dump(d))
    assert main([*args[:-1], str(tmp_path / "q2"), "--json"]) == 2
    assert "bfloat16" in json.loads(capsys.readouterr().out)["hint"]
    assert not (tmp_path / "q2").exists()


def test_mse_observer_is_used_and_recorded(tiny_gemma, quantized, tokens, work):
    """`scheme.observer: mse` reaches llm-compressor (other scales than min-max) and the
    saved config, and the config check holds it to the plan."""
    r = _small("gptq-w4")
    for g in r.groups:
        if g.scheme:
            g.scheme.observer = "mse"
    res = quantize(tiny_gemma, r, work / "gptq-mse", tokens=tokens(tiny_gemma, r), device="cpu")
    assert all(m.scheme.observer == "mse" for m in res.plan.modules if m.scheme)
    qc = json.loads((res.path / "config.json").read_text())["quantization_config"]
    assert {g["weights"]["observer"] for g in qc["config_groups"].values()} == {"mse"}
    base = quantized(tiny_gemma, "gptq-w4").path
    key = "model.layers.0.mlp.down_proj.weight_scale"
    with (
        safe_open(str(res.path / "model.safetensors"), "pt") as a,
        safe_open(str(base / "model.safetensors"), "pt") as b,
    ):
        assert not torch.equal(a.get_tensor(key), b.get_tensor(key))


def test_imatrix_observer_weights_the_search_by_the_calibration_activations(
    tiny_gemma, quantized, tokens, work
):
    """`observer: imatrix_mse` (llm-compressor's importance-weighted MSE search) makes a
    data-free RTN recipe a calibrated one, reaches the saved config, and chooses scales that
    depend on the calibration text."""
    r = _small("gptq-w4")
    for g in r.groups:
        if g.scheme:
            g.scheme.observer = "imatrix_mse"
    res = quantize(tiny_gemma, r, work / "gptq-imatrix", tokens=tokens(tiny_gemma, r), device="cpu")
    qc = json.loads((res.path / "config.json").read_text())["quantization_config"]
    assert {g["weights"]["observer"] for g in qc["config_groups"].values()} == {"imatrix_mse"}
    # the scales follow the calibration text: other samples, other scales (min-max and the
    # unweighted mse search read the weights alone)
    r2 = r.model_copy(deep=True)
    r2.calibration.seed = r.calibration.seed + 1
    other = {
        "min-max": quantized(tiny_gemma, "gptq-w4").path,
        "imatrix, other samples": quantize(tiny_gemma, r2, work / "gptq-imatrix-2", tokens=build_token_sets(
            AutoTokenizer.from_pretrained(tiny_gemma), r2.calibration, r2.evaluation,
            cache_dir=work / "cache"), device="cpu").path,
    }  # fmt: skip
    key = "model.layers.0.mlp.down_proj.weight_scale"
    with safe_open(str(res.path / "model.safetensors"), "pt") as a:
        mine = a.get_tensor(key)
    for name, path in other.items():
        with safe_open(str(path / "model.safetensors"), "pt") as b:
            assert not torch.equal(mine, b.get_tensor(key)), name


def test_calibrated_model_is_released_after_quantize(tiny_gemma, quantized):
    """llm-compressor's session must not keep the calibrated model alive into the reload
    check (it would sit beside the reloaded checkpoint at the stage's memory peak)."""
    from llmcompressor.core import active_session

    quantized(tiny_gemma, "gemma-mixed-w4")
    assert active_session().state.model is None


def test_awq_grid_search_drops_attention_weights_per_batch():
    """Inside awq_lean_grid_search, AWQ's _run_samples keeps only each batch's output: the
    second element of the parent's tuple (eager attention weights) is freed before the next
    batch runs, and the parent's forward is untouched."""
    import weakref

    from llmcompressor.modifiers.transform.awq import AWQModifier

    from pipeline.compat.llmcompressor_0_14 import awq_lean_grid_search

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen_alive: list[bool] = []
            self.extra: list[weakref.ref] = []

        def forward(self, x):
            self.seen_alive.append(any(r() is not None for r in self.extra))
            w = torch.ones(64, 64)
            self.extra.append(weakref.ref(w))
            return x * 2, w

    parent = Parent()
    mod = AWQModifier(mappings=[])
    batches = [{"x": torch.full((2, 3), float(i))} for i in range(4)]
    mod._parent_args_cache[parent] = batches
    with awq_lean_grid_search():
        outs = mod._run_samples(parent)
    assert [o.tolist() for o in outs] == [(b["x"] * 2).tolist() for b in batches]
    assert parent.seen_alive == [False] * 4
    assert "forward" not in parent.__dict__
    # without the patch the library keeps them all (what the patch is for)
    parent.seen_alive.clear(), parent.extra.clear()
    mod._run_samples(parent)
    assert parent.seen_alive == [False, True, True, True]


def test_awq_grid_search_streams_quantized_outputs(tiny_gemma, tokens, work, monkeypatch):
    """The real AWQ grid search on the tiny Gemma, 8 calibration batches: with qship's patch
    at most the unquantized outputs + 3 quantized batches of each attention block are alive
    at once (without it, both full sets: 2 x 8), and the checkpoint is the same bytes. Three,
    not one: `_compute_loss` iterates `enumerate(zip(...))`, and CPython's zip still holds
    the batch before last in its recycled result tuple while the next batch is made."""
    import weakref

    import pipeline.quantize.engine as q

    r = _small("gemma-mixed-w4")
    r.calibration.batch_size = 2  # 16 samples -> 8 batches
    ts = tokens(tiny_gemma, r)
    n_batches = r.calibration.num_samples // r.calibration.batch_size

    def run(name: str) -> tuple[int, dict]:
        alive: list[weakref.ref] = []
        peak = [0]

        def hook(_m, _i, out):
            t = out[0] if isinstance(out, tuple) else out
            alive.append(weakref.ref(t))
            peak[0] = max(peak[0], sum(x() is not None for x in alive))

        from transformers.models.gemma3 import modeling_gemma3

        orig_init = modeling_gemma3.Gemma3Attention.__init__

        def init(self, *a, **kw):
            orig_init(self, *a, **kw)
            self.register_forward_hook(hook)

        with monkeypatch.context() as m:
            m.setattr(modeling_gemma3.Gemma3Attention, "__init__", init)
            res = quantize(tiny_gemma, r, work / name, tokens=ts, device="cpu")
        with safe_open(str(res.path / "model.safetensors"), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        return peak[0], tensors

    lean_peak, lean = run("stream-lean")
    monkeypatch.setattr(q, "awq_lean_grid_search", contextlib.nullcontext)
    lib_peak, lib = run("stream-library")
    assert lib_peak == 2 * n_batches  # what the library keeps: the test can see it
    assert lean_peak <= n_batches + 3
    assert lean.keys() == lib.keys()
    for k in lean:
        assert torch.equal(lean[k], lib[k]), k


def test_awq_cache_offload_option(tiny_gemma):
    """offload_cache: true keeps AWQ's calibration cache in CPU memory, false on the
    execution device, null leaves llm-compressor's default (on the device for a dense
    model): the default recipe measured best that way (bench/RESULTS.md)."""
    from llmcompressor.modifiers.transform.awq import AWQModifier

    from pipeline.quantize.modifiers import build_modifiers
    from pipeline.quantize.plan import build_plan

    meta = load_meta_model(tiny_gemma)

    def awq_offload(recipe):
        plan = build_plan(meta, recipe)
        return [
            m.offload_device for m in build_modifiers(plan, recipe) if isinstance(m, AWQModifier)
        ]

    r = load_recipe(R / "gemma-mixed-w4.yaml")
    assert r.groups[0].options.offload_cache is None
    (default,) = awq_offload(r)
    assert not isinstance(default, torch.device)  # the library's own (unset) default
    r.groups[0].options.offload_cache = True
    assert awq_offload(r) == [torch.device("cpu")]
    r.groups[0].options.offload_cache = False
    assert awq_offload(r) == [None]


def test_save_under_cpu_offload_releases_pinned_blocks_per_module(
    tiny_llama, tmp_path, monkeypatch
):
    """With --offload cpu the save compresses module by module and hands torch's cached
    page-locked blocks back after each one (the 8B's save was its run's host peak); the
    compression is compressed-tensors' own and the checkpoint the same as without offload."""
    from pipeline.model.files import hash_model_dir
    from pipeline.quantize import memory

    r = parse_recipe({"name": "rtn", "others": "keep", "groups": [
        {"name": "all", "roles": ["attention", "mlp"], "method": "rtn",
         "scheme": {"bits": 4, "group_size": 32, "symmetric": True}}]})  # fmt: skip
    tokens = build_token_sets(AutoTokenizer.from_pretrained(tiny_llama), r.calibration,
                              r.evaluation, cache_dir=tmp_path / "c")  # fmt: skip
    calls: list[int] = []
    monkeypatch.setattr(memory, "release_pinned_cache", lambda: calls.append(1))
    plain = quantize(tiny_llama, r, tmp_path / "plain", tokens=tokens, device="cpu")
    assert plain is not None and not calls  # not without offload
    off = quantize(tiny_llama, r, tmp_path / "off", tokens=tokens, device="cpu", offload="cpu")
    assert off is not None and off.offload == "cpu"
    assert len(calls) >= off.checkpoint.quantized_modules
    assert hash_model_dir(off.path)[1] == hash_model_dir(plain.path)[1]
