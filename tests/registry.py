"""A real OCI distribution registry for the tests: Debian's `docker-registry` (the CNCF
distribution registry v2; .ci/run installs it) on a free 127.0.0.1 port, its storage in a
temporary folder, optionally behind htpasswd basic auth (`htpasswd -Bbn`, apache2-utils)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


@dataclass
class LocalRegistry:
    host: str
    root: Path
    log: Path
    process: subprocess.Popen

    def blob(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (to tamper with them)."""
        hexd = digest.removeprefix("sha256:")
        return self.root / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(work: Path, *, user: str | None = None, password: str | None = None) -> LocalRegistry:
    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.fail("docker-registry is not installed: `apt-get install -y docker-registry` "
                    "(.ci/run does it); the OCI tests need a real registry")  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    auth = ""
    if user is not None:
        htpasswd = shutil.which("htpasswd")
        if htpasswd is None:
            pytest.fail("htpasswd is not installed: `apt-get install -y apache2-utils` (.ci/run)")
        line = subprocess.run([htpasswd, "-Bbn", user, str(password)], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        (work / "htpasswd").write_text(line + "\n")
        auth = f"auth:\n  htpasswd:\n    realm: qship-test\n    path: {work / 'htpasswd'}\n"
    (work / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {work / 'storage'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n{auth}"
    )
    log = work / "registry.log"
    proc = subprocess.Popen([binary, "serve", str(work / "config.yml")],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
    reg = LocalRegistry(f"127.0.0.1:{port}", work / "storage", log, proc)
    for _ in range(100):
        try:
            if httpx.get(f"http://{reg.host}/v2/", timeout=1).status_code in (200, 401):
                return reg
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    reg.stop()
    pytest.fail(f"docker-registry did not answer on {reg.host}: {log.read_text()[-2000:]}")
