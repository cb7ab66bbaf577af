"""A loopback stand-in for the Hugging Face Hub: the few endpoints huggingface_hub's
`snapshot_download` calls (huggingface_hub/_snapshot_download.py, hf_api.py, file_download.py):

    GET  /api/models/{repo}/revision/{rev}       repo_info: {"id", "sha", "siblings"}
    GET  /api/models/{repo}/tree/{sha}?...       list_repo_tree: [{"type", "path", "size", "oid"}]
    HEAD /{repo}/resolve/{sha}/{file}            get_hf_file_metadata: X-Repo-Commit, ETag, size
    GET  /{repo}/resolve/{sha}/{file}            the bytes

An unknown repository answers 404 with X-Error-Code: RepoNotFound, an unknown revision 404 with
RevisionNotFound, as the Hub does (huggingface_hub turns those headers into its error classes).
`HubServer.broken` makes an API kind ("revision", "tree") answer an error instead, as a Hub
mirror that lacks it would: {kind: (status, X-Error-Code or None)}. Every request path is
recorded in `HubServer.requests`. It listens on 127.0.0.1 only.
"""

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class HubServer:
    """Serve directories as Hub model repositories: `add(repo, directory, revisions)`."""

    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo -> {"files": {name: bytes}, "refs": {rev: sha}}
        self.requests: list[str] = []
        self.broken: dict[str, tuple[int, str | None]] = {}  # API kind -> (status, error code)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def add(self, repo: str, directory: Path, revisions: tuple[str, ...] = ("main",)) -> str:
        """Serve every file under `directory` as `repo`; returns its commit hash."""
        files = {
            p.relative_to(directory).as_posix(): p.read_bytes()
            for p in sorted(directory.rglob("*"))
            if p.is_file()
        }
        sha = hashlib.sha1(
            repr(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items())).encode()
        ).hexdigest()
        self.repos[repo] = {"files": files, "refs": {r: sha for r in revisions} | {sha: sha}}
        return sha

    def __enter__(self) -> "HubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            self._answer(body=True)

        def do_HEAD(self):
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append(f"{self.command} {path}")
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                repo, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
                self._api(repo, kind, rev, body)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
            else:
                self._error(404, "EntryNotFound", body)

        def _lookup(self, repo: str, rev: str, body: bool):
            if repo not in hub.repos:
                self._error(404, "RepoNotFound", body)
                return None, None
            entry = hub.repos[repo]
            if rev not in entry["refs"]:
                self._error(404, "RevisionNotFound", body)
                return None, None
            return entry, entry["refs"][rev]

        def _api(self, repo: str, kind: str, rev: str, body: bool) -> None:
            entry, sha = self._lookup(repo, rev, body)
            if entry is None:
                return
            files = entry["files"]
            if kind in hub.broken:
                self._error(*hub.broken[kind], body)
            elif kind == "revision":
                data = {"id": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files]}
            elif kind == "tree":
                data = [
                    {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for f, b in files.items()
                ]
            else:
                self._error(404, "EntryNotFound", body)
            if kind in hub.broken or kind not in ("revision", "tree"):
                return
            self._send(200, json.dumps(data).encode(), {"X-Repo-Commit": sha}, body)

        def _file(self, repo: str, rev: str, name: str, body: bool) -> None:
            entry, sha = self._lookup(repo, rev, body)
            if entry is None:
                return
            if name not in entry["files"]:
                self._error(404, "EntryNotFound", body)
                return
            data = entry["files"][name]
            etag = f'"{hashlib.sha1(data).hexdigest()}"'
            self._send(200, data, {"X-Repo-Commit": sha, "ETag": etag}, body)

        def _error(self, status: int, code: str | None, body: bool) -> None:
            message = json.dumps({"error": code or "Not Found"}).encode()
            self._send(status, message, {"X-Error-Code": code} if code else {}, body)

        def _send(self, status: int, data: bytes, headers: dict, body: bool) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler
