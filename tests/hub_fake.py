"""A Hugging Face Hub on loopback, for the tests of models by name: the
routes and headers huggingface_hub's model_info and hf_hub_download use,
served from repos held in memory.

    with FakeHub() as hub:                   # http://127.0.0.1:<port>, point HF_ENDPOINT at hub.url
        commit = hub.add_repo("org/tiny", {"tiny-Q8_0.gguf": data}, tags=("v1",))
        ...
        hub.requests                         # [(method, path, Range header or None), ...]

Routes: GET /api/models/{repo}[/revision/{rev}] (id, sha, siblings with
sizes), HEAD/GET /{repo}/resolve/{rev}/{path} with X-Repo-Commit, ETag
(the content's sha256, as the Hub gives LFS files), Content-Length,
Accept-Ranges and 206 answers to `Range: bytes=N-`; unknown repo, revision
or file: 404 with the Hub's X-Error-Code. ``drop_once[path] = n`` sends the
first GET of that file n bytes of its body, then closes the connection (a
dropped download, which the client resumes with a Range request).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo -> {"refs": {name: commit}, "commits": {commit: {path: bytes}}}
        self.requests: list[tuple[str, str, str | None]] = []
        self.drop_once: dict[str, int] = {}
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fake-hub", daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)

    def add_repo(self, repo_id: str, files: dict[str, bytes], branch: str = "main", tags=()) -> str:
        """A commit of these files on `branch` (and tags); returns its sha."""
        h = hashlib.sha1(repo_id.encode())
        for path in sorted(files):
            h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        commit = h.hexdigest()
        repo = self.repos.setdefault(repo_id, {"refs": {}, "commits": {}})
        repo["commits"][commit] = dict(files)
        for ref in (branch, *tags):
            repo["refs"][ref] = commit
        return commit

    def paths(self, method: str = "GET") -> list[str]:
        return [p for m, p, _ in self.requests if m == method]

    # -- lookups -------------------------------------------------------------
    def _commit(self, repo_id: str, rev: str):
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, "RepoNotFound"
        commit = repo["refs"].get(rev, rev)
        if commit not in repo["commits"]:
            return None, "RevisionNotFound"
        return commit, None


def _handler(hub: FakeHub):
    api = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?")
    resolve = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            with hub._lock:
                hub.requests.append((self.command, path, self.headers.get("Range")))
            m = api.fullmatch(path)
            if m:
                return self._api(m["repo"], m["rev"] or "main")
            m = resolve.fullmatch(path)
            if m:
                return self._file(m["repo"], m["rev"], m["path"], body)
            self._error(404, "RepoNotFound", "not found")

        def _error(self, status: int, code: str, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _api(self, repo_id: str, rev: str) -> None:
            commit, error = hub._commit(repo_id, rev)
            if error:
                return self._error(404, error, f"{repo_id}@{rev}: {error}")
            files = hub.repos[repo_id]["commits"][commit]
            data = json.dumps({
                "_id": commit[:24], "id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z",
                "siblings": [{"rfilename": p, "size": len(b)} for p, b in sorted(files.items())],
            }).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _file(self, repo_id: str, rev: str, path: str, body: bool) -> None:
            commit, error = hub._commit(repo_id, rev)
            if error:
                return self._error(404, error, f"{repo_id}@{rev}: {error}")
            data = hub.repos[repo_id]["commits"][commit].get(path)
            if data is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = 0
            rng = self.headers.get("Range")
            m = re.fullmatch(r"bytes=(\d+)-", rng or "")
            if m:
                start = int(m[1])
            status = 206 if m else 200
            self.send_response(status)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data) - start))
            if m:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            with hub._lock:
                cut = hub.drop_once.pop(path, None) if not m else None
            if cut is not None:  # a dropped connection mid-body
                self.wfile.write(data[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(data[start:])

    return Handler
