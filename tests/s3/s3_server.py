"""A real S3 server for the tests: moto's server on 127.0.0.1, the fixture
stores uploaded to a bucket, and a fault-injecting proxy in front of it.

As a module (pytest)::

    server = start({"v3_basic.zarr": path}, bucket="fixtures")
    server.endpoint, server.proxy_endpoint          # http://127.0.0.1:PORT
    server.proxy.configure(latency_ms=100, fault="503", first_n=2)
    server.proxy.stats()                            # {"requests": ..., "faults": {...}, ...}
    server.stop()

As a program (the Rust tests spawn it)::

    python tests/s3/s3_server.py --bucket fixtures --upload-dir-contents tests/fixtures/data

prints one JSON line (``endpoint``, ``proxy``, ``bucket``, ``access_key_id``,
``secret_access_key``, ``region``), then serves until its standard input
closes, it is killed, or ``--max-seconds`` pass. The proxy is configured
over HTTP at ``PROXY/__proxy__/config?latency_ms=...&fault=...`` (the same
keys as :meth:`FaultProxy.configure`), read at ``PROXY/__proxy__/stats``
and reset at ``PROXY/__proxy__/reset``; those paths are never forwarded.

Everything binds 127.0.0.1 and stops by itself.
"""

from __future__ import annotations

import argparse
import logging
import http.client
import json
import os
import pathlib
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
FAULTS = ("500", "503", "429", "reset", "truncate")
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class _Listener(ThreadingHTTPServer):
    """A threaded HTTP server whose listen backlog takes a client's burst
    of new connections (socketserver's default of 5 made the kernel drop
    the rest, so a client opening 64 connections at once saw at most ~16
    requests in flight)."""

    request_queue_size = 1024


class FaultProxy:
    """Forwards HTTP to ``upstream``, adding latency and failing requests.

    Which GETs fail (with ``fault``, one of 500, 503, 429 (S3 SlowDown),
    reset (the connection closed with no answer) or truncate (the status
    and full Content-Length, then half the body)): the first ``first_n`` of
    each path, every one whose path matches ``match`` (a regex), and a
    ``rate`` of the rest drawn from a generator seeded with ``seed``.
    """

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self._lock = threading.Lock()
        # When the link (see ``bandwidth_mb_s``) is free again.
        self._link_lock = threading.Lock()
        self._link_free = 0.0
        self.configure()
        self.reset()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                proxy._handle(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self._server = _Listener(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def configure(
        self,
        latency_ms: float = 0,
        fault: str = "503",
        first_n: int = 0,
        match: str | None = None,
        rate: float = 0.0,
        seed: int = 0,
        methods: str = "GET",
        bandwidth_mb_s: float = 0,
    ) -> None:
        """Sets the latency and faults (see the class docs) and the
        bandwidth of the link every answer's body goes through, shared by
        the answers being sent (MB/s; 0: unlimited, the default); the
        counts of ``first_n`` start again."""
        if not float(bandwidth_mb_s) >= 0:  # NaN included
            raise ValueError(f"bandwidth_mb_s must be at least 0, got {bandwidth_mb_s}")
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        with self._lock:
            self.latency = float(latency_ms) / 1000
            self.fault = fault
            self.first_n = int(first_n)
            self.match = re.compile(match) if match else None
            self.rate = float(rate)
            self.random = random.Random(int(seed))
            self.methods = {m.strip().upper() for m in methods.split(",")}
            self.bandwidth = float(bandwidth_mb_s) * 1e6
            self.seen: dict[str, int] = {}

    def reset(self) -> None:
        """Zeroes the statistics. Requests in flight from before (a
        previous test's background threads) are not counted after it, in
        flight or when they end."""
        with self._lock:
            self._generation = getattr(self, "_generation", 0) + 1
            self._stats = {
                "requests": 0,
                "methods": {},
                "lists": 0,
                "faults": {},
                "statuses": {},
                "bytes": 0,
                "max_in_flight": 0,
                "max_in_flight_by_method": {},
                "max_gets_in_flight_by_array": {},
                "gets_by_array": {},
            }
            self._in_flight = 0
            self._in_flight_by_method: dict[str, int] = {}
            self._gets_in_flight_by_array: dict[str, int] = {}

    def stats(self) -> dict:
        """Requests by method, LIST requests among them, faults by kind,
        the server's answers by status (``{"200": n, "304": m}``), body
        bytes sent, the GETs of each array (a chunk key's path without its
        chunk index, see :func:`array_of`), and the most requests seen in
        flight at once (in all, of each method, and GETs of each array)."""
        with self._lock:
            return json.loads(json.dumps(self._stats))

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _fault_for(self, method: str, path: str) -> str | None:
        with self._lock:
            if method not in self.methods:
                return None
            count = self.seen.get(path, 0)
            self.seen[path] = count + 1
            fail = (
                count < self.first_n
                or (self.match is not None and self.match.search(path) is not None)
                or (self.rate > 0 and self.random.random() < self.rate)
            )
            if fail:
                faults = self._stats["faults"]
                faults[self.fault] = faults.get(self.fault, 0) + 1
                return self.fault
            return None

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path
        if urlsplit(path).path.startswith("/__proxy__/"):
            self._control(request)
            return
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else None
        with self._lock:
            generation = self._generation
            self._stats["requests"] += 1
            methods = self._stats["methods"]
            methods[request.command] = methods.get(request.command, 0) + 1
            if "list-type=" in urlsplit(path).query:
                self._stats["lists"] += 1
            self._in_flight += 1
            self._stats["max_in_flight"] = max(self._stats["max_in_flight"], self._in_flight)
            by_method = self._in_flight_by_method
            by_method[request.command] = by_method.get(request.command, 0) + 1
            most = self._stats["max_in_flight_by_method"]
            most[request.command] = max(most.get(request.command, 0), by_method[request.command])
            array = array_of(urlsplit(path).path) if request.command == "GET" else None
            if array is not None:
                gets = self._gets_in_flight_by_array
                gets[array] = gets.get(array, 0) + 1
                most = self._stats["max_gets_in_flight_by_array"]
                most[array] = max(most.get(array, 0), gets[array])
                every = self._stats["gets_by_array"]
                every[array] = every.get(array, 0) + 1
        left = False

        def leave() -> None:
            # A request stops counting as in flight before its answer is
            # sent: a client that sends its next request as soon as one is
            # answered must not be seen with both in flight.
            nonlocal left
            if not left:
                left = True
                with self._lock:
                    if generation != self._generation:
                        return
                    self._in_flight -= 1
                    by_method = self._in_flight_by_method
                    by_method[request.command] = by_method.get(request.command, 0) - 1
                    if array is not None:
                        gets = self._gets_in_flight_by_array
                        gets[array] = gets.get(array, 0) - 1

        try:
            if self.latency:
                time.sleep(self.latency)
            fault = self._fault_for(request.command, urlsplit(path).path)
            if fault == "reset":
                leave()
                request.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                request.close_connection = True
                request.connection.close()
                return
            if fault in ("500", "503", "429"):
                payload = SLOW_DOWN if fault == "429" else f"injected {fault}".encode()
                leave()
                request.send_response(int(fault))
                request.send_header("Content-Length", str(len(payload)))
                request.end_headers()
                request.wfile.write(payload)
                return
            self._forward(request, body, truncate=fault == "truncate", answered=leave)
        finally:
            leave()

    def _forward(
        self, request: BaseHTTPRequestHandler, body: bytes | None, truncate: bool, answered
    ) -> None:
        """Sends the request upstream and its answer back, calling
        ``answered`` just before the answer is sent."""
        upstream = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
            upstream.request(request.command, request.path, body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
        finally:
            upstream.close()
        answered()
        with self._lock:
            statuses = self._stats["statuses"]
            statuses[str(answer.status)] = statuses.get(str(answer.status), 0) + 1
        request.send_response(answer.status, answer.reason)
        for key, value in answer.getheaders():
            if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                request.send_header(key, value)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        if request.command == "HEAD":
            return
        sent = data[: len(data) // 2] if truncate and data else data
        self._send(request.wfile, sent)
        with self._lock:
            self._stats["bytes"] += len(sent)
        if truncate and data:
            request.wfile.flush()
            request.close_connection = True
            request.connection.shutdown(socket.SHUT_RDWR)

    def _send(self, out, data: bytes) -> None:
        """Writes ``data`` through the link: at once without a bandwidth,
        else 64 KiB at a time, each piece sent when the link has carried
        it after the pieces of every answer reserved before (answers sent
        at once share the bandwidth, as on a slow network)."""
        rate = self.bandwidth
        if not rate:
            out.write(data)
            return
        piece = 1 << 16
        for start in range(0, len(data), piece):
            part = data[start : start + piece]
            with self._link_lock:
                done = max(time.monotonic(), self._link_free) + len(part) / rate
                self._link_free = done
            delay = done - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            out.write(part)

    def _control(self, request: BaseHTTPRequestHandler) -> None:
        url = urlsplit(request.path)
        status, answer = 200, {}
        try:
            if url.path == "/__proxy__/config":
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                self.configure(**query)
            elif url.path == "/__proxy__/reset":
                self.reset()
            elif url.path == "/__proxy__/stats":
                answer = self.stats()
            else:
                status, answer = 404, {"error": f"unknown control path {url.path}"}
        except (TypeError, ValueError) as e:
            status, answer = 400, {"error": str(e)}
        payload = json.dumps(answer).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(payload)))
        request.end_headers()
        request.wfile.write(payload)


CHUNK_INDEX = re.compile(r"^(c|\d+(\.\d+)*)$")


def array_of(path: str) -> str:
    """The array a request's path reads: the path without its chunk index
    (``/bucket/store.zarr/v/c/0/1`` and ``/bucket/store.zarr/v/0.1`` are
    ``/bucket/store.zarr/v``)."""
    parts = path.rstrip("/").split("/")
    while len(parts) > 1 and CHUNK_INDEX.match(parts[-1]):
        parts.pop()
    return "/".join(parts)


class Server:
    """An S3 server (moto's, or ``backend="s3s"``: the s3s-fs binary serving
    a directory), a bucket with the uploaded stores, and the proxy.

    moto is Python and spends ~12 ms of CPU per GET, on the machine's own
    cores: the benchmarks can use s3s-fs (Rust, ``cargo install s3s-fs
    --features binary``; its path in ``ZARRFUSION_S3S_FS`` or on ``PATH``),
    to which stores are "uploaded" as hard links (copies across file
    systems)."""

    def __init__(self, bucket: str, backend: str = "moto"):
        self.bucket = bucket
        self._moto = self._s3s = self._root = None
        if backend == "moto":
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self._moto.start()
            host, port = self._moto.get_host_and_port()
        elif backend == "s3s":
            host, port = self._start_s3s()
        else:
            raise ValueError(f"backend: {backend!r} is not 'moto' or 's3s'")
        self.endpoint = f"http://{host}:{port}"
        self.proxy = FaultProxy((host, port))
        self.proxy_endpoint = self.proxy.endpoint
        self.client().create_bucket(Bucket=bucket)

    def client(self):
        """A boto3 S3 client of the server (not through the proxy)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def _start_s3s(self) -> tuple[str, int]:
        """Starts s3s-fs on a free port of 127.0.0.1 over a fresh directory."""
        binary = os.environ.get("ZARRFUSION_S3S_FS") or shutil.which("s3s-fs")
        if not binary:
            raise RuntimeError("backend 's3s': no s3s-fs binary (cargo install s3s-fs --features binary; "
                               "ZARRFUSION_S3S_FS=path)")
        self._root = pathlib.Path(tempfile.mkdtemp(prefix="zarrfusion-s3s-"))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self._s3s = subprocess.Popen(
            [binary, "--host", "127.0.0.1", "--port", str(port), "--access-key", ACCESS_KEY,
             "--secret-key", SECRET_KEY, str(self._root)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return "127.0.0.1", port
            except OSError:
                if self._s3s.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"s3s-fs did not start on port {port}") from None
                time.sleep(0.05)

    def upload(self, name: str, directory: pathlib.Path) -> None:
        """Uploads every file under ``directory`` (dotfiles too) to ``name/...``."""
        if self._root is not None:
            def link(src, dst):
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)

            shutil.copytree(directory, self._root / self.bucket / name, copy_function=link)
            return
        client = self.client()
        for path in sorted(pathlib.Path(directory).rglob("*")):
            if path.is_file():
                key = f"{name}/{path.relative_to(directory).as_posix()}"
                client.put_object(Bucket=self.bucket, Key=key, Body=path.read_bytes())

    def keys(self, prefix: str) -> list[str]:
        """The keys under ``prefix`` in the bucket."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def download(self, prefix: str, into: pathlib.Path) -> pathlib.Path:
        """Copies every object under ``prefix/`` into the directory ``into``."""
        client = self.client()
        for key in self.keys(prefix + "/"):
            path = into / key[len(prefix) + 1 :]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(client.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        return into

    def options(self, through_proxy: bool = True, **extra: str) -> dict[str, str]:
        """zarrfusion table options reaching this server."""
        options = {
            "aws.endpoint": self.proxy_endpoint if through_proxy else self.endpoint,
            "aws.allow_http": "true",
            "aws.access_key_id": ACCESS_KEY,
            "aws.secret_access_key": SECRET_KEY,
            "aws.region": REGION,
        }
        options.update(extra)
        return options

    def stop(self) -> None:
        if getattr(self, "proxy", None) is not None:
            self.proxy.stop()
        if self._moto is not None:
            self._moto.stop()
        if self._s3s is not None:
            self._s3s.terminate()
            try:
                self._s3s.wait(10)
            except subprocess.TimeoutExpired:
                self._s3s.kill()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)


def start(upload: dict[str, pathlib.Path] | None = None, bucket: str = "fixtures", backend: str = "moto") -> Server:
    """Starts the server (``backend`` ``"moto"`` or ``"s3s"``) and proxy, and
    uploads ``{name: directory}``."""
    server = Server(bucket, backend)
    for name, directory in (upload or {}).items():
        server.upload(name, directory)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bucket", default="fixtures")
    parser.add_argument("--upload", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--upload-dir-contents", action="append", default=[], metavar="DIR")
    parser.add_argument("--max-seconds", type=float, default=1800)
    args = parser.parse_args()
    uploads = {}
    for item in args.upload:
        name, _, directory = item.partition("=")
        uploads[name] = pathlib.Path(directory)
    for parent in args.upload_dir_contents:
        for child in sorted(pathlib.Path(parent).iterdir()):
            if child.is_dir():
                uploads[child.name] = child
    server = start(uploads, args.bucket)
    print(
        json.dumps(
            {
                "endpoint": server.endpoint,
                "proxy": server.proxy_endpoint,
                "bucket": args.bucket,
                "access_key_id": ACCESS_KEY,
                "secret_access_key": SECRET_KEY,
                "region": REGION,
            }
        ),
        flush=True,
    )
    # Serve until stdin closes (the parent went away) or time runs out.
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait(args.max_seconds)
    server.stop()


if __name__ == "__main__":
    main()
