"""Real servers on loopback for the streamed-shard tests and benchmarks/stream.py: an HTTP file
server with misbehaving paths, and moto's standalone S3 server (skipped when moto is absent)."""

from __future__ import annotations

import collections
import contextlib
import http.server
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

PREFIXES = ("/stall/", "/flaky/", "/cut/", "/chunked-cut/", "/bad-status/", "/redirect/", "/norange/")


class ShardHandler(http.server.SimpleHTTPRequestHandler):
    """Serves ``server.root``; paths under ``/stall/`` send headers then nothing until
    ``server.release`` is set, under ``/flaky/`` answer 500 to each file's first request, under
    ``/cut/`` send each body's first half and close (Content-Length says the whole); supports
    ``Range`` (``bytes=A-`` and ``bytes=A-B``) everywhere but under ``/norange/``, which answers
    the whole file, as Python's own server does. ``/chunked-cut/`` breaks a chunked body off
    mid-chunk, ``/bad-status/`` answers a malformed status line, ``/redirect/REST`` answers 302 to
    ``server.redirect_to``/REST. Every request's ``Authorization`` header is recorded in
    ``server.authorizations``, its ``Range`` header in ``server.ranges`` (path, header or None)."""

    def log_message(self, *args) -> None:  # quiet test output
        pass

    def translate_path(self, path: str) -> str:
        path = path.split("?", 1)[0]
        for prefix in PREFIXES:
            if path.startswith(prefix):
                path = "/" + path[len(prefix) :]
        return str(Path(self.server.root) / path.lstrip("/"))

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        server = self.server
        server.requests.append(self.path)
        server.authorizations.append((self.path, self.headers.get("Authorization")))
        server.ranges.append((self.path, self.headers.get("Range")))
        target = Path(self.translate_path(self.path))
        if self.path.startswith("/chunked-cut/") and target.is_file():
            # Transfer-Encoding: chunked, broken off inside a chunk: http.client's IncompleteRead.
            body = target.read_bytes()
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(f"{len(body):x}\r\n".encode() + body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        if self.path.startswith("/bad-status/"):  # a malformed status line: http.client's BadStatusLine
            self.wfile.write(b"HTTP/1.1 OK-ish\r\n\r\n")
            self.close_connection = True
            return
        if self.path.startswith("/redirect/"):  # to server.redirect_to + the rest of the path
            self.send_response(302)
            self.send_header("Location", server.redirect_to + "/" + self.path[len("/redirect/") :])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith("/flaky/") and self.path not in server.failed_once:
            server.failed_once.add(self.path)
            self.send_error(500, "try again")
            return
        if self.path.startswith("/stall/") and target.is_file():
            self.send_response(200)
            self.send_header("Content-Length", str(target.stat().st_size))
            self.end_headers()
            self.wfile.write(target.read_bytes()[:1024])
            self.wfile.flush()
            server.release.wait(60)
            return
        if self.path.startswith("/cut/") and target.is_file():
            self.send_cut(target)
            return
        if self.headers.get("Range") and not self.path.startswith("/norange/") and target.is_file():
            self.send_part(target)
            return
        super().do_GET()

    def requested_range(self, size: int) -> tuple[int, int]:
        """[start, end) of a ``Range: bytes=A-`` or ``bytes=A-B`` header (the whole file without one)."""
        first, _, last = self.headers.get("Range", "bytes=0-")[len("bytes=") :].partition("-")
        return int(first or 0), min(int(last) + 1, size) if last else size

    def send_part(self, target: Path) -> None:
        body = target.read_bytes()
        start, end = self.requested_range(len(body))
        if start >= len(body):
            self.send_error(416, "range not satisfiable")
            return
        self.send_response(206)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(body)}")
        self.end_headers()
        self.wfile.write(body[start:end])

    def send_cut(self, target: Path) -> None:
        body = target.read_bytes()
        start, end = self.requested_range(len(body))
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(end - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(body)}")
        self.end_headers()
        if start == 0:  # the first attempt breaks off half-way; a Range request gets the rest
            self.wfile.write(body[: end // 2])
            self.close_connection = True
            return
        self.wfile.write(body[start:end])


def make_server(root: Path, port: int = 0, log=list) -> http.server.ThreadingHTTPServer:
    """A threaded :class:`ShardHandler` server for ``root`` on 127.0.0.1:``port`` (0: any free
    port); ``log()`` makes each request log (``requests``, ``authorizations``, ``ranges``)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), ShardHandler)
    server.daemon_threads = True
    server.root, server.failed_once, server.redirect_to = str(root), set(), ""
    server.requests, server.authorizations, server.ranges = log(), log(), log()
    server.release = threading.Event()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    return server


def serve(root: Path, port: int) -> None:
    """Serve ``root`` on 127.0.0.1:``port`` until killed (a server that answers ``Range``, as nginx
    and object stores do, for benchmarks run in its own process; bounded request logs)."""
    make_server(root, port, log=lambda: collections.deque(maxlen=1000)).serve_forever()


@contextlib.contextmanager
def http_server(root: Path):
    """A threaded HTTP server on 127.0.0.1 serving ``root``; yields its base URL's server object
    (``.url``, ``.requests``, ``.release``)."""
    server = make_server(root)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def moto_available() -> bool:
    """Whether boto3, s3fs and moto's server (flask, flask-cors) are installed. Looked up, not
    imported: importing them costs ~1 s in every worker at collection, for a skip mark."""
    return all(importlib.util.find_spec(name) for name in ("boto3", "s3fs", "moto", "flask", "flask_cors"))


@contextlib.contextmanager
def s3_server(bucket: str, files: dict[str, Path]):
    """moto's standalone S3 server on loopback with ``bucket`` holding ``files`` ({key: path});
    sets the AWS environment (dummy credentials, AWS_ENDPOINT_URL) while it runs."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    environment = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    saved = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)
    try:
        wait_for_port(port, process)
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=bucket)
        for key, path in files.items():
            client.upload_file(str(path), bucket, key)
        yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        process.terminate()
        process.wait(timeout=30)


def wait_for_port(port: int, process, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("moto's server exited at start")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError("moto's server did not start")


def copy_truncated(source: Path, target: Path, keep: float = 0.5) -> Path:
    """A copy of the tar ``source`` cut at ``keep`` of its bytes (mid-member)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    data = source.read_bytes()
    target.write_bytes(data[: int(len(data) * keep) + 100])
    return target


def copy_tree(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target
