"""Signatures over an artifact: OpenSSF model-signing, elliptic-key method. `model.sig` is
written after SHA256SUMS and signs every other file, SHA256SUMS included."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from ..errors import IntegrityError, UsageError

SIGNATURE = "model.sig"


def _hashing_config() -> Any:
    import model_signing

    return model_signing.hashing.Config().set_ignored_paths(
        paths=[SIGNATURE], ignore_git_paths=False
    )


def sign_artifact(root: Path, private_key: Path, password: str | None = None) -> Path:
    """Sign every file of `root` except model.sig."""
    import model_signing

    sig = root / SIGNATURE
    try:
        model_signing.signing.Config().use_elliptic_key_signer(
            private_key=Path(private_key), password=password
        ).set_hashing_config(_hashing_config()).sign(root, sig)
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(
            f"cannot sign with this key ({type(e).__name__}: {e})",
            path=str(private_key),
            hint="give a PEM elliptic-curve private key (e.g. openssl ecparam -genkey -name prime256v1)",
        ) from e
    return sig


def check_signature(
    root: Path, *, pubkey: Path | None, require: bool
) -> Literal["absent", "present-unverified", "verified"]:
    """'absent' | 'present-unverified' | 'verified'; IntegrityError when it does not verify."""
    sig = root / SIGNATURE
    if not sig.exists():
        if require:
            raise IntegrityError(
                f"unsigned artifact: {SIGNATURE} absent but a signature is required",
                path=str(sig),
                hint="package it with --sign-key, or drop --require-signature",
            )
        return "absent"
    if pubkey is None:
        if require:
            raise UsageError("--require-signature needs --pubkey PUBLIC_KEY.pem", path=str(sig))
        return "present-unverified"
    if not Path(pubkey).is_file():
        raise UsageError("public key file not found", path=str(pubkey))
    import model_signing

    try:
        model_signing.verifying.Config().use_elliptic_key_verifier(
            public_key=Path(pubkey)
        ).set_hashing_config(_hashing_config()).verify(root, sig)
    except Exception as e:  # noqa: BLE001 - any failure of the verifier fails closed
        raise IntegrityError(
            f"signature verification failed with {Path(pubkey).name} ({type(e).__name__}: {str(e)[:300]})",
            path=str(sig),
            hint="the artifact was modified or signed by another key; do not deploy it",
        ) from e
    return "verified"
