"""bom.cdx.json: a CycloneDX 1.6 ML-BOM of the artifact, held to the schema by the library's
own validator, and what verify does with one that is malformed or does not match."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from factories import resum

from pipeline.artifact.bom import BOM
from pipeline.cli import main
from pipeline.io.hashing import parse_sha256sums


def components(bom: dict) -> dict[str, dict]:
    return {c["bom-ref"]: c for c in bom["components"]}


def test_bom_is_cyclonedx_1_6_and_describes_the_model(packaged_artifact, package_inputs):
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    text = (packaged_artifact / BOM).read_text()
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None
    bom = json.loads(text)
    assert bom["bomFormat"] == "CycloneDX" and bom["specVersion"] == "1.6"
    assert "timestamp" not in bom["metadata"] and bom["serialNumber"].startswith("urn:uuid:")
    comps = components(bom)
    assert not [r for r in comps if r.startswith("BomRef.")]  # fixed refs: reproducible
    model = comps["model"]
    assert model["type"] == "machine-learning-model"
    # quantitativeAnalysis from eval.json
    ev = json.loads((packaged_artifact / "eval.json").read_text())
    metrics = {
        m["type"]: m for m in model["modelCard"]["quantitativeAnalysis"]["performanceMetrics"]
    }
    assert float(metrics["kl_mean_nats"]["value"]) == pytest.approx(
        ev["metrics"]["kl"]["mean"], rel=1e-5
    )
    assert float(metrics["top1_agreement"]["value"]) == pytest.approx(
        ev["metrics"]["top1_agreement"], rel=1e-5
    )
    # one quantization record per module group
    props = {p["name"]: json.loads(p["value"]) for p in model["modelCard"]["properties"]}
    linear = props["qship:quantization:linear"]
    assert (
        linear["method"] == "rtn" and linear["bits"] == 4 and linear["scheme"]["group_size"] == 128
    )
    plan = package_inputs["checkpoint"].plan
    assert linear["modules"] == sorted(m.name for m in plan.modules if m.group == "linear")
    assert props["qship:quantization:head"]["method"] == "none"
    # the source, the datasets and the libraries, with hashes
    snap = package_inputs["source"]
    assert comps["source"]["hashes"][0]["content"] == snap.model_hash
    calib = package_inputs["checkpoint"].calibration
    assert comps["data:calibration"]["hashes"][0]["content"] == calib.calib_hash
    assert comps["data:heldout"]["hashes"][0]["content"] == calib.heldout_hash
    assert comps["library:llmcompressor"]["purl"] == "pkg:pypi/llmcompressor@0.14.0.1"
    sums = parse_sha256sums((packaged_artifact / "SHA256SUMS").read_bytes())
    assert BOM in sums
    for rel in ("config.json", "eval.json", "README.md"):
        assert comps[f"file:{rel}"]["hashes"][0]["content"] == sums[rel]


def _cli(art: Path, capsys) -> tuple[int, dict]:
    rc = main(["verify", str(art), "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda b: b.update(specVersion="9.9"), "specVersion"),
        (lambda b: b["components"][0].update(type="spaceship"), "components/0/type"),
        (lambda b: b["components"][0]["hashes"][0].update(content="0" * 64), "hashes"),
    ],
)
def test_a_malformed_or_false_bom_is_exit_3(packaged_artifact, tmp_path, capsys, edit, words):
    art = Path(shutil.copytree(packaged_artifact, tmp_path / "art"))
    bom = json.loads((art / BOM).read_text())
    bom["components"].sort(key=lambda c: not c["bom-ref"].startswith("file:"))  # a file first
    edit(bom)
    (art / BOM).write_text(json.dumps(bom))
    resum(art, bom=False)  # every checksum and subject holds: the BOM check must fail
    rc, out = _cli(art, capsys)
    assert rc == 3 and out["path"].endswith(BOM) and words in out["message"], out
