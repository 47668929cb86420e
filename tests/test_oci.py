"""Publish to and verify from a real OCI registry (docker-registry on 127.0.0.1): push,
pull by tag and by digest, a tampered blob in the registry's storage, refusals, outages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import registry

from pipeline.artifact import oci
from pipeline.cli import main


@pytest.fixture(scope="module")
def open_registry(tmp_path_factory):
    reg = registry.start(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory):
    reg = registry.start(tmp_path_factory.mktemp("auth-registry"), user="ci", password="s3cr3t-pw")
    yield reg
    reg.stop()


def cli(args: list[str], capsys) -> tuple[int, dict]:
    rc = main([*args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_push_pull_verify_and_tamper(open_registry, packaged_artifact, capsys, monkeypatch):
    monkeypatch.setenv("QSHIP_NET_BACKOFF", "0")
    target = f"oci://{open_registry.host}/qship/tiny:w4"
    rc, out = cli(["publish", str(packaged_artifact), "--to", target], capsys)
    assert rc == 0 and out["status"] == "published", out
    pinned = out["location"]
    digest = pinned.split("@")[1]
    # the same folder again: the same manifest digest, nothing pushed
    rc, again = cli(["publish", str(packaged_artifact), "--to", target], capsys)
    assert rc == 0 and again["status"] == "unchanged" and again["location"] == pinned
    # by tag: the digest it resolved is reported; by digest: the same checks
    rc, rep = cli(["verify", target], capsys)
    assert rc == 0 and rep["path"] == pinned and f"resolved to {digest}" in rep["checks"][0]
    rc, rep = cli(["verify", pinned], capsys)
    assert rc == 0 and any("in-toto statements" in c for c in rep["checks"])
    manifest, _ = oci.manifest_for(packaged_artifact)
    layers = {x["annotations"][oci.TITLE]: x for x in json.loads(manifest)["layers"]}
    assert layers["attestation/provenance.json"]["mediaType"] == "application/vnd.in-toto+json"
    assert layers["bom.cdx.json"]["mediaType"] == "application/vnd.cyclonedx+json"
    # a blob altered in the registry's storage: exit 3 naming the layer
    blob = open_registry.blob(layers["README.md"]["digest"])
    blob.write_bytes(blob.read_bytes() + b"\nextra claims\n")
    rc, err = cli(["verify", pinned], capsys)
    assert rc == 3 and err["path"].endswith("#README.md") and "altered" in err["hint"]


def test_a_missing_attestation_and_a_wrong_digest(packaged_artifact, tmp_path, capsys):
    """A manifest pushed without the statements (by hand: publish would refuse the folder):
    verify names what is missing; a digest the repository does not hold is refused."""
    reg = registry.start(tmp_path / "registry")  # its own storage: blobs are shared by repos
    try:
        art = Path(shutil.copytree(packaged_artifact, tmp_path / "art"))
        shutil.rmtree(art / "attestation")
        _, digest, _ = oci.push(art, f"oci://{reg.host}/qship/stripped:x")
        rc, err = cli(["verify", f"oci://{reg.host}/qship/stripped@{digest}"], capsys)
        assert rc == 3 and "attestation" in err["path"] and "missing" in err["message"], err
        other = "sha256:" + "0" * 64
        rc, err = cli(["verify", f"oci://{reg.host}/qship/stripped@{other}"], capsys)
        assert rc == 2 and "not in the registry" in err["message"]
    finally:
        reg.stop()


def test_auth_from_env_and_docker_config_never_logged(auth_registry, packaged_artifact, tmp_path,
                                                      capsys, monkeypatch):  # fmt: skip
    monkeypatch.setenv("QSHIP_NET_BACKOFF", "0")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker"))
    target = f"oci://{auth_registry.host}/qship/tiny:w4"
    rc, err = cli(["publish", str(packaged_artifact), "--to", target], capsys)
    assert rc == 2 and "HTTP 401" in err["message"] and "QSHIP_REGISTRY_USERNAME" in err["hint"]
    monkeypatch.setenv("QSHIP_REGISTRY_USERNAME", "ci")
    monkeypatch.setenv("QSHIP_REGISTRY_PASSWORD", "wrong")
    rc, err = cli(["publish", str(packaged_artifact), "--to", target], capsys)
    assert rc == 2
    monkeypatch.setenv("QSHIP_REGISTRY_PASSWORD", "s3cr3t-pw")
    rc, out = cli(["publish", str(packaged_artifact), "--to", target], capsys)
    assert rc == 0, out
    # the Docker config's auths, no environment
    monkeypatch.delenv("QSHIP_REGISTRY_USERNAME")
    monkeypatch.delenv("QSHIP_REGISTRY_PASSWORD")
    import base64

    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / "config.json").write_text(json.dumps(
        {"auths": {auth_registry.host: {"auth": base64.b64encode(b"ci:s3cr3t-pw").decode()}}}))  # fmt: skip
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    log_dir = tmp_path / "logs"
    rc = main(["verify", out["location"], "--json", "-v"])
    text = capsys.readouterr()
    assert rc == 0, text.out
    # the password is nowhere: not in what was printed, not in any file pulled or logged
    seen = text.out + text.err
    for p in [*packaged_artifact.rglob("*"), *log_dir.rglob("*")]:
        if p.is_file():
            seen += p.read_bytes().decode("latin-1")
    assert "s3cr3t-pw" not in seen and base64.b64encode(b"ci:s3cr3t-pw").decode() not in seen


def test_unreachable_is_exit_5_and_no_tag_is_exit_2(packaged_artifact, capsys, monkeypatch):
    monkeypatch.setenv("QSHIP_NET_BACKOFF", "0")
    monkeypatch.setenv("QSHIP_NET_RETRIES", "2")
    port = registry._free_port()  # nothing listens there
    rc, err = cli(["publish", str(packaged_artifact), "--to", f"oci://127.0.0.1:{port}/q/t:x"],
                  capsys)  # fmt: skip
    assert rc == 5 and "cannot connect" in err["message"] and "2 attempt" in err["message"]
    rc, err = cli(["publish", str(packaged_artifact), "--to", "oci://127.0.0.1:1/q/t"], capsys)
    assert rc == 2 and "tag or a digest" in err["message"]
    rc, err = cli(["verify", "oci://127.0.0.1:1/q/t"], capsys)
    assert rc == 2


def test_a_push_that_fails_midway_leaves_no_tag(open_registry, packaged_artifact, capsys,
                                               monkeypatch):  # fmt: skip
    """The registry goes away after some blobs (every later call refused): exit 5, and the
    tag does not exist; the same command then publishes."""
    import httpx

    monkeypatch.setenv("QSHIP_NET_BACKOFF", "0")
    monkeypatch.setenv("QSHIP_NET_RETRIES", "2")
    real = httpx.Client.request
    calls = {"n": 0}

    def flaky(self, method, url, *a, **kw):
        calls["n"] += 1
        if calls["n"] > 12:
            raise httpx.ConnectError("connection refused")
        return real(self, method, url, *a, **kw)

    monkeypatch.setattr(httpx.Client, "request", flaky)
    target = f"oci://{open_registry.host}/qship/half:w4"
    rc, err = cli(["publish", str(packaged_artifact), "--to", target], capsys)
    assert rc == 5 and "nothing was tagged" in err["hint"]
    monkeypatch.setattr(httpx.Client, "request", real)
    url = f"http://{open_registry.host}/v2/qship/half/manifests/w4"
    assert httpx.get(url, headers={"Accept": oci.MANIFEST_TYPE}).status_code == 404
    rc, out = cli(["publish", str(packaged_artifact), "--to", target], capsys)
    assert rc == 0 and out["status"] == "published"


def test_modelcar_image(open_registry, packaged_artifact, tmp_path, capsys):
    """--as modelcar: one tar layer with every file under models/, reproducible; verify
    pulls it, unpacks it and runs every check."""
    import tarfile

    target = f"oci://{open_registry.host}/qship/modelcar:w4"
    rc, out = cli(["publish", str(packaged_artifact), "--to", target, "--as", "modelcar"], capsys)
    assert rc == 0 and out["status"] == "published", out
    rc, again = cli(["publish", str(packaged_artifact), "--to", target, "--as", "modelcar"],
                    capsys)  # fmt: skip
    assert again["status"] == "unchanged" and again["location"] == out["location"]
    rc, rep = cli(["verify", out["location"]], capsys)
    assert rc == 0 and any("in-toto statements" in c for c in rep["checks"]), rep
    from pipeline.artifact import modelcar

    body, blobs = modelcar.image(packaged_artifact, oci.shipped(packaged_artifact), tmp_path,
                                 oci.MANIFEST_TYPE)  # fmt: skip
    layer = json.loads(body)["layers"][0]
    with tarfile.open(blobs[layer["digest"]]) as tar:
        names = tar.getnames()
        assert all(m.mtime == 0 and m.uid == 0 for m in tar.getmembers())
    assert "models/config.json" in names and "models/attestation/provenance.json" in names
