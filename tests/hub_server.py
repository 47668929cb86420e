"""A tiny in-process Hugging Face Hub for tests: speaks the part of the Hub's HTTP protocol
that huggingface_hub 1.33 uses for model_info / hf_hub_download / snapshot_download.

* GET  /api/models/{repo}[/revision/{rev}][?blobs=true]  -> {id, sha, siblings[...]}
  (siblings carry size, blobId and, for LFS files, lfs {sha256, size, pointerSize})
* GET  /api/models/{repo}/tree/{rev}[/{path}]?recursive=... -> [{type, path, size, oid, lfs}]
* HEAD/GET /{repo}/resolve/{rev}/{filename}
    - regular (git) files: 200, ETag "<git blob sha1>", X-Repo-Commit, Content-Length
    - LFS files (*.safetensors, *.gguf, *.bin ...): 302 to a "CDN" URL on another host name
      (localhost instead of 127.0.0.1, so the client stops there the way it does for the
      real CDN) with X-Linked-Etag "<sha256>", X-Linked-Size, X-Repo-Commit, ETag
* GET  /cdn/{sha256}  -> the LFS object (or flipped bytes when a test asks for corruption)
Unknown repos / revisions / files answer 404 with the Hub's X-Error-Code header.

`HubServer.add_commit(repo, files, branch="main")` stores a commit and moves the branch;
`corrupt(sha256)` makes the CDN serve that object with one byte flipped while every
header and the API still advertise the true sha256 and size. `fault(prefix, kind, times)`
makes the next `times` requests whose path starts with `prefix` fail the way networks do:
`status` (e.g. 503, or 429 with Retry-After), `stall` (answer after `seconds`), `hold`
(answer only once the server stops: a download that hangs until the test is done, with no
timer to race), `truncate` (full Content-Length, half the body, then the connection closes).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".model", ".ckpt")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
    ).encode()


@dataclass
class HubFile:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        return lfs_pointer(self.sha256, len(self.data))

    @property
    def blob_id(self) -> str:  # git blob of what git stores: the pointer for LFS files
        return git_blob_sha1(self.pointer if self.lfs else self.data)


@dataclass
class Fault:
    prefix: str
    kind: str  # "status" | "stall" | "hold" | "truncate"
    times: int
    status: int = 503
    retry_after: int | None = None
    seconds: float = 0.0


@dataclass
class HubRepo:
    refs: dict[str, str] = field(default_factory=dict)  # branch -> commit
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)


class HubServer:
    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.corrupted: set[str] = set()
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # releases the requests a `hold` fault keeps
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.hub = self  # type: ignore[attr-defined]
        self.port = self.httpd.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.cdn = f"http://localhost:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    # --------------------------------------------------------------- control

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    def add_commit(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        branch: str = "main",
        commit: str | None = None,
    ) -> str:
        """Store a commit holding `files` (relpath -> bytes) and point `branch` at it."""
        entries = {
            rel: HubFile(data, lfs=rel.endswith(LFS_SUFFIXES))
            for rel, data in sorted(files.items())
        }
        if commit is None:
            h = hashlib.sha1(repo_id.encode())
            for rel, f in entries.items():
                h.update(f"{rel}\0{f.sha256}\0".encode())
            commit = h.hexdigest()
        with self.lock:
            repo = self.repos.setdefault(repo_id, HubRepo())
            repo.commits[commit] = entries
            repo.refs[branch] = commit
        return commit

    def add_dir(self, repo_id: str, folder: Path, *, branch: str = "main", **kw) -> str:
        files = {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(Path(folder).rglob("*"))
            if p.is_file()
        }
        return self.add_commit(repo_id, files, branch=branch, **kw)

    def move_branch(self, repo_id: str, branch: str, commit: str) -> None:
        with self.lock:
            self.repos[repo_id].refs[branch] = commit

    def fault(self, prefix: str, kind: str, times: int = 1, **kw) -> None:
        with self.lock:
            self.faults.append(Fault(prefix, kind, times, **kw))

    def take_fault(self, path: str) -> Fault | None:
        with self.lock:
            for f in self.faults:
                if f.times > 0 and path.startswith(f.prefix):
                    f.times -= 1
                    return f
        return None

    def corrupt(self, sha256: str) -> None:
        with self.lock:
            self.corrupted.add(sha256)

    def resolve(self, repo_id: str, rev: str) -> tuple[str, dict[str, HubFile]] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return None
        commit = repo.refs.get(rev, rev)
        files = repo.commits.get(commit)
        return (commit, files) if files is not None else None

    def blob(self, sha256: str) -> bytes | None:
        for repo in self.repos.values():
            for files in repo.commits.values():
                for f in files.values():
                    if f.lfs and f.sha256 == sha256:
                        return f.data
        return None

    def count(self, method: str, prefix: str) -> int:
        return sum(1 for m, p in self.requests if m == method and p.startswith(prefix))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "qship-test-hub/1"

    def log_message(self, *args) -> None:  # quiet
        pass

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    # --------------------------------------------------------------- responses

    def _send(
        self, status: int, body: bytes = b"", headers: dict | None = None, *, head: bool
    ) -> None:
        self.send_response(status)
        hdrs = {"Content-Length": str(len(body)), **(headers or {})}
        for k, v in hdrs.items():
            self.send_header(k, v)
        self.end_headers()
        if not head and body and getattr(self, "truncate", False):
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # socket.SHUT_RDWR: the client sees a short body
            return
        if not head and body:
            self.wfile.write(body)

    def _json(self, obj, *, head: bool, headers: dict | None = None) -> None:
        body = json.dumps(obj).encode()
        self._send(200, body, {"Content-Type": "application/json", **(headers or {})}, head=head)

    def _error(self, status: int, code: str, message: str, *, head: bool) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(
            status,
            body,
            {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message},
            head=head,
        )

    # --------------------------------------------------------------- routing

    def _dispatch(self, *, head: bool) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        with self.hub.lock:
            self.hub.requests.append((self.command, path))
        parts = [p for p in path.split("/") if p]
        fault = self.hub.take_fault(path)
        if fault is not None and fault.kind == "status":
            hdrs = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
            return self._send(fault.status, b"injected", hdrs, head=head)
        if fault is not None and fault.kind == "stall":
            import time

            time.sleep(fault.seconds)
        if fault is not None and fault.kind == "hold":
            self.hub.stopping.wait()
            return
        self.truncate = fault is not None and fault.kind == "truncate"
        try:
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api(parts[2:], query, head=head)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(parts, head=head)
            if len(parts) == 2 and parts[0] == "cdn":
                return self._cdn(parts[1], head=head)
        except BrokenPipeError:
            return
        self._error(404, "EntryNotFound", f"no route {path}", head=head)

    def _api(self, parts: list[str], query: dict, *, head: bool) -> None:
        repo_id = "/".join(parts[:2])
        rest = parts[2:]
        if repo_id not in self.hub.repos:
            return self._error(404, "RepoNotFound", f"Repository not found: {repo_id}", head=head)
        if not rest or rest[0] == "revision":
            rev = rest[1] if len(rest) > 1 else "main"
            got = self.hub.resolve(repo_id, rev)
            if got is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head=head)
            commit, files = got
            blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
            siblings = []
            for rel, f in files.items():
                s = {"rfilename": rel}
                if blobs:
                    s["size"] = len(f.data)
                    s["blobId"] = f.blob_id
                    if f.lfs:
                        s["lfs"] = {
                            "sha256": f.sha256,
                            "size": len(f.data),
                            "pointerSize": len(f.pointer),
                        }
                siblings.append(s)
            info = {
                "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit,
                "private": False,
                "gated": False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
                "lastModified": "2026-01-01T00:00:00.000Z",
                "createdAt": "2026-01-01T00:00:00.000Z",
            }
            return self._json(info, head=head)
        if rest[0] == "tree" and len(rest) >= 2:
            rev = rest[1]
            prefix = "/".join(rest[2:])
            got = self.hub.resolve(repo_id, rev)
            if got is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head=head)
            _, files = got
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            out, folders = [], set()
            for rel, f in files.items():
                if prefix and not rel.startswith(prefix + "/"):
                    continue
                sub = rel[len(prefix) + 1 :] if prefix else rel
                if "/" in sub and not recursive:
                    folders.add((prefix + "/" if prefix else "") + sub.split("/", 1)[0])
                    continue
                entry = {"type": "file", "oid": f.blob_id, "size": len(f.data), "path": rel}
                if f.lfs:
                    entry["lfs"] = {
                        "oid": f.sha256,
                        "size": len(f.data),
                        "pointerSize": len(f.pointer),
                    }
                out.append(entry)
            out += [
                {"type": "directory", "oid": "0" * 40, "size": 0, "path": d}
                for d in sorted(folders)
            ]
            return self._json(out, head=head)
        self._error(404, "EntryNotFound", "unknown api route", head=head)

    def _resolve(self, parts: list[str], *, head: bool) -> None:
        repo_id = "/".join(parts[:2])
        rev = parts[3]
        filename = "/".join(parts[4:])
        if repo_id not in self.hub.repos:
            return self._error(404, "RepoNotFound", f"Repository not found: {repo_id}", head=head)
        got = self.hub.resolve(repo_id, rev)
        if got is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head=head)
        commit, files = got
        f = files.get(filename)
        if f is None:
            return self._error(
                404, "EntryNotFound", f"{filename} does not exist at {rev}", head=head
            )
        if f.lfs:
            headers = {
                "X-Repo-Commit": commit,
                "ETag": f'"{f.blob_id}"',
                "X-Linked-Etag": f'"{f.sha256}"',
                "X-Linked-Size": str(len(f.data)),
                "Location": f"{self.hub.cdn}/cdn/{f.sha256}",
                "Content-Type": "text/plain; charset=utf-8",
            }
            return self._send(302, b"Found. Redirecting", headers, head=head)
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{f.blob_id}"',
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
        }
        self._send(200, f.data, headers, head=head)

    def _cdn(self, sha256: str, *, head: bool) -> None:
        data = self.hub.blob(sha256)
        if data is None:
            return self._error(404, "EntryNotFound", "no such object", head=head)
        if sha256 in self.hub.corrupted:
            b = bytearray(data)
            b[len(b) // 2] ^= 0x01
            data = bytes(b)
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[len("bytes=") :].split("-")[0] or 0)
            body = data[start:]
            hdrs = {
                "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}",
                "ETag": f'"{sha256}"',
                "Content-Type": "application/octet-stream",
            }
            return self._send(206, body, hdrs, head=head)
        self._send(
            200,
            data,
            {
                "ETag": f'"{sha256}"',
                "Content-Type": "application/octet-stream",
                "Accept-Ranges": "bytes",
            },
            head=head,
        )
