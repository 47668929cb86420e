"""model-signing 1.1's signers and verifiers. Its public API signs and verifies only its own
model-manifest predicate; qship signs its in-toto statements (artifact/attestation.py) with the
same key methods, so it builds the library's private signer classes and verifies a bundle's
DSSE envelope with the verifier's own method, without the manifest check. Rows in
table.PATCHES."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .patching import check

_VERIFY = "model_signing._signing.sign_{kind}:Verifier._verify_signed_content"


def signer(private_key: Path, password: str | None, certificate: Path | None,
           chain: tuple[Path, ...]) -> Any:  # fmt: skip
    """A private-key signer, or a certificate one when `certificate` is given."""
    from model_signing._signing import sign_certificate, sign_ec_key

    if certificate is not None:
        return sign_certificate.Signer(private_key, certificate, chain)
    return sign_ec_key.Signer(private_key, password)


def verifier(pubkey: Path | None, cert_chain: list[Path]) -> Any:
    """A certificate-chain verifier when a chain is given, else a public-key one."""
    from model_signing._signing import sign_certificate, sign_ec_key

    if cert_chain:
        check(_VERIFY.format(kind="certificate"))
        return sign_certificate.Verifier(cert_chain)
    assert pubkey is not None
    check(_VERIFY.format(kind="ec_key"))
    return sign_ec_key.Verifier(Path(pubkey))


def signed_payload(verifier: Any, bundle: Path) -> tuple[str, bytes]:
    """(payload type, payload) of the bundle's DSSE envelope once its signature verifies
    (the verifying half of model-signing's verify(), without its own predicate); raises
    whatever the library raises when it does not."""
    from model_signing._signing import sign_sigstore_pb

    return verifier._verify_signed_content(sign_sigstore_pb.Signature.read(bundle))
