"""A team's own tasks: pinned JSONL/CSV files of prompts and answers, read strictly, checked
for overlap with calibration, optionally in the chat template, and run on both models
with the paired report like every benchmark."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from factories import eval_report

from pipeline import gate
from pipeline.data import benchmarks as data
from pipeline.data import custom_tasks
from pipeline.data.tokens import TokenSets
from pipeline.errors import IntegrityError, RecipeError, UsageError
from pipeline.evaluate import benchmarks, custom_scoring, model_ref
from pipeline.recipe import EvaluationConfig, Gates, parse_recipe
from pipeline.records.tokens import TokenSetInfo, TokenStats

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "eval" / "tasks" / "units-and-dates.jsonl"
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}" \
       "{% if add_generation_prompt %}<|assistant|>{% endif %}"  # fmt: skip


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _task(path: Path, name: str = "mine", **kw) -> dict:
    return {"name": name, "path": str(path), "sha256": _sha(path), **kw}


def _ev(*tasks: dict, **kw) -> EvaluationConfig:
    return EvaluationConfig(custom_tasks=list(tasks), **kw)


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def _tokens(tok, calib_text: str) -> TokenSets:
    calib = torch.tensor([tok(calib_text)["input_ids"][:200]])
    held = torch.tensor(
        [tok("An unrelated held out sentence about the weather today.")["input_ids"]]
    )
    stats = TokenStats(documents=2, heldout_documents=["h"], calibration_documents=1,
                       calibration_documents_dropped=0, calibration_windows_available=1,
                       tokens_total=1)  # fmt: skip
    info = TokenSetInfo(calib_shape=tuple(calib.shape), heldout_shape=tuple(held.shape),
                        calib_hash="c", heldout_hash="h", corpus_hash="x", source="t",
                        stats=stats)  # fmt: skip
    return TokenSets(calib, held, info)


def test_the_shipped_example_reads_and_its_pin_holds(tok, tmp_path):
    ev = _ev(_task(EXAMPLE, "units_and_dates", match="number"))
    folder, items = custom_tasks.prepare(ev, tok, cache_dir=tmp_path, where="r.yaml")
    assert folder is not None
    rows = custom_tasks.load_rows(folder, "units_and_dates")
    assert len(rows) == len(items["units_and_dates"]) == 12
    assert {r["match"] for r in rows} == {"number", "regex", "exact", "contains"}
    assert rows[2]["tolerance"] == 0.05 and rows[0]["answer"] == 3500.0
    assert custom_tasks.manifest(folder)["units_and_dates"]["n"] == 12


def test_a_changed_file_is_exit_3_before_anything_is_read(tok, tmp_path):
    f = tmp_path / "t.jsonl"
    shutil.copy(EXAMPLE, f)
    ev = _ev(_task(f))
    f.write_text(f.read_text().replace("3500", "3501"))
    with pytest.raises(IntegrityError) as e:
        custom_tasks.prepare(ev, tok, cache_dir=tmp_path, where="r.yaml")
    assert (
        e.value.exit_code == 3
        and "sha256" in str(e.value)
        and ev.custom_tasks[0].sha256 in str(e.value)
    )
    assert not (tmp_path / custom_tasks.STAGE).exists()  # nothing written


BAD = [  # (file name, bytes, line, field)
    ("empty.jsonl", b"\n\n", None, None),
    ("noanswer.jsonl", b'{"prompt": "Q: 2+2?\\nA:", "answer": "4"}\n{"prompt": "Q: x"}\n', 2, "answer"),
    ("noprompt.csv", b"prompt,answer\nQ: 1+1?,2\n,3\n", 3, "prompt"),
    ("type.jsonl", b'{"prompt": 5, "answer": "4"}\n', 1, "prompt"),
    ("number.jsonl", b'{"prompt": "Q: km?", "answer": "five", "match": "number"}\n', 1, "answer"),
    ("text.jsonl", b'{"prompt": "Q: a?", "answer": 4}\n', 1, "answer"),
    ("regex.jsonl", b'{"prompt": "Q: a?", "answer": "(", "match": "regex"}\n', 1, "answer"),
    ("notjson.jsonl", b'{"prompt": "Q: a?", "answer": "b"}\n{oops\n', 2, "-"),
    ("latin1.jsonl", b'{"prompt": "Q: a?", "answer": "b"}\n{"prompt": "caf\xe9", "answer": "x"}\n', 2, "-"),
    ("match.jsonl", b'{"prompt": "Q: a?", "answer": "b", "match": "fuzzy"}\n', 1, "match"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "line", "field"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_task_file_is_exit_2_naming_file_line_and_field(
    tok, tmp_path, name, content, line, field
):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(UsageError) as e:
        custom_tasks.prepare(_ev(_task(f)), tok, cache_dir=tmp_path, where="r.yaml")
    msg = str(e.value)
    assert e.value.exit_code == 2 and str(f) in msg
    if line is not None:
        assert f"{f}:{line}: field {field!r}" in msg, msg


def test_choices_rows_need_choices_and_an_answer_among_them(tok, tmp_path):
    good = tmp_path / "mc.csv"
    good.write_text("prompt,answer,choices\nThe sky is,blue,blue|green\nGrass is,1,blue|green\n")
    folder, _ = custom_tasks.prepare(_ev(_task(good, match="choices")), tok, cache_dir=tmp_path,
                                     where="r")  # fmt: skip
    assert [r["label"] for r in custom_tasks.load_rows(folder, "mine")] == [0, 1]
    bad = tmp_path / "mc2.jsonl"
    bad.write_text('{"prompt": "a", "answer": "red", "choices": ["blue", "green"]}\n')
    with pytest.raises(UsageError, match=r"mc2.jsonl:1: field 'answer'"):
        custom_tasks.prepare(_ev(_task(bad, match="choices")), tok, cache_dir=tmp_path, where="r")


def test_the_scoring_rules():
    row = {"match": "number", "answer": 37.8, "tolerance": 0.05}
    assert custom_scoring.correct(row, " 37.8 degrees") and custom_scoring.correct(row, " 37.78")
    assert not custom_scoring.correct(row, " 38") and not custom_scoring.correct(row, " none")
    assert custom_scoring.correct({"match": "number", "answer": 3500, "tolerance": 0}, " 3,500 m")
    assert custom_scoring.correct({"match": "exact", "answer": "1976-07-04"}, " 1976-07-04 ")
    assert not custom_scoring.correct({"match": "exact", "answer": "1976-07-04"}, " 1976-7-4")
    rx = {"match": "regex", "answer": r"^\s*90\s*(km/h|kilometres per hour)"}
    assert custom_scoring.correct(rx, " 90 km/h") and not custom_scoring.correct(rx, " 9 km/h")
    assert custom_scoring.correct(
        {"match": "contains", "answer": "Saturday"}, " it was a saturday."
    )


def test_overlap_with_the_calibration_text_is_exit_2(tok, tmp_path):
    prompt = ("Q: the quarterly report lists every shipment that left the northern warehouse "
              "between March and May together with its weight in kilograms. How many were there?\nA:")  # fmt: skip
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"prompt": prompt, "answer": 7, "match": "number"}) + "\n")
    ev = _ev(_task(f), max_overlap=0.0)
    clean = data.prepare(ev, tok, _tokens(tok, "Completely different words " * 30),
                         cache_dir=tmp_path, checksums_dir=tmp_path, where="r.yaml")  # fmt: skip
    assert clean[1].sets["mine"].overlapping == 0 and clean[2] is not None
    with pytest.raises(UsageError) as e:
        data.prepare(ev, tok, _tokens(tok, "Some text. " + prompt + " More."), cache_dir=tmp_path,
                     checksums_dir=tmp_path, where="r.yaml")  # fmt: skip
    assert e.value.exit_code == 2 and "mine: 1/1 items" in str(e.value)


def test_the_chat_template_is_applied_when_the_task_asks(tok, tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "What is 2+2?", "answer": 4, "match": "number"}\n')
    with pytest.raises(UsageError, match="no chat template") as e:
        custom_tasks.prepare(_ev(_task(f, chat_template=True)), tok, cache_dir=tmp_path, where="r")
    assert "custom_tasks[0].chat_template" in str(e.value)
    chat_tok = type(tok).from_pretrained(tok.name_or_path)
    chat_tok.chat_template = "{{ bos_token }}" + CHAT
    plain, _ = custom_tasks.prepare(_ev(_task(f)), chat_tok, cache_dir=tmp_path, where="r")
    chat, _ = custom_tasks.prepare(_ev(_task(f, chat_template=True)), chat_tok,
                                   cache_dir=tmp_path, where="r")  # fmt: skip
    assert custom_tasks.load_rows(plain, "mine")[0]["prompt"] == "What is 2+2?"
    # the template's BOS is left to the tokenizer, which adds it when encoding
    assert (
        custom_tasks.load_rows(chat, "mine")[0]["prompt"] == "<|user|>What is 2+2?\n<|assistant|>"
    )
    assert plain != chat  # another cache entry, another reference key


def test_recipe_names_and_gates():
    base = {"name": "r", "groups": [{"name": "g", "roles": ["mlp"], "method": "rtn",
                                     "scheme": {"preset": "W4A16"}}]}  # fmt: skip
    t = {"name": "units", "path": "eval/tasks/units-and-dates.jsonl", "sha256": "0" * 64}
    r = parse_recipe({**base, "evaluation": {"custom_tasks": [t]},
                      "gates": {"tasks": {"units": {"max_drop": 5}}}})  # fmt: skip
    assert r.gates.tasks["units"].max_drop == 5
    with pytest.raises(RecipeError, match="used twice"):
        parse_recipe({**base, "evaluation": {"tasks": ["units"], "custom_tasks": [t]}})
    with pytest.raises(RecipeError, match="sha256"):
        parse_recipe({**base, "evaluation": {"custom_tasks": [{**t, "sha256": "abc"}]}})
    with pytest.raises(UsageError, match="built-in task"):
        data.check_task_names([], [], where="r", custom=("hellaswag",))


def test_a_tiny_model_end_to_end_paired_cached_and_gated(tok, tiny_llama, tiny_quantized_dir,
                                                         tmp_path):  # fmt: skip
    """A generated-answer task (3 rows of the example), a multiple-choice one and an lm-eval
    YAML task through lm-eval on both models, paired; the second comparison takes the reference from the
    cache; gates.tasks bounds each."""
    gen = tmp_path / "gen.jsonl"
    gen.write_text("".join(EXAMPLE.read_text().splitlines(keepends=True)[:3]))
    mc = tmp_path / "mc.csv"
    mc.write_text(
        "prompt,answer,choices\nThe cat sat on the,mat,mat|sky\nOne two,three,three|blue\n"
    )
    ev = _ev(
        _task(gen, "units", max_new_tokens=8),
        _task(mc, "pick", match="choices"),
        _yaml_task(tmp_path),
    )
    folder, _ = custom_tasks.prepare(ev, tok, cache_dir=tmp_path, where="r")
    kw = dict(tasks=[], hub_tasks=[], data_dir=None, limit=None, cache_dir=tmp_path,
              device="cpu", custom_dir=folder)  # fmt: skip
    first = benchmarks.compare(model_ref(tiny_llama), tiny_quantized_dir, **kw)
    units, pick = first.tasks["units"], first.tasks["pick"]
    assert units.status == "ok" and pick.status == "ok", (units.reason, pick.reason)
    assert units.n == units.n_total == 3 and units.metric == "correct (exact)"
    assert pick.n == 2 and pick.metric == "acc" and pick.ci95_pp is not None
    assert units.data.startswith("custom: ") and _sha(gen)[:12] in units.data
    capitals = first.tasks["capitals"]  # an lm-eval YAML: its own metric, per item
    assert capitals.status == "ok" and capitals.n == capitals.n_total == 2, capitals.reason
    assert capitals.metric in ("acc", "acc_norm")
    report = eval_report(tasks={n: t.model_dump(mode="json") for n, t in first.tasks.items()})
    verdict = gate.check(report, Gates(tasks={"units": {"max_drop": 100.0},
                                              "pick": {"max_drop": -100.0}}))  # fmt: skip
    assert [(c.name, c.passed) for c in verdict.checks] == [
        ("tasks.pick.max_drop", False), ("tasks.units.max_drop", True)]  # fmt: skip
    again = benchmarks.compare(model_ref(tiny_llama), tiny_quantized_dir, **kw)
    assert all(t.reference_cached for t in again.tasks.values())
    assert again.tasks["units"].candidate == units.candidate


YAML_TASK = """task: whatever
dataset_path: json
dataset_kwargs: {data_files: {test: capitals.jsonl}}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: What is the capital of {{country}}?\\nA:"
doc_to_choice: "{{options}}"
doc_to_target: "{{gold}}"
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
"""
CAPITALS = ('{"country": "France", "options": ["Paris", "Rome"], "gold": 0}\n'
            '{"country": "Italy", "options": ["Paris", "Rome"], "gold": 1}\n')  # fmt: skip


def _yaml_task(tmp_path: Path, yaml_text: str = YAML_TASK) -> dict:
    (tmp_path / "capitals.yaml").write_text(yaml_text)
    (tmp_path / "capitals.jsonl").write_text(CAPITALS)
    return _task(tmp_path / "capitals.yaml", "capitals",
                 data={"capitals.jsonl": _sha(tmp_path / "capitals.jsonl")})  # fmt: skip


def test_an_lm_eval_yaml_task_runs_as_written_on_its_pinned_data(tok, tmp_path):
    from lm_eval.tasks import TaskManager

    ev = _ev(_yaml_task(tmp_path))
    folder, items = custom_tasks.prepare(ev, tok, cache_dir=tmp_path / "c", where="r")
    assert items["capitals"][0] == ["France", "Paris", "Rome"]  # the overlap check sees it
    tdir = custom_tasks.task_dir(folder, tmp_path / "tasks")
    name = custom_tasks.lm_eval_name("capitals")
    task = TaskManager(include_path=str(tdir)).load_task_or_group([name])[name]
    doc = next(iter(task.test_docs()))
    assert task.doc_to_text(doc) == "Q: What is the capital of France?\nA:"
    # it reads the pinned copy in the cache, not the file beside the YAML
    (tmp_path / "capitals.jsonl").write_text("")
    assert len(list(task.test_docs())) == 2
    # a changed data file is exit 3
    with pytest.raises(IntegrityError, match="capitals.jsonl has sha256"):
        custom_tasks.prepare(ev, tok, cache_dir=tmp_path / "c", where="r")


@pytest.mark.parametrize(("change", "problem"), [
    (lambda y: "include: other.yaml\n" + y, "includes another YAML"),
    (lambda y: y.replace('"{{options}}"', "!function utils.choices"), "imports code"),
    (lambda y: y.replace("dataset_path: json", "dataset_path: some/hub_set"), "only local"),
    (lambda y: y.replace("capitals.jsonl", "other.jsonl"), "not pinned"),
])  # fmt: skip
def test_a_yaml_task_that_reaches_outside_its_pinned_data_is_exit_2(tok, tmp_path, change, problem):
    ev = _ev(_yaml_task(tmp_path, change(YAML_TASK)))
    with pytest.raises(UsageError, match=problem) as e:
        custom_tasks.prepare(ev, tok, cache_dir=tmp_path / "c", where="r")
    assert e.value.exit_code == 2 and "capitals.yaml" in str(e.value)


def test_a_yaml_task_pins_its_data_in_the_recipe():
    t = {"name": "c", "path": "eval/tasks/c.yaml", "sha256": "0" * 64}
    with pytest.raises(ValueError, match="data"):
        EvaluationConfig(custom_tasks=[t])
    with pytest.raises(ValueError, match="chat_template"):
        EvaluationConfig(custom_tasks=[{**t, "data": {"c.jsonl": "1" * 64}, "chat_template": True}])
