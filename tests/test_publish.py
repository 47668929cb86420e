"""`qship publish`: only gated + verified artifacts; atomic local registry; Hub upload_folder."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import FAILING_GATES, gated
from factories import ec_keypair, recipe, reseal

from pipeline.artifact.package import package
from pipeline.artifact.publish import publish
from pipeline.cli import main
from pipeline.errors import GateFailed, IntegrityError, UsageError


def registry_state(reg: Path) -> list[str]:
    if not reg.exists():
        return []
    return sorted(p.relative_to(reg).as_posix() for p in reg.rglob("*") if p.name != ".lock")


def cli(args: list[str], capsys) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main([*args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def failed_artifact(tmp_path_factory, package_inputs) -> Path:
    out = tmp_path_factory.mktemp("failed") / "failed-art"
    verdict = gated(package_inputs["evaluation"], FAILING_GATES)
    assert not verdict.passed
    package(out=out, **{**package_inputs, "verdict": verdict})
    return out


def test_local_registry_publish_idempotent_and_no_overwrite(packaged_artifact, tmp_path, capsys):
    reg = tmp_path / "registry"
    rc, out = cli(["publish", str(packaged_artifact), "--to", f"file://{reg}"], capsys)
    assert rc == 0 and out["status"] == "published"
    name, version = out["name"], out["version"]
    assert name == "tiny-llama-w4a16-rtn" and version.startswith("sha-")
    dest = reg / name / version
    assert main(["verify", str(dest)]) == 0
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        p.name for p in packaged_artifact.iterdir()
    )
    index = json.loads((reg / "index.json").read_text())
    entry = index["models"][name][version]
    assert index["format"] == "qship-registry-v1"
    assert entry["verdict_passed"] is True and entry["recipe"]["name"] == "w4a16-rtn"
    assert (
        entry["sha256sums"]
        == hashlib.sha256((packaged_artifact / "SHA256SUMS").read_bytes()).hexdigest()
    )
    assert "recipe w4a16-rtn" in out["commit_message"] and "gate PASSED" in out["commit_message"]

    # same content again: idempotent
    rc, out2 = cli(["publish", str(packaged_artifact), "--to", f"file://{reg}"], capsys)
    assert rc == 0 and out2["status"] == "unchanged"

    # a different artifact under an existing version: refused, registry untouched
    other = tmp_path / "other"
    shutil.copytree(packaged_artifact, other)
    card = (other / "README.md").read_text()
    (other / "README.md").write_text(card + "\nA different card.\n")
    reseal(other, "README.md")  # a valid artifact: its provenance records this card
    before = registry_state(reg)
    rc, err = cli(
        ["publish", str(other), "--to", f"file://{reg}", "--version", version, "--name", name],
        capsys,
    )
    assert rc == 2 and str(dest) == err["path"] and "already in the registry" in err["message"]
    assert registry_state(reg) == before

    # ... but as a new version it goes in, and the index lists both
    rc, out3 = cli(["publish", str(other), "--to", f"file://{reg}", "--name", name], capsys)
    assert rc == 0 and out3["version"] != version
    index = json.loads((reg / "index.json").read_text())
    assert sorted(index["models"][name]) == sorted([version, out3["version"]])
    assert not [p for p in reg.rglob("*") if ".partial-" in p.name or p.name.endswith(".tmp")]


def test_publish_refuses_failed_gate(failed_artifact, tmp_path, capsys):
    assert main(["verify", str(failed_artifact)]) == 0  # intact, but the gate failed
    reg = tmp_path / "registry"
    rc, err = cli(["publish", str(failed_artifact), "--to", f"file://{reg}"], capsys)
    assert rc == 4 and err["path"].endswith("eval.json") and "top1_min" in err["message"]
    assert registry_state(reg) == []
    with pytest.raises(GateFailed):
        publish(failed_artifact, "hf://org/name", endpoint="http://127.0.0.1:9")


def test_publish_refuses_tampered_artifact(packaged_artifact, tmp_path, capsys):
    art = tmp_path / "art"
    shutil.copytree(packaged_artifact, art)
    shard = sorted(art.glob("model-00002-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x80
    shard.write_bytes(bytes(data))
    reg = tmp_path / "registry"
    rc, err = cli(["publish", str(art), "--to", f"file://{reg}"], capsys)
    assert rc == 3 and shard.name in err["path"]
    assert registry_state(reg) == []
    # tampering with the verdict itself is an integrity failure, not a pass
    art2 = tmp_path / "art2"
    shutil.copytree(packaged_artifact, art2)
    ev = json.loads((art2 / "eval.json").read_text())
    ev["verdict"]["passed"] = True
    ev["metrics"]["kl"]["mean"] = 0.0
    (art2 / "eval.json").write_text(json.dumps(ev))
    with pytest.raises(IntegrityError) as e:
        publish(art2, f"file://{reg}")
    assert "eval.json" in e.value.path
    assert registry_state(reg) == []


def test_publish_require_signature(packaged_artifact, tmp_path):
    priv_a, pub_a = ec_keypair(tmp_path, "a")
    priv_b, _ = ec_keypair(tmp_path, "b")
    reg = tmp_path / "registry"
    with pytest.raises(IntegrityError, match="unsigned"):
        publish(packaged_artifact, f"file://{reg}", require_signature=True, pubkey=pub_a)
    art = tmp_path / "art"
    shutil.copytree(packaged_artifact, art)
    from pipeline.artifact import attestation
    from pipeline.artifact.signing import sign_artifact as sign

    def sign_artifact(art: Path, key: Path) -> None:  # as `qship package --sign-key` does
        attestation.sign(art, attestation.SigningKey(key))
        sign(art, key)

    sign_artifact(art, priv_b)  # signed, but by another key
    with pytest.raises(IntegrityError, match="signature verification failed"):
        publish(art, f"file://{reg}", require_signature=True, pubkey=pub_a)
    assert registry_state(reg) == []
    sign_artifact(art, priv_a)
    res = publish(art, f"file://{reg}", require_signature=True, pubkey=pub_a)
    assert (Path(res.location) / "model.sig").is_file()
    assert (Path(res.location) / "attestation" / "results.sigstore.json").is_file()
    idx = json.loads((reg / "index.json").read_text())
    assert idx["models"][res.name][res.version]["signed"] is True


@pytest.mark.parametrize("target", ["s3://bucket/x", "file://relative/path", "hf://only-org"])
def test_bad_targets(packaged_artifact, target):
    with pytest.raises(UsageError):
        publish(packaged_artifact, target)


# ------------------------------------------------------------------ Hub, against a fake server


class FakeHub(BaseHTTPRequestHandler):
    calls: list = []
    commits: list = []

    def log_message(self, *a):  # keep test output clean
        pass

    def _json(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        FakeHub.calls.append(("POST", path))
        host = f"http://{self.server.server_address[0]}:{self.server.server_address[1]}"
        if path == "/api/validate-yaml":
            return self._json(200, {"errors": [], "warnings": []})
        if path == "/api/repos/create":
            req = json.loads(body)
            return self._json(200, {"url": f"{host}/{req.get('organization')}/{req['name']}"})
        parts = path.split("/")
        if path.startswith("/api/models/") and parts[5] == "preupload":
            files = json.loads(body)["files"]
            return self._json(
                200,
                {
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                        for f in files
                    ]
                },
            )
        if path.startswith("/api/models/") and parts[5] == "commit":
            lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
            FakeHub.commits.append({"repo": f"{parts[3]}/{parts[4]}", "lines": lines})
            return self._json(
                200,
                {"commitUrl": f"{host}/{parts[3]}/{parts[4]}/commit/abc", "commitOid": "a" * 40},
            )
        return self._json(404, {"error": f"unexpected {path}"})

    def do_GET(self):
        FakeHub.calls.append(("GET", self.path))
        return self._json(404, {"error": "not here"})


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub.constants as C

    monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
    FakeHub.calls, FakeHub.commits = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_hub_publish_upload_folder(packaged_artifact, fake_hub):
    res = publish(packaged_artifact, "hf://qship-org/tiny-w4", endpoint=fake_hub, token="hf_test")
    assert res.status == "published" and res.commit_url.endswith("/commit/abc")
    assert len(FakeHub.commits) == 1
    commit = FakeHub.commits[0]
    assert commit["repo"] == "qship-org/tiny-w4"
    header = commit["lines"][0]
    assert header["key"] == "header"
    summary = header["value"]["summary"]
    assert "recipe w4a16-rtn" in summary and "gate PASSED" in summary and "2/2 checks" in summary
    files = {
        x["value"]["path"]: base64.b64decode(x["value"]["content"])
        for x in commit["lines"]
        if x["key"] == "file"
    }
    shipped = [p.relative_to(packaged_artifact).as_posix()
               for p in packaged_artifact.rglob("*") if p.is_file()]  # fmt: skip
    assert sorted(files) == sorted(shipped) and "attestation/provenance.json" in files
    for name, content in files.items():
        assert content == (packaged_artifact / name).read_bytes(), name
    assert ("POST", "/api/repos/create") in FakeHub.calls


def test_hub_publish_refused_before_any_request(packaged_artifact, tmp_path, fake_hub):
    art = tmp_path / "art"
    shutil.copytree(packaged_artifact, art)
    (art / "extra.bin").write_bytes(b"\0" * 10)
    with pytest.raises(IntegrityError, match="extra.bin"):
        publish(art, "hf://qship-org/tiny-w4", endpoint=fake_hub, token="hf_test")
    assert FakeHub.calls == [] and FakeHub.commits == []


def test_run_publish_outage_exits_5_and_the_same_command_then_publishes(
    tiny_llama, tmp_path, capsys, monkeypatch, fake_hub
):
    """A Hub outage during `qship run --publish-to` exits 5 naming the host; the artifact
    stays, and the same command again verifies and publishes it without recomputing.
    The same --out with another recipe is still refused (exit 2)."""
    import huggingface_hub.constants as C

    monkeypatch.setenv("QSHIP_NET_RETRIES", "2")
    monkeypatch.setenv("QSHIP_NET_BACKOFF", "0.01")
    monkeypatch.setattr(C, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    out = tmp_path / "art"
    args = ["run", "--model", str(tiny_llama), "--recipe", str(recipe(tmp_path, "pub-rtn")),
            "--out", str(out), "--device", "cpu", "--cache-dir", str(tmp_path / "cache"),
            "--publish-to", "hf://qship-org/tiny"]  # fmt: skip
    rc, err = cli(args, capsys)
    assert rc == 5, err
    assert "127.0.0.1:9" in err["message"] and "without recomputing" in err["hint"]
    assert (out / "SHA256SUMS").is_file()
    import stat

    report = out.with_name("art.report")  # readable by the team (umask 022), not 0600
    assert {stat.S_IMODE(p.stat().st_mode) for p in report.iterdir()} == {0o644}
    monkeypatch.setattr(C, "ENDPOINT", fake_hub)
    rc, rec = cli(args, capsys)
    assert rc == 0, rec
    assert [s["stage"] for s in rec["stages"]] == ["recipe", "fetch", "verify", "publish"]
    assert rec["published"]["status"] == "published" and len(FakeHub.commits) == 1
    other = [*args[:4], str(recipe(tmp_path, "pub-rtn8", bits=8)), *args[5:]]
    rc, err = cli(other, capsys)
    assert rc == 2 and "another recipe" in err["message"]
