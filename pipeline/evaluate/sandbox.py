"""Model-written code is untrusted input: each program runs alone in a locked-down process.

Code execution is opt-in, as in lm-eval: recipe `evaluation.code_execution: sandboxed` (or
`HF_ALLOW_CODE_EVAL=1`); otherwise a code task is refused before any work (exit 2 naming
the flag). Each program then runs as follows (`Sandbox.run`):

- its own network namespace and PID namespace (util-linux `unshare --net --pid --fork
  --kill-child`): no interface but a down loopback, so no connection anywhere, 127.0.0.1
  included; when the program (or the wall timeout) ends, the kernel kills every process it
  left behind;
- as the unprivileged user `nobody` (`setpriv`, no supplementary groups, no capabilities,
  no-new-privs): files outside its folder are protected by their permissions;
- its own empty temporary folder as cwd, HOME and TMPDIR (removed after), a clean
  environment (PATH and LANG only: nothing inherited, no secrets), no inherited file
  descriptors, stdin closed, `python -I` (no site or user paths, no PYTHON* variables);
- limits set in the child before exec (resource.setrlimit): CPU seconds, address space,
  file size, processes, open files, no core files; a wall timeout kills the whole
  process group.

Where the OS gives no namespaces (not root, or a container that forbids unshare) the run
is refused unless the recipe accepts it explicitly (`code_execution:
sandboxed-no-netns`): then only the limits, the folder, the environment and (as root) the
user change apply. eval.json records which isolation ran (`TaskResult.isolation`).

Programs run one at a time: the process limit is per user, so a fork bomb running beside
an honest program could make that one fail to start.
"""

from __future__ import annotations

import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError

MODES = ("off", "sandboxed", "sandboxed-no-netns")
OPT_IN_ENV = "HF_ALLOW_CODE_EVAL"
SANDBOX_USER = "nobody"
PYTHON = sys.executable  # the interpreter programs run with (stdlib only: `-I`)


@dataclass(frozen=True)
class Limits:
    # code_eval allows 3 s; the tests take milliseconds, so a completion that loops costs
    # at most this much per item
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_bytes: int = 1 << 30  # address space: a 10 GB allocation fails
    file_bytes: int = 16 << 20
    processes: int = 64  # per user: a fork bomb stops here (and dies with the namespace)
    open_files: int = 64


@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: str  # passed | failed | timeout
    returncode: int | None
    output: str  # the tail of stdout + stderr


def _limits_in_child(limits: Limits) -> None:
    """preexec: runs in the child between fork and exec (as root: the limits bind after the
    user change, which keeps them)."""
    for what, value in (
        (resource.RLIMIT_CPU, limits.cpu_s),
        (resource.RLIMIT_AS, limits.memory_bytes),
        (resource.RLIMIT_FSIZE, limits.file_bytes),
        (resource.RLIMIT_NPROC, limits.processes),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(what, (value, value))


@dataclass(frozen=True)
class Sandbox:
    """How programs run here; `isolation` says so in words (recorded in eval.json)."""

    namespaces: bool
    uid: int | None  # the unprivileged user programs run as (None: not root)
    limits: Limits = field(default_factory=Limits)
    python: str = field(default_factory=lambda: PYTHON)

    @property
    def isolation(self) -> str:
        parts = ["network+pid namespaces" if self.namespaces else "NO network namespace"]
        parts.append(f"uid {self.uid}" if self.uid is not None else "the caller's uid")
        lim = self.limits
        parts.append(f"rlimits cpu {lim.cpu_s}s, as {lim.memory_bytes >> 20} MiB, "
                     f"fsize {lim.file_bytes >> 20} MiB, nproc {lim.processes}; "
                     f"wall {lim.wall_s:g}s; clean env, own temp dir")  # fmt: skip
        return ", ".join(parts)

    def _command(self, program: Path) -> list[str]:
        cmd = [self.python, "-I", str(program)]
        if self.uid is not None:
            cmd = ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                   "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", *cmd]  # fmt: skip
        if self.namespaces:
            cmd = ["unshare", "--net", "--pid", "--fork", "--kill-child", *cmd]
        return cmd

    def run(self, source: str) -> Outcome:
        """Run `source` as a Python program; passed = it exits 0 within the limits."""
        work = Path(tempfile.mkdtemp(prefix="qship-sandbox-"))
        try:
            program, log = work / "program.py", work / "output.txt"
            program.write_text(source, encoding="utf-8")
            log.touch()
            if self.uid is not None:
                for p in (work, program, log):
                    os.chown(p, self.uid, self.uid)
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work),
                   "TMPDIR": str(work)}  # fmt: skip
            with open(log, "wb") as out:
                proc = subprocess.Popen(  # noqa: S603 - the point: a locked-down child
                    self._command(program), cwd=work, env=env, stdin=subprocess.DEVNULL,
                    stdout=out, stderr=subprocess.STDOUT, close_fds=True,
                    start_new_session=True, preexec_fn=lambda: _limits_in_child(self.limits),
                )  # fmt: skip
                try:
                    rc: int | None = proc.wait(timeout=self.limits.wall_s)
                except subprocess.TimeoutExpired:
                    rc = None
                _kill_group(proc)
            tail = log.read_bytes()[-2000:].decode("utf-8", "replace")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        status = "timeout" if rc is None else ("passed" if rc == 0 else "failed")
        return Outcome(passed=rc == 0, status=status, returncode=rc, output=tail)


def _kill_group(proc: subprocess.Popen) -> None:
    """The whole process group, whatever it left behind (with namespaces the kernel has
    killed the rest already when its first process ended)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _sandbox_uid() -> int | None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return None
    return pwd.getpwnam(SANDBOX_USER).pw_uid


PROBE = "import socket\nsocket.socket()\n"


def _namespaces_work(uid: int | None) -> bool:
    """Whether this OS lets qship give a program its own network and PID namespaces."""
    if shutil.which("unshare") is None:
        return False
    return Sandbox(namespaces=True, uid=uid, limits=Limits(wall_s=30.0)).run(PROBE).passed


def _check_starts(box: Sandbox, *, where: str) -> None:
    """A sandbox that cannot start Python would score every program 0: exit 2 instead."""
    out = box.run(PROBE)
    if not out.passed:
        raise UsageError(
            f"the code sandbox cannot run Python ({box.isolation}): {out.output[-300:]}",
            path=where,
            hint=f"the user {SANDBOX_USER} must be able to execute {box.python} and read "
            "its standard library",
        )


def code_execution_mode(recipe_mode: str) -> str:
    """The recipe's mode, or `sandboxed` when HF_ALLOW_CODE_EVAL=1 opts in as for lm-eval."""
    if recipe_mode == "off" and os.environ.get(OPT_IN_ENV) == "1":
        return "sandboxed"
    return recipe_mode


def require_code_execution(recipe_mode: str, code_tasks: list[str], *, where: str) -> None:
    """Exit 2 before any work when code tasks are asked for without the opt-in."""
    if code_tasks and code_execution_mode(recipe_mode) == "off":
        raise UsageError(
            f"evaluation.tasks {code_tasks} run model-written code, and code execution is "
            "off (evaluation.code_execution: off)",
            path=where,
            hint="opt in with evaluation.code_execution: sandboxed in the recipe (or "
            f"{OPT_IN_ENV}=1, as for lm-eval); each program then runs in qship's sandbox "
            "(docs/GENERATIVE.md)",
        )


def sandbox_for(recipe_mode: str, *, where: str, limits: Limits | None = None) -> Sandbox:
    """The sandbox the recipe allows here, or exit 2 when it needs isolation the OS lacks."""
    mode = code_execution_mode(recipe_mode)
    require_code_execution(recipe_mode, ["code"], where=where)
    uid = _sandbox_uid()
    box = Sandbox(namespaces=_namespaces_work(uid), uid=uid, limits=limits or Limits())
    if not box.namespaces and mode != "sandboxed-no-netns":
        raise UsageError(
            "evaluation.code_execution: sandboxed needs a new network namespace for each "
            "program, and this OS does not allow one (`unshare --net --pid` failed: run as "
            "root, or a container that permits unshare)",
            path=where,
            hint="run where namespaces work, or accept running model code with network "
            "access: evaluation.code_execution: sandboxed-no-netns (eval.json records it)",
        )
    _check_starts(box, where=where)
    return box
