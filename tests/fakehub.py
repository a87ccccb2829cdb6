"""A local fake of the Hugging Face Hub: the subset of the API that `huggingface_hub.snapshot_download` uses.

It serves, on 127.0.0.1 at a random port:

- `GET /api/models/{repo}` and `GET /api/models/{repo}/revision/{rev}`: model info (`id`, `sha`, `siblings`);
- `GET /api/models/{repo}/tree/{rev}?recursive=...`: the file listing (path, size, git oid, LFS sha256/size);
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}`: the file, with `X-Repo-Commit`, `ETag` (git sha1, or for LFS files
  `X-Linked-Etag` = sha256 and `X-Linked-Size`), `Content-Length`, and `Range: bytes=N-` support;
- 404s with the `X-Error-Code` header that huggingface_hub maps to its exceptions (`RepoNotFound`,
  `RevisionNotFound`, `EntryNotFound`).

Every request is recorded (`hub.requests`), so a test can prove which files were fetched. Faults can be injected per
file (`hub.faults[(repo, path)] = mode`) to simulate an interrupted download:

- `"drop"`: the first GET sends half the body and closes the connection; later GETs (the client's resume) get a
  500, so the download fails;
- `"drop_once"`: the first GET sends half the body and closes; the resume (`Range`) is served normally;
- `"stall"`: every GET sends half the body, sets `hub.stalled`, then waits (until `hub.release` is set) and closes.

Point huggingface_hub at it with `HF_ENDPOINT=hub.url` (set before huggingface_hub is imported, e.g. in a subprocess),
or in-process with `hub.patch(monkeypatch, cache_dir)`.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".h5", ".msgpack", ".ot", ".onnx", ".tflite")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    """One repo: revisions (branch/tag name -> commit sha) and, per commit, the files (path -> bytes)."""

    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: data}
    refs: dict[str, str] = field(default_factory=dict)  # "main", tags -> sha

    def add_commit(self, files: dict[str, bytes], refs: tuple[str, ...] = ("main",)) -> str:
        sha = hashlib.sha1(
            json.dumps(sorted((p, git_blob_sha1(d)) for p, d in files.items())).encode()
            + self.repo_id.encode()
            + str(len(self.commits)).encode()
        ).hexdigest()
        self.commits[sha] = dict(files)
        for r in refs:
            self.refs[r] = sha
        return sha

    def resolve(self, rev: str) -> str | None:
        if rev in self.commits:
            return rev
        return self.refs.get(rev)


def read_dir(d: Path) -> dict[str, bytes]:
    """All files under d (recursively) as repo paths -> bytes."""
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.faults: dict[tuple[str, str], str] = {}
        self.stalled = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._fault_hits: dict[tuple[str, str], int] = {}

    # -- set-up ---------------------------------------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: dict[str, bytes], refs: tuple[str, ...] = ("main",)) -> str:
        repo = self.repos.setdefault(repo_id, Repo(repo_id))
        return repo.add_commit(files, refs)

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fakehub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- inspection -----------------------------------------------------------------------------------------------
    def downloads(self, repo_id: str | None = None) -> set[str]:
        """Repo paths fetched with GET /resolve (optionally for one repo)."""
        out = set()
        for method, path in self.requests:
            parsed = _parse_resolve(path)
            if method == "GET" and parsed and (repo_id is None or parsed[0] == repo_id):
                out.add(parsed[2])
        return out

    def reset_log(self) -> None:
        with self._lock:
            self.requests.clear()

    def patch(self, monkeypatch, cache_dir: Path, offline: bool = False) -> None:  # type: ignore[no-untyped-def]
        """Point an already-imported huggingface_hub at this server and `cache_dir` (in-process tests)."""
        patch_hub_constants(monkeypatch, self.url if self._server else "http://127.0.0.1:9", cache_dir, offline)

    def env(self, cache_home: Path, offline: bool = False) -> dict[str, str]:
        """Environment variables for a subprocess: this endpoint, a private HF_HOME, no token, no telemetry."""
        return hub_env(self.url if self._server else "http://127.0.0.1:9", cache_home, offline)


def hub_env(endpoint: str, cache_home: Path, offline: bool = False) -> dict[str, str]:
    env = {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(cache_home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "HF_HUB_ETAG_TIMEOUT": "5",
        "HF_HUB_DOWNLOAD_TIMEOUT": "10",
        "HF_HUB_DISABLE_XET": "1",
    }
    env["HF_HUB_OFFLINE"] = "1" if offline else "0"
    return env


def patch_hub_constants(monkeypatch, endpoint: str, cache_dir: Path, offline: bool) -> None:  # type: ignore[no-untyped-def]
    """huggingface_hub reads its environment once, at import: patch what snapshot_download consults per call."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.delenv("HF_TOKEN", raising=False)


def _parse_resolve(path: str) -> tuple[str, str, str] | None:
    """/{org}/{name}/resolve/{rev}/{file...} -> (repo, rev, file)."""
    parts = unquote(urlsplit(path).path).lstrip("/").split("/")
    if len(parts) >= 5 and parts[2] == "resolve":
        return f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
    return None


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - silence the default stderr log
        pass

    # -- plumbing -------------------------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, obj: object, status: int = 200, head: bool = False) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head)

    def _error(self, status: int, code: str, msg: str, head: bool = False, extra: dict[str, str] | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": msg, "Content-Type": "application/json", **(extra or {})}
        self._send(status, json.dumps({"error": msg}).encode(), headers, head)

    def _record(self) -> None:
        with self.fake._lock:
            self.fake.requests.append((self.command, self.path))

    def do_HEAD(self) -> None:  # noqa: N802
        self._record()
        self._route(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._record()
        self._route(head=False)

    # -- routes ---------------------------------------------------------------------------------------------------
    def _route(self, head: bool) -> None:
        url = urlsplit(self.path)
        parts = unquote(url.path).lstrip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id = f"{parts[2]}/{parts[3]}"
            rest = parts[4:]
            repo = self.fake.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found", head)
            if not rest or rest[0] == "revision":
                rev = "/".join(rest[1:]) if rest else "main"
                sha = repo.resolve(rev)
                if sha is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
                files = repo.commits[sha]
                return self._json(
                    {
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": sha,
                        "private": False,
                        "siblings": [{"rfilename": p} for p in sorted(files)],
                        "tags": [],
                    },
                    head=head,
                )
            if rest[0] == "tree" and len(rest) >= 2:
                sha = repo.resolve(rest[1])
                if sha is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rest[1]}", head)
                recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
                return self._json(_tree(repo.commits[sha], recursive), head=head)
            return self._error(404, "EntryNotFound", "unknown api route", head)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head)
        return self._error(404, "EntryNotFound", "not found", head)

    def _resolve(self, repo_id: str, rev: str, path: str, head: bool) -> None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found", head)
        sha = repo.resolve(rev)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        files = repo.commits[sha]
        if path not in files:
            return self._error(404, "EntryNotFound", "Entry not found", head, {"X-Repo-Commit": sha})
        data = files[path]
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if path.endswith(LFS_SUFFIXES):
            etag = hashlib.sha256(data).hexdigest()
            headers.update({"ETag": f'"{etag}"', "X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        else:
            headers["ETag"] = f'"{git_blob_sha1(data)}"'
        if head:
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return
        key = (repo_id, path)
        mode = self.fake.faults.get(key)
        with self.fake._lock:
            hits = self.fake._fault_hits[key] = self.fake._fault_hits.get(key, 0) + 1
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng[6:].split("-")[0].isdigit():
            start = int(rng[6:].split("-")[0])
        if mode == "drop" and hits > 1:
            return self._error(500, "InternalError", "simulated failure while resuming", head)
        if mode in ("drop", "stall") or (mode == "drop_once" and hits == 1):
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            if mode == "stall":
                self.fake.stalled.set()
                self.fake.release.wait(60)
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self._send(206, data[start:], headers)
        self._send(200, data, headers)


def _tree(files: dict[str, bytes], recursive: bool) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    dirs = sorted({"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)})
    for d in dirs:
        if recursive or "/" not in d:
            out.append({"type": "directory", "path": d, "oid": git_blob_sha1(d.encode()), "size": 0})
    for p, data in sorted(files.items()):
        if not recursive and "/" in p:
            continue
        ent: dict[str, object] = {"type": "file", "path": p, "size": len(data), "oid": git_blob_sha1(data)}
        if p.endswith(LFS_SUFFIXES):
            ent["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        out.append(ent)
    return out
