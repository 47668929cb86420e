"""The artifact stages: package (complete, checksummed, reproducible), verify (the standalone
pre-deploy gate) and publish (only what passed and verifies).

    package.py     QuantizedCheckpoint + EvalReport + Verdict -> Artifact
    weights.py     byte-level re-layout and sharding of the tensors
    provenance.py  provenance.json
    model_card.py  README.md
    probe.py       the load-probe fingerprint
    signing.py     model.sig (OpenSSF model-signing)
    verify.py      `qship verify`
    publish.py     local registry or the Hub

Import the functions from their modules (`from pipeline.artifact.package import package`):
re-exported here, they would hide the modules of the same name.
"""
