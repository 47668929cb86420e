"""A team's own tasks: JSONL or CSV files of prompts and expected answers, pinned.

Each `evaluation.custom_tasks` entry names a file (by convention under the project's
`eval/tasks/` folder) and its sha256. Before any compute the file is hashed (a mismatch
is exit 3), then read strictly: UTF-8, at least one row, every row a `prompt` (text) and
an `answer` of the right type for its `match` (exit 2 naming the file, the line and the
field). One row per line in JSONL; CSV has a header line (prompt, answer, and optionally
match, tolerance, choices -- choices separated by `|`).

The checked rows are written to the stage cache (`custom-tasks/<key>`, re-hashed on
reuse) with the prompt as the model sees it (in its chat template when the task asks),
and the benchmark child reads them through an lm-eval task written there
(`task_dir`): `generate_until` (greedy, the task's stops and max_new_tokens, metric
`bypass`: qship scores, evaluate/custom_scoring.py) or, for `match: choices`,
`multiple_choice` scored by lm-eval's `acc`.

An lm-eval task YAML (`path: eval/tasks/x.yaml`) runs as written -- its prompt, metric and
generation settings -- with its JSON/CSV data files pinned in the entry's `data` (paths
relative to the YAML's folder, as its `dataset_kwargs.data_files` names them) and copied
into the stage cache; it may not `include` another YAML or import code (`!function`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from ..errors import IntegrityError, UsageError
from ..io.cache import StageCache, stage_key
from ..io.hashing import hash_files, list_files
from ..io.pins import check_cached
from ..recipe import CustomTask, EvaluationConfig
from .chat import in_chat_template

STAGE = "custom-tasks"
MANIFEST = "tasks.json"
FORMAT = 1  # the layout of the written rows; part of the key
LM_EVAL_PREFIX = "qship_custom_"  # lm-eval's name for a custom task (no clash with its own)
GENERATED = ("exact", "regex", "number", "contains")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def lm_eval_name(task: str) -> str:
    return LM_EVAL_PREFIX + task


def first_number(text: str) -> float | None:
    """The first number in `text` (thousands commas ignored), or None."""
    m = _NUMBER.search(text.replace(",", ""))
    return float(m.group()) if m else None


def _bad(file: str, line: int, field: str, problem: str, hint: str) -> UsageError:
    return UsageError(f"{file}:{line}: field {field!r}: {problem}", path=file, hint=hint)


def _rows(path: Path, text: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, raw row) of a JSONL or CSV file."""
    where = str(path)
    if path.suffix == ".jsonl":
        out = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise _bad(where, i, "-", f"not JSON ({e.msg})", "one JSON object per line") from e
            if not isinstance(row, dict):
                raise _bad(where, i, "-", f"a {type(row).__name__}, not an object",
                           'write {"prompt": ..., "answer": ...} per line')  # fmt: skip
            out.append((i, row))
        return out
    if path.suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        rows = []
        for row in reader:
            if None in row:  # more cells than header fields
                raise _bad(where, reader.line_num, "-", "more cells than the header names",
                           "quote cells that contain commas")  # fmt: skip
            rows.append((reader.line_num, {k: v for k, v in row.items() if v not in (None, "")}))
        return rows
    raise UsageError(f"{where}: a custom task is a .jsonl or .csv file", path=where,
                     hint="rename the file or convert it")  # fmt: skip


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, str):
        try:
            x = float(v.replace(",", ""))
        except ValueError:
            return None
        return x if math.isfinite(x) else None
    return None


def check_row(task: CustomTask, file: str, line: int, row: dict[str, Any]) -> dict[str, Any]:
    """One row as scored: prompt, match, answer (text or number), tolerance, choices/label."""
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        got = "missing" if prompt is None else f"{type(prompt).__name__} {prompt!r:.40}"
        raise _bad(file, line, "prompt", f"needs non-empty text, got {got}",
                   "every row needs a prompt")  # fmt: skip
    match = row.get("match", task.match)
    if match not in (*GENERATED, "choices") or (match == "choices") != (task.match == "choices"):
        allowed = "choices" if task.match == "choices" else ", ".join(GENERATED)
        raise _bad(file, line, "match", f"{match!r} is not one of {allowed}",
                   "a multiple-choice task is a task of its own (match: choices)")  # fmt: skip
    if "answer" not in row:
        raise _bad(file, line, "answer", "missing", "every row needs its expected answer")
    answer = row["answer"]
    out: dict[str, Any] = {"prompt": prompt, "match": match}
    if match == "choices":
        choices = row.get("choices")
        if isinstance(choices, str):
            choices = [c.strip() for c in choices.split("|")]
        if (not isinstance(choices, list) or len(choices) < 2
                or not all(isinstance(c, str) and c for c in choices)):  # fmt: skip
            raise _bad(file, line, "choices", f"needs a list of at least 2 texts, got {choices!r:.60}",
                       'JSONL: "choices": ["a", "b"]; CSV: a|b')  # fmt: skip
        index = _number(answer)
        label = (choices.index(answer) if answer in choices
                 else int(index) if index is not None and index == int(index) else None)  # fmt: skip
        if label is None or not 0 <= label < len(choices):
            raise _bad(file, line, "answer", f"{answer!r} is neither one of the choices nor "
                       f"an index 0..{len(choices) - 1}", "give the right choice or its index")  # fmt: skip
        return {**out, "choices": choices, "label": label, "answer": choices[label]}
    if match == "number":
        value = _number(answer)
        if value is None:
            raise _bad(file, line, "answer", f"needs a finite number, got {answer!r:.40}",
                       "write the number alone (units go in the prompt)")  # fmt: skip
        tol = _number(row.get("tolerance", task.tolerance))
        if tol is None or tol < 0:
            raise _bad(file, line, "tolerance", f"needs a number >= 0, got "
                       f"{row.get('tolerance')!r:.40}", "the largest |answer - expected| accepted")  # fmt: skip
        return {**out, "answer": value, "tolerance": tol}
    if not isinstance(answer, str) or not answer.strip():
        raise _bad(file, line, "answer", f"needs non-empty text for match {match}, got "
                   f"{type(answer).__name__} {answer!r:.40}", 'quote it: "answer": "42 km"')  # fmt: skip
    if match == "regex":
        try:
            re.compile(answer)
        except re.error as e:
            raise _bad(file, line, "answer", f"not a valid regex ({e})", "escape it") from e
    return {**out, "answer": answer}


def read_task(task: CustomTask, path: Path) -> list[dict[str, Any]]:
    """The rows of a task file, checked (exit 2 naming file, line and field)."""
    where = str(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise _bad(where, line, "-", f"not UTF-8 (byte {raw[e.start]:#04x} at offset "
                   f"{e.start})", "save the file as UTF-8") from e  # fmt: skip
    rows = [check_row(task, where, n, r) for n, r in _rows(path, text.removeprefix("\ufeff"))]
    if not rows:
        raise UsageError(f"{where}: no rows", path=where,
                         hint="a task needs at least one prompt with its answer")  # fmt: skip
    return rows


def _pinned(task: str, path: Path, sha256: str, where: str) -> Path:
    """`path`, its bytes checked against the recipe's sha256 (exit 3 if not)."""
    if not path.is_file():
        raise UsageError(
            f"evaluation.custom_tasks.{task}: no file {path} (from {Path.cwd()})",
            path=where, hint="a relative path is read from the working directory (eval/tasks/...)",
        )  # fmt: skip
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise IntegrityError(
            f"evaluation.custom_tasks.{task}: {path} has sha256 {digest}, the recipe pins {sha256}",
            path=str(path),
            hint="if the file was changed on purpose, put its new `sha256sum` in the recipe",
        )
    return path


def resolve(task: CustomTask, where: str) -> Path:
    """The task's file, its bytes checked against the recipe's sha256 (exit 3 if not)."""
    return _pinned(task.name, Path(task.path), task.sha256, where)


def _files_named(data_files: Any) -> list[str]:
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, list):
        return [f for v in data_files for f in _files_named(v)]
    if isinstance(data_files, dict):
        return [f for v in data_files.values() for f in _files_named(v)]
    return []


def read_yaml_task(task: CustomTask, where: str) -> tuple[dict[str, Any], dict[str, Path]]:
    """An lm-eval task YAML and its data files, every one pinned (exit 3) and the YAML
    checked (exit 2): local JSON/CSV data only, all of it pinned, no include, no code."""
    from .generative import _AsData

    path = resolve(task, where)
    files = {name: _pinned(task.name, path.parent / name, sha, where)
             for name, sha in task.data.items()}  # fmt: skip
    try:
        cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=_AsData)  # noqa: S506
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not a YAML file ({e})", path=str(path)) from None
    problem = (
        "is not a mapping" if not isinstance(cfg, dict)
        else "includes another YAML (write the task out in full)" if "include" in cfg
        else "imports code (!function): a custom task is data" if "!function" in json.dumps(cfg)
        else f"dataset_path {cfg.get('dataset_path')!r}: only local json or csv data"
        if cfg.get("dataset_path") not in ("json", "csv")
        else None
    )  # fmt: skip
    named = _files_named((cfg.get("dataset_kwargs") or {}).get("data_files")) if not problem else []
    if not problem and (not named or set(named) - set(files)):
        problem = (f"dataset_kwargs.data_files names {sorted(set(named) - set(files)) or 'nothing'}"
                   f", not pinned in the recipe's data ({sorted(files)})")  # fmt: skip
    if problem:
        raise UsageError(f"{path}: {problem}", path=str(path),
                         hint="docs/CUSTOM-TASKS.md: an lm-eval task YAML")  # fmt: skip
    return cfg, files


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _texts(v)]
    if isinstance(value, list):
        return [s for v in value for s in _texts(v)]
    return []


def data_items(files: dict[str, Path]) -> list[list[str]]:
    """Every row of a YAML task's data files as its text fields (the overlap check)."""
    rows: list[list[str]] = []
    for path in files.values():
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".csv":
            rows += [_texts(r) for r in csv.DictReader(io.StringIO(text))]
        else:
            rows += [_texts(json.loads(line)) for line in text.splitlines() if line.strip()]
    return rows


def overlap_items(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The text fields of each row, for the n-gram overlap check."""
    return [[r["prompt"], str(r["answer"]), *r.get("choices", [])] for r in rows]


def prepare(
    ev: EvaluationConfig, tokenizer: Any, *, cache_dir: Path, where: str
) -> tuple[Path | None, dict[str, list[list[str]]]]:
    """Every custom task pinned and checked, written to the stage cache with its prompts
    as the model sees them. -> (its folder or None, {task: items for the overlap check})."""
    if not ev.custom_tasks:
        return None, {}
    rows_tasks = [t for t in ev.custom_tasks if not t.data]
    yaml_tasks = {t.name: read_yaml_task(t, where) for t in ev.custom_tasks if t.data}
    checked = {t.name: read_task(t, resolve(t, where)) for t in rows_tasks}
    items = {name: overlap_items(rows) for name, rows in checked.items()}
    items |= {name: data_items(files) for name, (_cfg, files) in yaml_tasks.items()}
    chat = any(t.chat_template for t in ev.custom_tasks)
    key = stage_key(STAGE, {
        "tasks": [t.model_dump(mode="json") for t in ev.custom_tasks], "format": FORMAT,
        "chat_template": getattr(tokenizer, "chat_template", None) if chat else None,
        "bos": tokenizer.bos_token if chat else None,
    }, versions=False)  # fmt: skip

    def build(tmp: Path) -> dict[str, Any]:
        manifest = {}
        for name, (cfg, pinned) in yaml_tasks.items():
            for rel, src in pinned.items():  # the pinned bytes, under the YAML's names
                (tmp / "data" / name / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, tmp / "data" / name / rel)
            (tmp / "data" / f"{name}.lmeval.json").write_text(json.dumps(cfg, indent=2))
            spec = next(t for t in ev.custom_tasks if t.name == name)
            manifest[name] = spec.model_dump(mode="json") | {"format": "yaml"}
        for i, t in enumerate(ev.custom_tasks):
            if t.data:
                continue
            rows = checked[t.name]
            if t.chat_template:
                at = f"evaluation.custom_tasks[{i}].chat_template"
                rows = [{**r, "prompt": in_chat_template(
                    tokenizer, [{"role": "user", "content": r["prompt"]}],
                    generation_prompt=True, where=at)} for r in rows]  # fmt: skip
            (tmp / "data").mkdir(exist_ok=True)
            with open(tmp / "data" / f"{t.name}.jsonl", "w", encoding="utf-8") as fh:
                for r in rows:
                    fh.write(json.dumps(r) + "\n")
            manifest[t.name] = t.model_dump(mode="json") | {"n": len(rows), "format": "rows"}
        (tmp / "data" / MANIFEST).write_text(json.dumps(manifest, indent=2))
        files = hash_files(tmp / "data", list_files(tmp / "data"))
        return {"files": {k: v.to_json() for k, v in files.items()}}

    entry = StageCache(Path(cache_dir)).get_or_build(STAGE, key, build, verify=False)
    check_cached(entry.path / "data", entry.record["files"], where=str(entry.path))
    return entry.path / "data", items


def manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """{task: its recipe entry and row count} of a prepared folder."""
    return json.loads((folder / MANIFEST).read_text())


def load_rows(folder: Path, task: str, limit: int | None = None) -> list[dict[str, Any]]:
    lines = (folder / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[: limit or len(lines)] if line]


def content_hash(folder: Path, task: str) -> str:
    """What the reference cache of a custom task is keyed by: its rows as the model sees
    them and how it generates."""
    spec = manifest(folder)[task]
    own = (
        [folder / f"{task}.lmeval.json"] if spec["format"] == "yaml" else [folder / f"{task}.jsonl"]
    )
    h = hashlib.sha256()
    for f in own:
        h.update(f.read_bytes())
    h.update(json.dumps(manifest(folder)[task], sort_keys=True).encode())
    return h.hexdigest()


def task_config(task: str, spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    """lm-eval's task definition for one custom task, its data the prepared rows (or, for
    an lm-eval YAML, its own definition with the data files' paths made absolute)."""
    if spec["format"] == "yaml":
        own: dict[str, Any] = json.loads((folder / f"{task}.lmeval.json").read_text())
        kwargs = dict(own.get("dataset_kwargs") or {})
        kwargs["data_files"] = _absolute(kwargs["data_files"], folder / task)
        return {**own, "task": lm_eval_name(task), "dataset_kwargs": kwargs}
    cfg: dict[str, Any] = {
        "task": lm_eval_name(task), "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(folder / f"{task}.jsonl")}},
        "test_split": "test", "doc_to_text": "{{prompt}}", "num_fewshot": 0,
    }  # fmt: skip
    if spec["match"] == "choices":
        return cfg | {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}",
                      "doc_to_target": "{{label}}",
                      "metric_list": [{"metric": "acc", "aggregation": "mean",
                                       "higher_is_better": True}]}  # fmt: skip
    return cfg | {
        "output_type": "generate_until", "doc_to_target": "",
        "generation_kwargs": {"until": spec["stop"], "max_gen_toks": spec["max_new_tokens"],
                              "do_sample": False},
        "metric_list": [{"metric": "bypass", "aggregation": "bypass", "higher_is_better": True}],
    }  # fmt: skip


def _absolute(data_files: Any, root: Path) -> Any:
    if isinstance(data_files, str):
        return str(root / data_files)
    if isinstance(data_files, list):
        return [_absolute(v, root) for v in data_files]
    return {k: _absolute(v, root) for k, v in data_files.items()}


def generated(spec: dict[str, Any]) -> bool:
    """Whether qship scores the task's completions (else lm-eval's own metric per item)."""
    return spec["format"] == "rows" and spec["match"] != "choices"


def task_dir(folder: Path, out: Path) -> Path:
    """lm-eval task YAMLs for every custom task of a prepared folder."""
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in manifest(folder).items():
        cfg = task_config(name, spec, folder)
        (out / f"{name}.yaml").write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML
    return out
