"""Recipe schema and the invalid-recipe cases: each exits 2 naming the file, field and fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main
from pipeline.errors import RecipeError
from pipeline.model.loading import load_meta_model
from pipeline.quantize.validate import validate_for_model
from pipeline.recipe import load_recipe, parse_recipe
from pipeline.records import ModuleScheme

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
EXPECTED = {
    "gemma-mixed-w4",
    "gemma-mixed-w4-cpu",
    "awq-w4",
    "gptq-w4",
    "rtn-w4",
    "mixed-w4-nokv",
    "w8-int8",
    "gptq-w4a-mse",
    "gptq-w4-mse-kvhead-q-skip5",
    "autoround-w4a",
    "fp8-dynamic",
    "fp8-dynamic-gptq",
    "fp8-block",
    "w8a8-int8-sq",
    "w4a8-fp8",
}


def _base() -> dict:
    return yaml.safe_load((ROOT / "recipes" / "gemma-mixed-w4.yaml").read_text())


def _write(tmp_path: Path, data: dict, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def _plan_exit(model: Path, recipe: Path, capsys) -> tuple[int, dict]:
    code = main(["plan", "--model", str(model), "--recipe", str(recipe), "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_cpu_recipe_is_the_default_plan_with_a_smaller_calibration_set():
    full = load_recipe(ROOT / "recipes" / "gemma-mixed-w4.yaml").resolved()
    cpu = load_recipe(ROOT / "recipes" / "gemma-mixed-w4-cpu.yaml").resolved()
    for key in ("dtype", "groups", "kv_cache"):
        assert cpu[key] == full[key], key
    c, f = cpu["calibration"], full["calibration"]
    assert c["num_samples"] * c["seq_len"] < f["num_samples"] * f["seq_len"]


def test_imatrix_beside_awq_is_refused_before_any_stage_runs():
    """llm-compressor 0.14 fails at layer 0 on imatrix_mse beside an AWQ group: the recipe is
    refused when it is read, naming the field, while imatrix without AWQ still loads."""
    data = _base()
    data["groups"][1]["scheme"]["observer"] = "imatrix_mse"
    with pytest.raises(RecipeError, match=r"groups\[1\]\.scheme\.observer.*AWQ"):
        parse_recipe(data)
    data["groups"][0]["method"] = "gptq"
    data["groups"][0].pop("options")
    assert parse_recipe(data).groups[1].scheme.observer == "imatrix_mse"


def test_all_recipes_load_with_gates_and_comment():
    assert {p.stem for p in RECIPES} == EXPECTED
    for p in RECIPES:
        r = load_recipe(p)
        assert r.name == p.stem
        text = p.read_text()
        assert text.lstrip().startswith("#") and "Choose it" in text, (
            f"{p.name}: say when to choose it"
        )
        g = r.gates
        assert g.kl_mean_max and g.kl_p99_max and g.top1_min and g.ppl_ratio_max, p.name
        assert r.hash() == load_recipe(p).hash()
        assert len(r.hash()) == 64
    default = load_recipe(ROOT / "recipes" / "gemma-mixed-w4.yaml")
    methods = {
        g.name: (
            g.method,
            g.scheme and ModuleScheme(**g.scheme.model_dump(exclude={"on_indivisible"})).label(),
        )
        for g in default.groups
    }
    assert methods == {
        "attention": ("awq", "int4 asym g128"),
        "mlp": ("gptq", "int4 sym g128"),
        "head": ("none", None),
    }
    assert default.kv_cache is not None and default.dtype == "bfloat16"


# recipes/models/<folder>: recipes `qship tune` chose modules for on one model, with its config
MODEL_CONFIGS = {
    "gemma-3-270m": {"model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048,
                     "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
                     "head_dim": 256, "vocab_size": 262144, "tie_word_embeddings": True},
}  # fmt: skip


def test_model_recipes_plan_on_their_model_at_their_bits_with_fused_sets_whole():
    """A tuned recipe names modules by layer number: it plans on its own model (the plan
    refuses a split fused set and a target or exclude that meets nothing), at the bits its
    name says, with the same header and gates as every shipped recipe."""
    from transformers import AutoConfig

    from pipeline.quantize.plan import plan_for_config

    folders = sorted(p for p in (ROOT / "recipes" / "models").iterdir())
    assert [p.name for p in folders] == sorted(MODEL_CONFIGS)
    for folder in folders:
        dims = dict(MODEL_CONFIGS[folder.name])
        cfg = AutoConfig.for_model(dims.pop("model_type"), **dims)
        paths = sorted(folder.glob("*.yaml"))
        assert paths, folder
        for p in paths:
            r = load_recipe(p)
            assert r.name == p.stem and "Choose it" in p.read_text() and r.gates.kl_mean_max
            bpw = plan_for_config(cfg, r).bits_per_weight.quantized
            assert f"tune{bpw:.3f}" in r.name, (p.name, bpw)


def test_hash_is_of_resolved_recipe(tmp_path):
    a = _base()
    b = _base()
    b["calibration"].pop("seed")  # default 0 == explicit 0
    assert parse_recipe(a).hash() == parse_recipe(b).hash()
    b["calibration"]["seed"] = 1
    assert parse_recipe(a).hash() != parse_recipe(b).hash()


@pytest.mark.parametrize(
    "mutate, field, fix",
    [
        (lambda d: d.update(colour="red"), "colour", "delete this key"),
        (lambda d: d["groups"][0].update(bitz=4), "groups[0].bitz", "delete this key"),
        (
            lambda d: d["groups"][0]["scheme"].update(bits=3),
            "groups[0].scheme.bits",
            "allowed values",
        ),
        (lambda d: d["groups"][2].update(scheme={"bits": 4}), "groups[2]", "delete `scheme`"),
        (
            lambda d: d["groups"][0]["options"].update(dampening_frac=0.1),
            "groups[0]",
            "do not apply",
        ),
        (  # groups[1] is the GPTQ group: AWQ's cache option does not apply to it
            lambda d: d["groups"][1]["options"].update(offload_cache=True),
            "groups[1]",
            "do not apply",
        ),
        (lambda d: d.update(kv_cache={"scheme": "int8"}), "kv_cache.scheme", "allowed values"),
        (lambda d: d.update(dtype="fp16"), "dtype", "allowed values"),
        (lambda d: d["calibration"].update(num_samples=0), "calibration.num_samples", "correct"),
    ],
)
def test_schema_errors_name_file_field_fix(tmp_path, mutate, field, fix):
    d = _base()
    mutate(d)
    p = _write(tmp_path, d)
    with pytest.raises(RecipeError) as ei:
        load_recipe(p)
    e = ei.value
    assert e.exit_code == 2
    assert e.path == str(p)
    assert f"`{field}" in e.message, e.message
    assert fix in (e.hint or "") + e.message, str(e)


_NAN, _INF = float("nan"), float("inf")
_WORKLOAD = {"name": "w", "prompt_len": 8, "output_len": 8, "concurrency": 1}


def _serve_gate(field: str, value: float) -> dict:
    return {"workloads": [_WORKLOAD], "gates": {field: {"w": value}}}


@pytest.mark.parametrize(
    "mutate, field, says",
    [
        (lambda d: d["gates"].update(top1_min=_NAN), "gates.top1_min", "finite"),
        (lambda d: d["gates"].update(kl_mean_max=_INF), "gates.kl_mean_max", "finite"),
        (lambda d: d["gates"].update(kl_p99_max=-0.1), "gates.kl_p99_max", "bound"),
        (lambda d: d["gates"].update(top1_min=1.5), "gates.top1_min", "bound"),
        (lambda d: d["gates"].update(ppl_ratio_max=0), "gates.ppl_ratio_max", "bound"),
        (lambda d: d.update(serve=_serve_gate("min_speedup", -1.2)),
         "serve.gates.min_speedup.w", "bound"),
        (lambda d: d.update(serve=_serve_gate("max_ttft_ms", _NAN)),
         "serve.gates.max_ttft_ms.w", "finite"),
        (lambda d: d.update(serve={"max_kl": _INF}), "serve.max_kl", "finite"),
        (lambda d: d["evaluation"].update(max_overlap=_NAN), "evaluation.max_overlap", "finite"),
    ],
)  # fmt: skip
def test_every_number_is_finite_and_in_range(tmp_path, mutate, field, says):
    """NaN passes no comparison (a NaN limit used to be accepted; the run computed, then
    failed on "limit <= nan"), and a limit out of its range can never be met: exit 2 at
    load time naming the field."""
    d = _base()
    mutate(d)
    with pytest.raises(RecipeError) as ei:
        load_recipe(_write(tmp_path, d))
    assert f"`{field}`" in ei.value.message, ei.value.message
    assert says in (ei.value.hint or ""), str(ei.value)


def test_every_shipped_recipe_says_where_its_limits_came_from():
    """Issue 57 item 7: the shipped limits are Gemma's and Qwen's rows; each recipe records
    the model, the source and the figure behind every limit it sets (machine-readable,
    `gates.origin`), and each figure passes its own limit."""
    from pipeline.recipe import GATE_FIGURES

    for p in RECIPES:
        g = load_recipe(p).gates
        assert g.origin is not None and g.origin.model and g.origin.source, p.name
        set_ = {n for n in GATE_FIGURES if getattr(g, n) is not None}
        assert set(g.origin.measured) == set_, p.name
        assert all(margin >= 0 for *_, margin in g.margins()), (p.name, g.margins())


def test_gate_origin_is_checked_and_not_hashed(tmp_path):
    d = _base()
    plain = parse_recipe({**d, "gates": {k: v for k, v in d["gates"].items() if k != "origin"}})
    assert parse_recipe(d).hash() == plain.hash()  # it explains the limits, changes no output
    d["gates"]["origin"]["measured"]["kl_p999_max"] = 3.0
    with pytest.raises(RecipeError, match=r"gates.*not a limit this recipe sets"):
        load_recipe(_write(tmp_path, d))


def test_plan_prints_where_the_gates_came_from(tmp_path, tiny_llama, capsys):
    rc = main(["plan", "--model", str(tiny_llama), "--recipe", str(ROOT / "recipes" /
               "fp8-dynamic.yaml")])  # fmt: skip
    out = capsys.readouterr().err  # the summary is printed on stderr
    assert rc == 0 and "gates from Gemma 3 270M" in out, out
    assert "top1_min 0.89: measured 0.91, margin +0.02" in out, out
    assert "SmolLM2-135M" in out  # the recipe's note
    d = _base()
    del d["gates"]["origin"]
    rc = main(["plan", "--model", str(tiny_llama), "--recipe", str(_write(tmp_path, d))])
    assert rc == 0 and "gates: no origin recorded" in capsys.readouterr().err


def test_unknown_key_exits_2_via_cli(tmp_path, tiny_gemma):
    d = _base()
    d["gates"]["kl_mean"] = 0.1  # misspelt gate
    p = _write(tmp_path, d)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "plan",
            "--model",
            str(tiny_gemma),
            "--recipe",
            str(p),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    err = json.loads(proc.stdout)
    assert err["error"] == "RecipeError" and err["path"] == str(p)
    assert "gates.kl_mean" in err["message"] and "delete this key" in err["hint"]


def test_overlap_names_both_groups_and_a_module(tmp_path, tiny_gemma, capsys):
    d = _base()
    d["groups"][1]["targets"] = ["re:.*_proj$"]  # MLP group now also grabs attention
    code, err = _plan_exit(tiny_gemma, _write(tmp_path, d), capsys)
    assert code == 2
    msg = err["message"]
    assert "'attention'" in msg and "'mlp'" in msg and "overlap" in msg
    assert "model.layers.0.self_attn.q_proj" in msg
    assert "exactly one group" in err["hint"]


def test_overlap_by_class_name(tmp_path, tiny_llama, capsys):
    d = _base()
    d["groups"].insert(
        0, {"name": "all", "targets": ["Linear"], "method": "rtn", "scheme": {"bits": 8}}
    )
    code, err = _plan_exit(tiny_llama, _write(tmp_path, d), capsys)
    assert code == 2 and "'all'" in err["message"] and "'attention'" in err["message"]


def test_target_matching_nothing(tmp_path, tiny_gemma, capsys):
    d = _base()
    d["groups"][1]["targets"] = ["re:.*mlp\\.down_proj$", "re:.*feed_forward\\.w1$"]
    code, err = _plan_exit(tiny_gemma, _write(tmp_path, d), capsys)
    assert code == 2
    assert "groups[1].targets[1]" in err["message"] and "matches no module" in err["message"]
    assert "feed_forward" in err["message"] and "module names look like" in err["hint"]


def test_group_size_must_divide_input_width(tmp_path, tiny_llama, capsys):
    d = _base()
    d["groups"][1]["scheme"].update(group_size=256, on_indivisible="error")  # widths 128, 384
    code, err = _plan_exit(tiny_llama, _write(tmp_path, d), capsys)
    assert code == 2
    msg = err["message"]
    assert "groups[1].scheme.group_size" in msg
    assert "model.layers.0.mlp.gate_proj" in msg and "width 128" in msg
    assert "divides 128" in err["hint"] and "on_indivisible: fallback" in err["hint"]
    # with the fallback a size that divides none of the group's widths is still an error
    d["groups"][1]["scheme"]["on_indivisible"] = "fallback"
    code, err = _plan_exit(tiny_llama, _write(tmp_path, d), capsys)
    assert code == 2 and "divides none of this model's Linear input widths" in err["message"]


def test_group_size_names_the_wide_module(tmp_path, tiny_llama, capsys):
    d = _base()
    d["groups"][1].pop("roles")
    d["groups"][1]["scheme"].update(group_size=256, on_indivisible="error")
    d["groups"][1]["targets"] = ["re:.*mlp\\.down_proj$"]
    d["groups"].insert(
        2, {"name": "mlp_in", "targets": ["re:.*mlp\\.(gate|up)_proj$"], "method": "none"}
    )
    code, err = _plan_exit(tiny_llama, _write(tmp_path, d), capsys)
    assert code == 2
    assert "model.layers.0.mlp.down_proj" in err["message"] and "width 384" in err["message"]


def test_fp16_for_gemma_says_use_bf16(tmp_path, tiny_gemma, tiny_llama, capsys):
    d = _base()
    d["dtype"] = "float16"
    p = _write(tmp_path, d)
    code, err = _plan_exit(tiny_gemma, p, capsys)
    assert code == 2
    assert (
        "`dtype`" in err["message"] and "Gemma" in err["message"] and "overflow" in err["message"]
    )
    assert "bfloat16" in err["hint"]
    code, _ = _plan_exit(tiny_llama, p, capsys)  # fine for Llama
    assert code == 0


def test_every_linear_needs_a_group(tmp_path, tiny_gemma):
    d = _base()
    d["groups"] = d["groups"][:2]  # lm_head no longer matched
    r = load_recipe(_write(tmp_path, d))
    with pytest.raises(RecipeError) as ei:
        validate_for_model(r, load_meta_model(tiny_gemma))
    assert "lm_head" in ei.value.message and "method: none" in ei.value.hint


def test_quantizing_group_cannot_target_non_linear(tmp_path, tiny_gemma):
    d = _base()
    d["groups"][0]["targets"] = ["re:.*self_attn"]  # also matches the attention module
    r = load_recipe(_write(tmp_path, d))
    with pytest.raises(RecipeError) as ei:
        validate_for_model(r, load_meta_model(tiny_gemma))
    assert "not a Linear" in ei.value.message and "Gemma3Attention" in ei.value.message


def test_yaml_syntax_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(p)
    with pytest.raises(RecipeError, match="cannot read"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "text, line, says",
    [
        (b"name: a\ndtype: bfloat16\nname: b\n", 3, "written twice"),
        (b"name: a\ndescription: caf\xe9\n", 2, "not UTF-8"),
        (b"name: " + b"[" * 5000 + b"]" * 5000 + b"\n", 1, "nested deeper"),
        (b"a: &x [1]\n" + b"".join(b"k%d: *x\n" % i for i in range(100)), 66, "alias"),
    ],
    ids=["duplicate-key", "latin-1", "deep-nesting", "aliases"],
)
def test_recipe_file_refused_with_its_line(tmp_path, capsys, text, line, says):
    """A duplicated key (the last value silently won), a file that is not UTF-8
    (UnicodeDecodeError, exit 1), nesting that exhausts the parser's stack (RecursionError)
    and alias bombs: exit 2 naming the file and the line."""
    p = tmp_path / "r.yaml"
    p.write_bytes(text)
    with pytest.raises(RecipeError) as ei:
        load_recipe(p)
    assert ei.value.path == str(p) and says in ei.value.message, ei.value.message
    assert f"line {line}:" in ei.value.message, ei.value.message
    capsys.readouterr()
    rc = main(["plan", "--model", "unused", "--recipe", str(p), "--json"])
    err = json.loads(capsys.readouterr().out)
    assert rc == 2 and err["path"] == str(p), err


def test_recipe_file_size_is_bounded(tmp_path):
    from pipeline.recipe.loading import MAX_BYTES

    p = tmp_path / "big.yaml"
    p.write_text("name: a\ndescription: " + "x" * MAX_BYTES + "\n")
    with pytest.raises(RecipeError, match="bytes, more than"):
        load_recipe(p)


def test_cli_usage_errors_exit_2(capsys):
    """typer's own (vendored click) exceptions map to the contract's exit 2, not 1."""
    from tests.cli_run import qship

    rc, err = qship(capsys, "plan", "--model", "x")
    assert rc == 2 and err["error"] == "MissingParameter" and "--recipe" in err["message"]
    rc, err = qship(capsys, "run", "--no-such-option")
    assert rc == 2, err


# --- the method table ------------------------------------------------------------------


def test_every_method_has_a_group_class_and_a_rounding():
    """One table per layer, and they agree: the recipe's groups (recipe/methods.py), how
    quantize rounds each (quantize/methods.py) and the plan record's method names."""
    import typing

    from pipeline.quantize.methods import ROUNDING
    from pipeline.recipe import METHODS, Group, Method
    from pipeline.records.plan import Method as PlanMethod

    names = set(typing.get_args(Method))
    assert set(METHODS) == set(ROUNDING) == names == set(typing.get_args(PlanMethod))
    union = typing.get_args(typing.get_args(Group)[0])
    assert {c.model_fields["method"].annotation.__args__[0] for c in union} == names
    for name, cls in METHODS.items():
        assert typing.get_args(cls.model_fields["method"].annotation) == (name,)
        assert cls.model_fields["options"].default_factory().method == name
        assert set(ROUNDING[name].cost) == {"cpu", "cuda"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_resolved_recipe_reads_back_to_the_same_hash(path):
    """The resolved recipe (what an artifact stores) is itself a valid recipe with the same
    hash: every group's options keep the one flat shape, null where they do not apply."""
    from pipeline.recipe.groups import FLAT_KEYS

    r = load_recipe(path)
    resolved = r.resolved()
    for g in resolved["groups"]:
        assert tuple(g["options"])[: len(FLAT_KEYS)] == FLAT_KEYS
    assert parse_recipe(resolved).hash() == r.hash()


def test_group_errors_name_the_yaml_field_not_the_union_tag():
    base = load_recipe(ROOT / "recipes" / "gptq-w4.yaml").model_dump(mode="json")
    bad = json.loads(json.dumps(base))
    bad["groups"][0]["method"] = "gptqq"
    with pytest.raises(RecipeError, match=r"field `groups\[0\]\.method`: Input should be 'awq'"):
        parse_recipe(bad)
    bad = json.loads(json.dumps(base))
    bad["groups"][0]["options"]["dampening_fra"] = 0.1
    with pytest.raises(RecipeError, match=r"groups\[0\]\.options\.dampening_fra`: unknown key "
                       r"\(did you mean `dampening_frac`\?\)"):  # fmt: skip
        parse_recipe(bad)
    bad = json.loads(json.dumps(base))
    del bad["groups"][1]["method"]
    with pytest.raises(RecipeError, match=r"field `groups\[1\]\.method`: Field required"):
        parse_recipe(bad)


def test_the_estimate_times_each_method_by_its_table_row(monkeypatch):
    """The estimate's quantize time reads each method's cost from the table alone."""
    from transformers import AutoConfig

    from pipeline.quantize import methods
    from pipeline.quantize.estimate import estimate
    from pipeline.quantize.plan import plan_for_config

    r = load_recipe(ROOT / "recipes" / "rtn-w4.yaml")
    config = AutoConfig.from_pretrained(ROOT / "tests/fixtures/models/tiny-llama")
    plan = plan_for_config(config, r)
    before = estimate(plan, config, r, "cpu").quantize_s
    row = methods.ROUNDING["rtn"]
    monkeypatch.setitem(methods.ROUNDING, "rtn", methods.Rounding(cost={"cpu": 2 * row.cost["cpu"],
                                                                         "cuda": 0.0}))  # fmt: skip
    after = estimate(plan, config, r, "cpu").quantize_s
    assert before > 1 and abs(after - 2 * before) <= 0.15  # each rounded to 0.1 s
