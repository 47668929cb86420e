"""bom.cdx.json: the artifact as a CycloneDX 1.6 ML-BOM (cyclonedx-python-lib builds it,
its JSON-schema validator holds it to the 1.6 schema).

Components, each with a fixed bom-ref: the model (`machine-learning-model`, with its model
card: the quantization record of each module group in `modelCard.properties`, and
eval.json's figures in `quantitativeAnalysis.performanceMetrics`), every file of the
artifact written before the BOM (`file`, sha256), the source model, the calibration,
held-out and benchmark data (`data`, sha256 where there is one) and the libraries
(`library`, a PyPI purl). The library has no model-card type yet, so the card is added to
the serialized model component before the whole is validated. Reproducible: the serial
number is derived from the content and the timestamp is left out (both optional).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from ..errors import IntegrityError
from ..io.hashing import sha256_bytes
from ..records.artifact import Provenance
from ..records.checkpoint import QuantizedCheckpoint
from ..records.evaluation import EvalFile

BOM = "bom.cdx.json"
MEDIA_TYPE = "application/vnd.cyclonedx+json"
MODEL_REF = "model"


def _components(files: dict[str, str], prov: Provenance, ev: EvalFile) -> list[Any]:
    from cyclonedx.model import HashAlgorithm, HashType, Property
    from cyclonedx.model.component import Component, ComponentType
    from packageurl import PackageURL

    def sha(h: str) -> list[HashType]:
        return [HashType(alg=HashAlgorithm.SHA_256, content=h)]

    out = [Component(name=rel, type=ComponentType.FILE, bom_ref=f"file:{rel}", hashes=sha(d))
           for rel, d in sorted(files.items())]  # fmt: skip
    src = prov.source
    if src is not None:
        out.append(Component(
            name=src.repo_id or src.spec, version=src.revision, bom_ref="source",
            type=ComponentType.MACHINE_LEARNING_MODEL, hashes=sha(src.model_hash),
            properties=[Property(name="qship:source", value=src.spec),
                        Property(name="qship:pin_status", value=src.pin_status)]))  # fmt: skip
    cal = prov.calibration
    for ref, h, what in (("calibration", cal.calib_hash, f"{cal.source} calibration tokens"),
                         ("heldout", cal.heldout_hash, f"{cal.source} held-out tokens")):  # fmt: skip
        out.append(Component(name=what, type=ComponentType.DATA, bom_ref=f"data:{ref}",
                             hashes=sha(h)))  # fmt: skip
    for task, res in sorted(ev.benchmarks.tasks.items()):
        if res.status == "ok":
            out.append(Component(name=task, version=res.data or None, type=ComponentType.DATA,
                                 bom_ref=f"data:benchmark/{task}"))  # fmt: skip
    out += [Component(name=n, version=v, type=ComponentType.LIBRARY, bom_ref=f"library:{n}",
                      purl=PackageURL("pypi", None, n, v))
            for n, v in sorted(prov.library_versions.items()) if v != "absent" and n != "qship"]  # fmt: skip
    out.append(Component(name="qship", version=prov.qship.version, type=ComponentType.APPLICATION,
                         bom_ref="library:qship", purl=PackageURL("pypi", None, "qship", prov.qship.version)))  # fmt: skip
    return out


def _metric(kind: str, value: float, slice_: str | None = None, ci: tuple | None = None) -> dict:
    m: dict[str, Any] = {"type": kind, "value": f"{value:.6g}"}
    if slice_:
        m["slice"] = slice_
    if ci is not None:
        m["confidenceInterval"] = {"lowerBound": f"{ci[0]:.6g}", "upperBound": f"{ci[1]:.6g}"}
    return m


def model_card(ckpt: QuantizedCheckpoint, ev: EvalFile) -> dict[str, Any]:
    """modelParameters, quantitativeAnalysis from eval.json, one quantization record per
    module group (method, scheme, bits, modules) as properties."""
    m = ev.metrics
    metrics = [_metric("kl_mean_nats", m.kl.mean, "heldout"), _metric("kl_p99_nats", m.kl.p99, "heldout"),
               _metric("top1_agreement", m.top1_agreement, "heldout"),
               _metric("ppl_ratio", m.ppl_ratio, "heldout")]  # fmt: skip
    for task, res in sorted(ev.benchmarks.tasks.items()):
        if res.status == "ok" and res.drop_pp is not None:
            metrics.append(_metric("benchmark_drop_pp", res.drop_pp, task, res.ci95_pp))
    if ev.served is not None:
        metrics.append(_metric("served_check_passed", float(ev.served.passed), "served"))
    groups: dict[str, list] = {}
    for mod in ckpt.plan.modules:
        groups.setdefault(mod.group, []).append(mod)
    props = []
    for name, mods in sorted(groups.items()):
        s = mods[0].scheme
        rec = {"group": name, "method": mods[0].method, "bits": s.bits if s else None,
               "scheme": s.to_json() if s else None, "modules": sorted(x.name for x in mods)}  # fmt: skip
        props.append(
            {"name": f"qship:quantization:{name}", "value": json.dumps(rec, sort_keys=True)}
        )
    plan = ckpt.plan
    return {
        "modelParameters": {
            "task": "text-generation",
            "architectureFamily": plan.model_type,
            "modelArchitecture": plan.architecture,
            "datasets": [{"ref": "data:calibration"}],
        },  # fmt: skip
        "quantitativeAnalysis": {"performanceMetrics": metrics},
        "properties": props,
    }


def build(files: dict[str, str], *, name: str, prov: Provenance, ckpt: QuantizedCheckpoint,
          ev: EvalFile) -> str:  # fmt: skip
    """The BOM's JSON text over `files` (relative path -> sha256), validated."""
    from cyclonedx.model import HashAlgorithm, HashType
    from cyclonedx.model.bom import Bom
    from cyclonedx.model.component import Component, ComponentType
    from cyclonedx.output.json import JsonV1Dot6

    weights = {r: d for r, d in files.items() if r.endswith(".safetensors") and "/" not in r}
    model = Component(name=name, type=ComponentType.MACHINE_LEARNING_MODEL, bom_ref=MODEL_REF,
                      version=f"sha256:{sha256_bytes(json.dumps(weights, sort_keys=True).encode())}",
                      hashes=[HashType(alg=HashAlgorithm.SHA_256, content=d)
                              for _, d in sorted(weights.items())])  # fmt: skip
    parts = _components(files, prov, ev)
    bom = Bom(components=[model, *parts], serial_number=uuid.UUID(int=0))
    bom.register_dependency(model, [c for c in parts if c.bom_ref.value != "source"
                                    and not str(c.bom_ref.value).startswith("file:")])  # fmt: skip
    data = json.loads(JsonV1Dot6(bom).output_as_string())
    data["metadata"].pop("timestamp", None)
    for c in data["components"]:
        if c["bom-ref"] == MODEL_REF:
            c["modelCard"] = model_card(ckpt, ev)
            if prov.source is not None:
                c["pedigree"] = {"ancestors": [{"type": "machine-learning-model", "bom-ref":
                                 "ancestor:source", "name": prov.source.repo_id or prov.source.spec,
                                 "hashes": [{"alg": "SHA-256", "content": prov.source.model_hash}]}]}  # fmt: skip
    data["serialNumber"] = (
        f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, json.dumps(data, sort_keys=True))}"
    )
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    errors = validate(text)
    if errors:  # qship's own bug, never the user's: fail before the artifact exists
        raise AssertionError(f"the BOM qship built is not CycloneDX 1.6: {errors}")
    return text


def validate(text: str) -> str | None:
    """None when `text` is a CycloneDX 1.6 JSON BOM (the library's strict validator), else
    the first error with the field it is at."""
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    err = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    if err is None:
        return None
    inner = getattr(err, "data", None)
    where = "/".join(str(p) for p in getattr(inner, "absolute_path", [])) or "<top level>"
    return f"field `{where}`: {str(getattr(inner, 'message', err))[:300]}"


def check(root: Path, listed: dict[str, str], checks: list[str]) -> None:
    """bom.cdx.json is a CycloneDX 1.6 BOM whose file components are SHA256SUMS's files."""
    path = root / BOM
    if not path.is_file():
        raise IntegrityError("the artifact has no ML-BOM", path=str(path),
                             hint="re-package it with this qship (qship package)")  # fmt: skip
    text = path.read_text(encoding="utf-8", errors="replace")
    err = validate(text)
    if err is not None:
        raise _malformed(path, err)
    data = json.loads(text)
    for key, want in (("bomFormat", "CycloneDX"), ("specVersion", "1.6")):
        if data.get(key) != want:  # the schema leaves both free-form strings
            err = f"field `{key}` is {data.get(key)!r}, expected {want!r}"
    if err is not None:
        raise _malformed(path, err)
    for c in data.get("components", []):
        ref = str(c.get("bom-ref", ""))
        if ref.startswith("file:"):
            rel, got = ref[5:], (c.get("hashes") or [{}])[0].get("content")
            if listed.get(rel) != got:
                raise _malformed(path, f"field `components[bom-ref={ref}].hashes` is {got}, "
                                 f"SHA256SUMS lists {listed.get(rel)}")  # fmt: skip
    checks.append(f"{BOM}: CycloneDX 1.6 ML-BOM, its file hashes = SHA256SUMS")


def _malformed(path: Path, err: str) -> IntegrityError:
    return IntegrityError(f"{BOM} is not this artifact's CycloneDX 1.6 BOM: {err}",
                          path=str(path), hint="do not deploy this artifact; re-package it")  # fmt: skip
