"""The artifact's in-toto statements (SLSA provenance v1 + qship's results), their DSSE
signatures with model-signing's key methods, and what `qship verify` does with them."""

from __future__ import annotations

import base64
import datetime
import json
import shutil
from pathlib import Path

import pytest
from factories import ec_keypair, resum

import pipeline.artifact.package as P
from pipeline.artifact import attestation as A
from pipeline.artifact.verify import verify
from pipeline.cli import main
from pipeline.errors import IntegrityError
from pipeline.io.hashing import parse_sha256sums, sha256_bytes


def copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "art"))


def cli_verify(art: Path, *extra: str, capsys) -> tuple[int, dict]:
    rc = main(["verify", str(art), "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def load(art: Path, rel: str) -> dict:
    return json.loads((art / rel).read_text())


def save(art: Path, rel: str, data: dict) -> None:
    (art / rel).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def test_statements_name_every_file_and_every_input(packaged_artifact, package_inputs):
    art = packaged_artifact
    sums = parse_sha256sums((art / "SHA256SUMS").read_bytes())
    want = {**sums, "SHA256SUMS": sha256_bytes((art / "SHA256SUMS").read_bytes())}
    prov = load(art, A.PROVENANCE_STATEMENT)
    results = load(art, A.RESULTS_STATEMENT)
    for st in (prov, results):
        assert st["_type"] == "https://in-toto.io/Statement/v1"
        assert {s["name"]: s["digest"]["sha256"] for s in st["subject"]} == want
    assert prov["predicateType"] == "https://slsa.dev/provenance/v1"
    from google.protobuf import json_format
    from in_toto_attestation.predicates.provenance.v1 import provenance_pb2

    json_format.ParseDict(prov["predicate"], provenance_pb2.Provenance())  # SLSA v1 field names
    build = prov["predicate"]["buildDefinition"]
    recipe = package_inputs["recipe"]
    assert build["externalParameters"]["recipe"]["sha256"] == recipe.hash()
    assert build["externalParameters"]["recipe"]["content"] == recipe.resolved()
    deps = {d["name"]: d for d in build["resolvedDependencies"]}
    snap = package_inputs["source"]
    for rel, d in snap.files.items():
        assert deps[f"source/{rel}"]["digest"] == {"sha256": d.sha256}
    calib = package_inputs["checkpoint"].calibration
    assert deps["calibration-tokens"]["digest"] == {"sha256": calib.calib_hash}
    assert deps["heldout-tokens"]["digest"] == {"sha256": calib.heldout_hash}
    assert deps["library/llmcompressor"]["uri"] == "pkg:pypi/llmcompressor@0.14.0.1"
    assert "qship" in deps
    run = prov["predicate"]["runDetails"]
    started = datetime.datetime.fromisoformat(run["metadata"]["startedOn"])
    assert started <= datetime.datetime.fromisoformat(run["metadata"]["finishedOn"])
    byproducts = {b["name"]: b["annotations"] for b in run["byproducts"]}
    assert "package.package_s" in byproducts["timings"] and byproducts["machine"]["machine"]
    # qship's predicate: eval.json's figures
    ev = load(art, "eval.json")
    pred = results["predicate"]
    assert results["predicateType"] == "urn:qship:predicate:results:v1" and pred["version"] == 1
    assert pred["eval_sha256"] == sums["eval.json"]
    assert pred["kl"]["kl"]["mean"] == ev["metrics"]["kl"]["mean"] > 0
    assert pred["verdict"]["passed"] is True
    rep = verify(art)
    assert rep.attestation_signature == "absent"
    assert any("in-toto statements" in c for c in rep.checks)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {"a": ec_keypair(d, "a"), "b": ec_keypair(d, "b")}


@pytest.fixture(scope="module")
def signed_artifact(tmp_path_factory, package_inputs, keys) -> Path:
    out = tmp_path_factory.mktemp("signed") / "art"
    return P.package(out=out, sign_key=keys["a"][0], **package_inputs).path


def test_private_key_signature(signed_artifact, keys, tmp_path, capsys):
    art = signed_artifact
    bundle = load(art, A.bundle_of(A.PROVENANCE_STATEMENT))
    env = bundle["dsseEnvelope"]
    assert env["payloadType"] == "application/vnd.in-toto+json"
    assert json.loads(base64.b64decode(env["payload"])) == load(art, A.PROVENANCE_STATEMENT)
    rc, out = cli_verify(art, "--require-signature", "--pubkey", str(keys["a"][1]), capsys=capsys)
    assert rc == 0 and out["attestation_signature"] == "verified" and out["signature"] == "verified"
    # another key: exit 3 naming model.sig, and without model.sig, the bundle
    rc, out = cli_verify(art, "--pubkey", str(keys["b"][1]), capsys=capsys)
    assert rc == 3 and out["path"].endswith("model.sig")
    bad = copy(art, tmp_path)
    (bad / "model.sig").unlink()
    rc, out = cli_verify(bad, "--pubkey", str(keys["b"][1]), capsys=capsys)
    assert rc == 3 and "sigstore.json" in out["path"] and "does not verify" in out["message"]
    # the statement rewritten under its (now stale) signature: named
    st = load(bad, A.RESULTS_STATEMENT)
    st["predicate"]["kl"]["kl"]["mean"] = 0.0
    save(bad, A.RESULTS_STATEMENT, st)
    with pytest.raises(IntegrityError) as e:
        verify(bad, pubkey=keys["a"][1])
    assert e.value.path.endswith("results.json") and "predicate.kl" in e.value.message


def _cert_chain(d: Path, name: str, key_pem: Path) -> tuple[Path, Path]:
    """(leaf certificate for key_pem, its CA's certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])

    def build(subject, key, issuer, signer, ca: bool):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
             .public_key(key).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(days=1))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))  # fmt: skip
        if ca:
            b = b.add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                              False, False), critical=True)  # fmt: skip
        else:
            b = b.add_extension(x509.KeyUsage(True, False, False, False, False, False, False,
                                              False, False), critical=True)  # fmt: skip
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]),
                                critical=False)  # fmt: skip
        return b.sign(signer, hashes.SHA256())

    ca = build(ca_name, ca_key.public_key(), ca_name, ca_key, True)
    leaf_key = serialization.load_pem_private_key(key_pem.read_bytes(), None)
    leaf_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} signer")])
    leaf = build(leaf_name, leaf_key.public_key(), ca_name, ca_key, False)
    paths = d / f"{name}-leaf.pem", d / f"{name}-ca.pem"
    for p, c in zip(paths, (leaf, ca), strict=True):
        p.write_bytes(c.public_bytes(serialization.Encoding.PEM))
    return paths


def test_certificate_signature(package_inputs, keys, tmp_path, capsys):
    leaf, ca = _cert_chain(tmp_path, "good", keys["a"][0])
    _, other_ca = _cert_chain(tmp_path, "other", keys["b"][0])
    art = P.package(out=tmp_path / "art", sign_key=keys["a"][0], sign_cert=leaf,
                    cert_chain=(ca,), **package_inputs).path  # fmt: skip
    bundle = load(art, A.bundle_of(A.PROVENANCE_STATEMENT))
    assert "certificate" in json.dumps(bundle["verificationMaterial"]).lower()
    rc, out = cli_verify(art, "--cert-chain", str(ca), capsys=capsys)
    assert rc == 0 and out["attestation_signature"] == "verified"
    rc, out = cli_verify(art, "--cert-chain", str(other_ca), capsys=capsys)
    assert rc == 3 and "sigstore.json" in out["path"]


def _drop_statement(art: Path) -> None:
    (art / A.RESULTS_STATEMENT).unlink()


def _bad_subject(art: Path) -> None:
    st = load(art, A.PROVENANCE_STATEMENT)
    st["subject"][0]["digest"]["sha256"] = "0" * 64
    save(art, A.PROVENANCE_STATEMENT, st)


def _wrong_recipe_hash(art: Path) -> None:
    st = load(art, A.PROVENANCE_STATEMENT)
    st["predicate"]["buildDefinition"]["externalParameters"]["recipe"]["sha256"] = "1" * 64
    save(art, A.PROVENANCE_STATEMENT, st)


def _not_slsa(art: Path) -> None:
    st = load(art, A.PROVENANCE_STATEMENT)
    st["predicate"]["buildDefinition"]["buildTyp"] = "x"
    save(art, A.PROVENANCE_STATEMENT, st)


def _garbage(art: Path) -> None:
    (art / A.RESULTS_STATEMENT).write_text("{not json")


def _wrong_type(art: Path) -> None:
    st = load(art, A.RESULTS_STATEMENT)
    st["predicateType"] = "https://slsa.dev/provenance/v1"
    save(art, A.RESULTS_STATEMENT, st)


def _results_not_a_record(art: Path) -> None:
    st = load(art, A.RESULTS_STATEMENT)
    st["predicate"]["kl"]["tokens"] = "many"
    save(art, A.RESULTS_STATEMENT, st)


def _extra_file(art: Path) -> None:
    (art / "attestation" / "other.json").write_text("{}")


def _recipe_edited(art: Path) -> None:
    """recipe.yaml changed and every checksum and subject rewritten to match."""
    text = (art / "recipe.yaml").read_text().replace("group_size: 128", "group_size: 64")
    (art / "recipe.yaml").write_text(text)
    resum(art)


@pytest.mark.parametrize(
    ("damage", "file", "words"),
    [
        (_drop_statement, "results.json", "missing"),
        (_bad_subject, "provenance.json", "field `subject`"),
        (_wrong_recipe_hash, "provenance.json", "recipe.sha256"),
        (_not_slsa, "provenance.json", "buildTyp"),
        (_garbage, "results.json", "not valid JSON"),
        (_wrong_type, "results.json", "predicateType"),
        (_results_not_a_record, "results.json", "kl.tokens"),
        (_extra_file, "other.json", "unexpected file"),
        # caught before the statements, by verify's record cross-check (provenance's hashes)
        (_recipe_edited, "recipe.yaml", "changed after packaging"),
    ],
)
def test_a_statement_that_does_not_hold_is_exit_3(packaged_artifact, tmp_path, capsys, damage,
                                                  file, words):  # fmt: skip
    art = copy(packaged_artifact, tmp_path)
    damage(art)
    rc, out = cli_verify(art, capsys=capsys)
    assert rc == 3, out
    assert out["path"].endswith(file) and words in out["message"], out
