"""An artifact in an OCI registry: `qship publish ART --to oci://HOST/REPO:TAG` and
`qship verify oci://HOST/REPO@sha256:…` (or `:TAG`, which reports the digest it resolved).

Layout (an OCI image manifest, artifactType `application/vnd.qship.artifact.v1`): one layer
per file, SHA256SUMS, model.sig and the attestations included, in path order, each with its
sha256, its size and its path as `org.opencontainers.image.title`; the statements and their
bundles carry the in-toto and Sigstore media types, the BOM CycloneDX's. No time is written
into the manifest, so the same artifact folder gives the same manifest digest. Blobs go
first, then the manifest by its digest, then the tag: a push that fails leaves no tag.

HTTP is the OCI distribution API over httpx, each call under the project's
`io.network.retrying` (5xx, timeouts and refused connections retried, then exit 5); a 401 or
403 is exit 2 with the fix. Credentials: QSHIP_REGISTRY_USERNAME / QSHIP_REGISTRY_PASSWORD,
else the Docker config's `auths` entry for the host ($DOCKER_CONFIG/config.json or
~/.docker/config.json); basic auth, or the bearer token a registry's challenge asks for.
They are never logged nor written anywhere. Loopback hosts are spoken to over plain http
(a local registry), others over https (QSHIP_REGISTRY_PLAIN_HTTP=1 forces http).
"""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import IntegrityError, UsageError
from ..io.hashing import parse_sha256sums, sha256_bytes
from ..io.network import api_timeout, retrying
from . import attestation, modelcar
from .bom import BOM
from .bom import MEDIA_TYPE as BOM_TYPE
from .signing import SIGNATURE

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.qship.artifact.v1"
EMPTY: dict[str, Any] = {"mediaType": "application/vnd.oci.empty.v1+json",
         "digest": "sha256:" + sha256_bytes(b"{}"), "size": 2}  # fmt: skip
TITLE = "org.opencontainers.image.title"
SUMS = "SHA256SUMS"
_REF = re.compile(r"^oci://(?P<host>[A-Za-z0-9.-]+(:\d+)?)/(?P<repo>[a-z0-9]+([._/-][a-z0-9]+)*)"
                  r"(:(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(@(?P<digest>sha256:[0-9a-f]{64}))?$")  # fmt: skip


@dataclass(frozen=True)
class Ref:
    host: str
    repo: str
    tag: str | None
    digest: str | None

    @property
    def reference(self) -> str:
        return self.digest or str(self.tag)

    def __str__(self) -> str:
        return f"oci://{self.host}/{self.repo}" + (
            f"@{self.digest}" if self.digest else f":{self.tag}"
        )


def parse_ref(text: str) -> Ref:
    m = _REF.match(text)
    if m is None or not (m["tag"] or m["digest"]):
        raise UsageError(f"not an OCI reference with a tag or a digest: {text!r}", path=text,
                         hint="write oci://HOST[:PORT]/REPO:TAG or oci://HOST/REPO@sha256:<64 hex>")  # fmt: skip
    return Ref(m["host"], m["repo"], m["tag"], m["digest"])


def media_type(rel: str) -> str:
    if rel in attestation.STATEMENTS:
        return "application/vnd.in-toto+json"
    if rel.endswith(attestation.BUNDLE) or rel == SIGNATURE:
        return "application/vnd.dev.sigstore.bundle.v0.3+json"
    if rel == BOM:
        return BOM_TYPE
    return "application/octet-stream"


def credentials(host: str) -> tuple[str, str] | None:
    user, password = (
        os.environ.get("QSHIP_REGISTRY_USERNAME"),
        os.environ.get("QSHIP_REGISTRY_PASSWORD"),
    )
    if user and password:
        return user, password
    cfg = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker") / "config.json"
    try:
        entry = json.loads(cfg.read_text(encoding="utf-8")).get("auths", {}).get(host, {})
        user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
        return user, password
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None


class Registry:
    """The distribution API of one repository; every call retried, refusals exit 2."""

    def __init__(self, ref: Ref):
        import httpx

        self.ref = ref
        plain = ref.host.split(":")[0] in ("127.0.0.1", "localhost", "::1") or \
            os.environ.get("QSHIP_REGISTRY_PLAIN_HTTP") == "1"  # fmt: skip
        self.base = f"{'http' if plain else 'https'}://{ref.host}/v2/{ref.repo}"
        self.creds = credentials(ref.host)
        self.client = httpx.Client(timeout=api_timeout(), follow_redirects=True)
        self.auth: Any = httpx.BasicAuth(*self.creds) if self.creds else None

    def call(self, method: str, url: str, what: str, **kw: Any) -> Any:
        def once() -> Any:
            r = self.client.request(method, url if "://" in url else self.base + url,
                                    auth=self.auth, **kw)  # fmt: skip
            if r.status_code == 401 and r.headers.get("www-authenticate", "").lower().startswith(
                "bearer"
            ):
                self._bearer(r.headers["www-authenticate"])
                r = self.client.request(method, url if "://" in url else self.base + url,
                                        auth=self.auth, **kw)  # fmt: skip
            if r.status_code in (401, 403):
                raise UsageError(
                    f"the registry {self.ref.host} refused {what} (HTTP {r.status_code})",
                    path=str(self.ref),
                    hint="log in with credentials that may push/pull this repository: "
                    "QSHIP_REGISTRY_USERNAME and QSHIP_REGISTRY_PASSWORD, or `docker login "
                    f"{self.ref.host}` (the Docker config's auths)",
                )
            if r.status_code >= 500:
                r.raise_for_status()  # retrying classifies it as transient
            return r

        return retrying(once, what=what, host=f"OCI registry {self.ref.host}", path=str(self.ref),
                        hint="nothing was tagged; the same command pushes it again")  # fmt: skip

    def _bearer(self, challenge: str) -> None:
        import httpx

        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = params.pop("realm", "")
        r = self.client.get(realm, params=params,
                            auth=httpx.BasicAuth(*self.creds) if self.creds else None)  # fmt: skip
        if r.status_code == 200:
            token = r.json().get("token") or r.json().get("access_token")
            self.auth = _Bearer(token)


class _Bearer:
    def __init__(self, token: str):
        self.token = token

    def __call__(self, request: Any) -> Any:  # httpx's callable auth
        request.headers["Authorization"] = f"Bearer {self.token}"
        return request


def shipped(root: Path) -> list[str]:
    """What goes into the registry: SHA256SUMS's files, SHA256SUMS, model.sig, attestations."""
    listed = parse_sha256sums((root / SUMS).read_bytes(), where=str(root / SUMS))
    return sorted([*listed, SUMS, *([SIGNATURE] if (root / SIGNATURE).exists() else []),
                   *attestation.present(root)])  # fmt: skip


def manifest_for(root: Path) -> tuple[bytes, dict[str, Path]]:
    """(the manifest's bytes, digest -> file) for an artifact folder."""
    listed = parse_sha256sums((root / SUMS).read_bytes(), where=str(root / SUMS))
    layers, blobs = [], {}
    for rel in shipped(root):
        data = (root / rel).read_bytes()
        digest = "sha256:" + (listed.get(rel) or sha256_bytes(data))
        blobs[digest] = root / rel
        layers.append({"mediaType": media_type(rel), "digest": digest, "size": len(data),
                       "annotations": {TITLE: rel}})  # fmt: skip
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": ARTIFACT_TYPE,
                "config": EMPTY, "layers": layers}  # fmt: skip
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode(), blobs


def push(root: Path, target: str, layout: str = "artifact") -> tuple[Ref, str, str]:
    """Push a verified artifact folder as an OCI artifact or (layout "modelcar") a Modelcar
    image; (ref, manifest digest, 'published' | 'unchanged')."""
    import tempfile

    ref = parse_ref(target)
    if ref.tag is None:
        raise UsageError("publish needs a tag: oci://HOST/REPO:TAG", path=target)
    if layout not in ("artifact", "modelcar"):
        raise UsageError(f"--as {layout!r}: use artifact or modelcar", path="--as")
    with tempfile.TemporaryDirectory(prefix="qship-oci-") as tmp:
        work = Path(tmp)
        if layout == "modelcar":
            body, blobs = modelcar.image(root, shipped(root), work, MANIFEST_TYPE)
        else:
            body, blobs = manifest_for(root)
            (work / "empty.json").write_bytes(b"{}")
            blobs[EMPTY["digest"]] = work / "empty.json"
        return _upload(ref, body, blobs)


def _upload(ref: Ref, body: bytes, blobs: dict[str, Path]) -> tuple[Ref, str, str]:
    digest = "sha256:" + sha256_bytes(body)
    reg = Registry(ref)
    head = reg.call("HEAD", f"/manifests/{ref.tag}", "reading the tag",
                    headers={"Accept": MANIFEST_TYPE})  # fmt: skip
    if head.status_code == 200 and head.headers.get("docker-content-digest") == digest:
        return ref, digest, "unchanged"
    for d, path in blobs.items():
        if reg.call("HEAD", f"/blobs/{d}", f"checking blob {d[:19]}").status_code == 200:
            continue
        start = reg.call("POST", "/blobs/uploads/", "starting an upload")
        _accepted(start, "an upload", ref)
        loc = start.headers.get("location", "")
        loc = loc if "://" in loc else f"{reg.base.split('/v2/')[0]}{loc}"
        # the upload URL carries the registry's state in its query: the digest is added to it
        loc += ("&" if "?" in loc else "?") + f"digest={d}"
        done = reg.call("PUT", loc, f"uploading {path.name}", content=path.read_bytes(),
                        headers={"Content-Type": "application/octet-stream"})  # fmt: skip
        _accepted(done, f"the blob {path.name}", ref)
    for reference in (digest, ref.tag):  # the tag last: a failed push leaves none
        r = reg.call("PUT", f"/manifests/{reference}", "putting the manifest", content=body,
                     headers={"Content-Type": MANIFEST_TYPE})  # fmt: skip
        _accepted(r, "the manifest", ref)
    return ref, digest, "published"


def _accepted(r: Any, what: str, ref: Ref) -> None:
    if r.status_code >= 300:
        raise UsageError(f"the registry rejected {what} (HTTP {r.status_code}: {r.text[:300]})",
                         path=str(ref), hint="check the reference and the registry's limits")  # fmt: skip


def _safe(rel: Any) -> str:
    p = PurePosixPath(str(rel))
    if not rel or p.is_absolute() or ".." in p.parts:
        raise IntegrityError(f"layer title {rel!r} is not a relative path inside the artifact",
                             path="manifest", hint="do not deploy it")  # fmt: skip
    return p.as_posix()


def _blob(reg: Registry, ref: Ref, layer: dict, rel: str) -> bytes:
    """A layer's bytes, held to its digest."""
    got_blob = reg.call("GET", f"/blobs/{layer['digest']}", f"downloading {rel}")
    if got_blob.status_code == 404:
        raise IntegrityError(f"layer {rel}: blob {layer['digest']} is missing from the "
                             "registry", path=f"{ref}#{rel}", hint="do not deploy it")  # fmt: skip
    got = "sha256:" + sha256_bytes(got_blob.content)
    if got != layer["digest"]:
        raise IntegrityError(f"layer {rel}: the registry served bytes with {got}, the "
                             f"manifest says {layer['digest']}", path=f"{ref}#{rel}",
                             hint="the registry's copy was altered; do not deploy it")  # fmt: skip
    return got_blob.content


def pull(text: str, dest: Path) -> tuple[Ref, str]:
    """Every layer into dest, each held to its digest; (ref, the manifest's digest)."""
    ref = parse_ref(text)
    reg = Registry(ref)
    r = reg.call("GET", f"/manifests/{ref.reference}", "reading the manifest",
                 headers={"Accept": MANIFEST_TYPE})  # fmt: skip
    if r.status_code == 404:
        raise UsageError(f"{ref} is not in the registry", path=str(ref))
    _accepted(r, "reading the manifest", ref)
    digest = "sha256:" + sha256_bytes(r.content)
    if ref.digest and digest != ref.digest:
        raise IntegrityError(f"the manifest's sha256 is {digest}, not {ref.digest}",
                             path=str(ref), hint="do not deploy it")  # fmt: skip
    try:
        layers = json.loads(r.content)["layers"]
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"malformed manifest ({e})", path=str(ref)) from e
    config = json.loads(r.content).get("config", {})
    if isinstance(config, dict) and config.get("mediaType") == modelcar.CONFIG_TYPE:
        if len(layers) != 1:
            raise IntegrityError(f"a modelcar image has one layer, this one {len(layers)}",
                                 path=str(ref))  # fmt: skip
        import tempfile

        with tempfile.TemporaryDirectory(prefix="qship-layer-") as tmp:
            (Path(tmp) / "layer.tar").write_bytes(_blob(reg, ref, layers[0], modelcar.MODELS))
            modelcar.extract(Path(tmp) / "layer.tar", dest, where=str(ref))
        return ref, digest
    for layer in layers:
        rel = _safe(layer.get("annotations", {}).get(TITLE))
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(_blob(reg, ref, layer, rel))
    return ref, digest


def verify_remote(text: str, **options: Any) -> Any:
    """`qship verify oci://…`: pull into a temporary folder and run every check there."""
    import tempfile

    from .verify import verify

    with tempfile.TemporaryDirectory(prefix="qship-oci-") as tmp:
        ref, digest = pull(text, Path(tmp))
        report = verify(Path(tmp), **options)
    pinned = f"oci://{ref.host}/{ref.repo}@{digest}"
    how = f"pulled {ref}" + ("" if ref.digest else f", resolved to {digest}")
    return report.model_copy(update={"path": pinned, "checks": [how + "; every layer's sha256 "
                                      "held", *report.checks]})  # fmt: skip
