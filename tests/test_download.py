"""URL tables: clipkit.data.download against a real HTTP server on 127.0.0.1 (no mocks, no internet).

Each test starts a ``ThreadingHTTPServer`` on an ephemeral loopback port whose handler serves real
PNG/JPEG bytes and every failure a download can meet (404, 500s, a stall, a short body, HTML, 429,
oversized bodies, redirects); the server counts attempts and concurrent requests itself.
"""

import contextlib
import io
import json
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from PIL import Image

from clipkit import __version__
from clipkit.app import api
from clipkit.data.download import (
    DEFAULT_USER_AGENT,
    Downloader,
    DownloadError,
    resize_image,
    retry_after_seconds,
)
from clipkit.data.shard import ShardSource, read_manifest
from clipkit.errors import DataError
from clipkit.plugins.sources.file_sources import TableSource, open_file_source

#: How long the stalling endpoint (/slow) holds a request unless the test releases it first: only a
#: safety net; tests never measure durations against it (a loaded machine stretches every duration).
STALL_LIMIT_SECONDS = 60.0


def encode(size: tuple[int, int], colour: tuple[int, int, int], image_format: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=image_format)
    return buffer.getvalue()


#: name -> bytes; sizes differ so resize has something to do (and some images are already small).
IMAGES = {
    "wide.png": encode((40, 20), (200, 10, 10), "PNG"),
    "tall.jpg": encode((16, 48), (10, 200, 10), "JPEG"),
    "square.png": encode((30, 30), (10, 10, 200), "PNG"),
    "tiny.jpg": encode((6, 4), (90, 90, 90), "JPEG"),
}


class ServerState:
    """What the server saw: attempts per path, in-flight high-water mark, headers, start times."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts: dict[str, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.user_agents: list[str] = []
        self.starts: list[float] = []
        # Set when the test is done with the stalling endpoint: until then /slow answers nothing, so
        # a client that gave up did so on its own timeout, never on the server's answer.
        self.release_stalled = threading.Event()

    def count(self, path: str) -> int:
        with self.lock:
            self.attempts[path] = self.attempts.get(path, 0) + 1
            self.starts.append(time.monotonic())
            return self.attempts[path]


class Handler(BaseHTTPRequestHandler):
    """Routes: /img/NAME, /404, /flaky/ID?fails=N, /always500/ID, /slow, /truncated, /html,
    /429/ID?after=S, /probe/ID, /big, /big-unsized, /redirect-img, /redirect-file."""

    state: ServerState  # set per server (subclass) by the fixture

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def send_body(self, body: bytes, *, status: int = 200, content_type: str = "image/png", length=None):
        # The client may have given up already (the timeout tests): nothing to report then.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if length is not False:
                self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            self.wfile.write(body)

    def do_GET(self) -> None:  # one branch per route
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        route, _, rest = parts.path.strip("/").partition("/")
        attempt = self.state.count(self.path)
        with self.state.lock:
            self.state.user_agents.append(self.headers.get("User-Agent", ""))
        if route == "img" and rest in IMAGES:
            self.send_body(IMAGES[rest])
        elif route == "flaky" and attempt <= int(query["fails"]):
            self.send_error(500)
        elif route == "flaky":
            self.send_body(IMAGES["square.png"])
        elif route == "always500":
            self.send_error(500)
        elif route == "slow":
            self.state.release_stalled.wait(STALL_LIMIT_SECONDS)
            self.send_body(IMAGES["square.png"])
        elif route == "truncated":  # promises 500 bytes more than it sends, then closes
            self.send_body(IMAGES["wide.png"][:-10], length=len(IMAGES["wide.png"]) + 490)
        elif route == "html":
            self.send_body(b"<html><body>not an image</body></html>", content_type="text/html")
        elif route == "429" and attempt == 1:
            self.send_response(429)
            self.send_header("Retry-After", query["after"])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif route == "429":
            self.send_body(IMAGES["wide.png"])
        elif route == "probe":
            with self.state.lock:
                self.state.in_flight += 1
                self.state.max_in_flight = max(self.state.max_in_flight, self.state.in_flight)
            time.sleep(0.1)
            with self.state.lock:
                self.state.in_flight -= 1
            self.send_body(IMAGES["tiny.jpg"], content_type="image/jpeg")
        elif route == "big":
            self.send_body(bytes(5000))
        elif route == "big-unsized":  # no Content-Length: the body ends when the connection closes
            self.send_body(bytes(5000), length=False)
        elif route == "redirect-img":
            self.send_response(302)
            self.send_header("Location", "/img/wide.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif route == "redirect-file":
            self.send_response(302)
            self.send_header("Location", "file:///etc/hostname")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_error(404)


@pytest.fixture
def server(monkeypatch):
    """(base URL, ServerState) of a fresh loopback server; proxies from the environment bypassed."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    state = ServerState()
    handler = type("BoundHandler", (Handler,), {"state": state})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True  # a stalled handler must not hold up the test's teardown
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}", state
    finally:
        state.release_stalled.set()  # let stalled handlers finish before the server closes
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def fast(**settings) -> Downloader:
    """A downloader with test-sized timing: short timeout, tiny backoff."""
    # 1 s: loopback answers in milliseconds, but a loaded 2-core CI box can stall a thread for longer.
    return Downloader(**{"timeout": 1.0, "retries": 2, "backoff": 0.01, **settings})


def failure(downloader: Downloader, url: str) -> DownloadError:
    with pytest.raises(DownloadError) as caught:
        downloader.fetch(url)
    return caught.value


# --------------------------------------------------------------------------------------------
# Downloader.fetch


def test_images_come_back_byte_for_byte_with_a_clipkit_user_agent(server):
    base, state = server
    downloader = fast()
    for name, data in IMAGES.items():
        assert downloader.fetch(f"{base}/img/{name}") == data
    assert downloader.fetch(f"{base}/redirect-img") == IMAGES["wide.png"]
    assert DEFAULT_USER_AGENT.startswith(f"clipkit/{__version__} ")
    assert set(state.user_agents) == {DEFAULT_USER_AGENT}


def test_a_404_is_final_at_once(server):
    base, state = server
    error = failure(fast(retries=3), f"{base}/404")
    assert error.reason == "http_404"
    assert state.attempts == {"/404": 1}  # 4xx other than 408/429 are never retried


def test_server_errors_are_retried_until_they_pass(server):
    base, state = server
    url = f"{base}/flaky/a?fails=2"
    assert fast(retries=2).fetch(url) == IMAGES["square.png"]
    assert state.attempts["/flaky/a?fails=2"] == 3


def test_persistent_server_errors_give_up_after_the_retries(server):
    base, state = server
    error = failure(fast(retries=2), f"{base}/always500/x")
    assert error.reason == "http_500"
    assert "after 3 attempts" in error.detail
    assert state.attempts["/always500/x"] == 3
    error = failure(fast(retries=0), f"{base}/always500/y")
    assert state.attempts["/always500/y"] == 1


def test_a_stalled_server_times_out(server):
    """The server holds /slow until the test releases it, so the order proves the timeout: the client
    gave up (twice) while both requests were still unanswered. The lower bound is safe under load
    (a socket timeout never fires early); there is deliberately no upper bound on the duration."""
    base, state = server
    started = time.monotonic()
    error = failure(fast(timeout=0.3, retries=1), f"{base}/slow")
    elapsed = time.monotonic() - started
    assert not state.release_stalled.is_set()  # nothing was answered: the client timed out itself
    assert error.reason == "timeout"
    assert state.attempts["/slow"] == 2
    assert elapsed >= 0.6  # two 0.3 s waits


def test_a_body_shorter_than_its_content_length_is_a_failed_download(server):
    base, state = server
    error = failure(fast(retries=1), f"{base}/truncated")
    assert error.reason == "download_failed"
    assert "body ended after" in error.detail
    assert state.attempts["/truncated"] == 2  # a cut connection is worth another try


def test_bodies_over_max_bytes_are_refused_with_or_without_content_length(server):
    base, state = server
    downloader = fast(max_bytes=4096)
    assert failure(downloader, f"{base}/big").reason == "too_large"
    assert failure(downloader, f"{base}/big-unsized").reason == "too_large"
    assert state.attempts == {"/big": 1, "/big-unsized": 1}
    assert len(fast(max_bytes=5000).fetch(f"{base}/big-unsized")) == 5000


class RecordedSleeps:
    """Stands in for the ``time`` module inside clipkit.data.download: sleeps are recorded, not slept,
    so the waits the downloader chose are checked exactly, whatever the load on the machine."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []
        self.monotonic, self.time = time.monotonic, time.time

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


def test_retry_after_is_honoured_and_capped(server, monkeypatch):
    base, state = server
    clock = RecordedSleeps()
    monkeypatch.setattr("clipkit.data.download.time", clock)
    assert fast(backoff=0).fetch(f"{base}/429/a?after=1") == IMAGES["wide.png"]
    assert clock.sleeps == [1.0]  # the server's Retry-After, not the (zero) backoff
    clock.sleeps.clear()
    assert fast(backoff=0, retry_after_cap=0.2).fetch(f"{base}/429/b?after=3600") == IMAGES["wide.png"]
    assert clock.sleeps == [0.2]  # an hour asked, the cap granted
    assert state.attempts["/429/a?after=1"] == state.attempts["/429/b?after=3600"] == 2


def test_retry_after_header_forms():
    assert retry_after_seconds("7") == 7.0
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds("-5") == 0.0
    # RFC 9110's HTTP-date form: 1994-11-06 08:49:37 UTC is 784111777 in Unix time.
    assert retry_after_seconds("Sun, 06 Nov 1994 08:49:37 GMT", now=784111777 - 30) == 30.0


def test_only_http_urls_are_fetched(server, tmp_path):
    base, _ = server
    local = tmp_path / "secret.png"
    local.write_bytes(IMAGES["wide.png"])
    downloader = fast()
    for url in (local.as_uri(), str(local), "ftp://127.0.0.1/x.png", "http:///nohost.png"):
        assert failure(downloader, url).reason == "bad_url", url
    error = failure(downloader, f"{base}/redirect-file")
    assert error.reason == "bad_url" and "file:///etc/hostname" in error.detail


def test_connection_refused_is_a_failed_download():
    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as httpd:
        port = httpd.server_port  # bound then closed: nothing listens there any more
    error = failure(fast(retries=1), f"http://127.0.0.1:{port}/img/wide.png")
    assert error.reason == "download_failed"


def test_backoff_doubles_with_reproducible_jitter():
    downloader = Downloader(backoff=1.0, backoff_cap=5.0, seed=3)
    delays = [downloader.backoff_delay("http://h/x", attempt) for attempt in range(5)]
    assert delays == [Downloader(backoff=1.0, backoff_cap=5.0, seed=3).backoff_delay("http://h/x", a)
                      for a in range(5)]  # fmt: skip
    for attempt, delay in enumerate(delays):
        base = min(2.0**attempt, 5.0)
        assert 0.5 * base <= delay < 1.5 * base
    assert delays != [Downloader(backoff=1.0, backoff_cap=5.0, seed=4).backoff_delay("http://h/x", a)
                      for a in range(5)]  # fmt: skip
    plain = Downloader(backoff=0.5, backoff_cap=3.0, jitter=False)
    assert [plain.backoff_delay("u", a) for a in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_the_downloader_pickles_and_still_works(server):
    base, _ = server
    downloader = fast(per_host=3, user_agent="clipkit-test/1")
    downloader.fetch(f"{base}/img/tiny.jpg")  # creates the lock, a semaphore and the opener
    copy = pickle.loads(pickle.dumps(downloader))
    assert copy == downloader and copy.info() == downloader.info()
    assert copy.fetch(f"{base}/img/tiny.jpg") == IMAGES["tiny.jpg"]


def test_options_from_the_command_line_are_parsed_and_checked():
    downloader = Downloader.from_options(
        {"timeout": "2.5", "retries": "0", "per_host": "8", "user_agent": "x/1"}
    )
    assert (downloader.timeout, downloader.retries, downloader.per_host) == (2.5, 0, 8)
    assert downloader.user_agent == "x/1" and downloader.max_bytes == 50 * 1024 * 1024
    with pytest.raises(DataError, match="retries"):
        Downloader.from_options({"retries": "many"})
    with pytest.raises(DataError, match="per_host=0"):
        Downloader.from_options({"per_host": "0"})


def test_min_interval_spaces_the_requests_to_a_host(server, monkeypatch):
    """Four concurrent fetches to one host book their start times min_interval apart. The booked
    times are read where the downloader books them, so the check is exact on a loaded machine (the
    server's arrival times carry the scheduling noise of a busy 2-core box: 26 ms once)."""
    base, state = server
    downloader = fast(per_host=4, min_interval=0.1)
    booked, serial, reserve = [], threading.Lock(), Downloader.reserve_start

    def recording(self, host):
        with serial:  # one booking at a time, so the one just made is the one read back
            wait = reserve(self, host)
            booked.append(self._state["next_start"][host] - self.min_interval)
        return wait

    monkeypatch.setattr(Downloader, "reserve_start", recording)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(downloader.fetch, [f"{base}/img/tiny.jpg"] * 4))
    gaps = [later - earlier for earlier, later in zip(booked, booked[1:], strict=False)]
    assert len(booked) == 4 and len(state.starts) == 4
    assert min(gaps) >= 0.1 - 1e-9


# --------------------------------------------------------------------------------------------
# URL tables


def url_table(path, urls: list[str]):
    rows = [{"url": url, "caption": f"image {i}", "row": i} for i, url in enumerate(urls)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("per_host, bound", [(2, "at_most"), (8, "more_than")])
def test_per_host_limits_concurrent_connections(server, tmp_path, per_host, bound):
    base, state = server
    table = url_table(tmp_path / "t.jsonl", [f"{base}/probe/{i}" for i in range(16)])
    source = TableSource(table, image_column="url", workers=8, download=fast(per_host=per_host))
    samples = list(source)
    assert [s.key for s in samples] == [str(i) for i in range(16)]
    assert sum(state.attempts.values()) == 16
    if bound == "at_most":
        assert state.max_in_flight <= 2
    else:
        assert state.max_in_flight > 2


# Row URL (path under the server) -> the reason it is skipped, or None for a good row.
TABLE_ROWS = [
    ("/img/wide.png", None), ("/404", "http_404"), ("/img/tall.jpg", None), ("/always500/a", "http_500"),
    ("/img/square.png", None), ("/html", "bad_image"), ("/img/tiny.jpg", None), ("/slow", "timeout"),
    ("/flaky/a?fails=1", None), ("/truncated", "download_failed"), ("/big", "too_large"),
    ("/img/wide.png", None), ("/redirect-file", "bad_url"), ("/img/tall.jpg", None), ("/404", "http_404"),
    ("/redirect-img", None), ("/always500/b", "http_500"), ("/img/square.png", None),
    ("/flaky/b?fails=1", None), ("/img/tiny.jpg", None), ("/gone/1", "http_404"), ("/img/wide.png", None),
    ("/429/a?after=0", None), ("/img/tall.jpg", None), ("/img/square.png", None), ("/html", "bad_image"),
    ("/img/tiny.jpg", None), ("/img/wide.png", None), ("/flaky/c?fails=5", "http_500"),
    ("/img/tall.jpg", None),
]  # fmt: skip
SERVED = {"/flaky/a?fails=1": "square.png", "/flaky/b?fails=1": "square.png", "/redirect-img": "wide.png",
          "/429/a?after=0": "wide.png"}  # fmt: skip
URL_OPTIONS = {"timeout": "2.5", "retries": "1", "backoff": "0.01", "per_host": "8", "max_bytes": "4096"}


def expected_table(base: str) -> tuple[list[str], list[tuple[int, bytes]], dict[str, int]]:
    """(urls, [(row, served bytes)] of the good rows, skip counts by reason)."""
    urls = [base + path for path, _ in TABLE_ROWS]
    good = [(i, IMAGES[SERVED.get(path) or path.rsplit("/", 1)[1]])
            for i, (path, reason) in enumerate(TABLE_ROWS) if reason is None]  # fmt: skip
    skipped: dict[str, int] = {}
    for _, reason in TABLE_ROWS:
        if reason:
            skipped[reason] = skipped.get(reason, 0) + 1
    return urls, good, skipped


def test_a_url_table_shards_good_rows_in_order_and_counts_failures(server, tmp_path):
    base, _ = server
    urls, good, skipped = expected_table(base)
    table = url_table(tmp_path / "urls.jsonl", urls)
    manifest = api.shard(str(table), tmp_path / "shards", options={**URL_OPTIONS, "workers": "8"})
    assert len(TABLE_ROWS) == 30 and manifest["n"] == len(good) == 18
    info = read_manifest(tmp_path / "shards")["info"]
    assert info["skipped"] == skipped
    assert info["download"]["timeout"] == 2.5 and info["download"]["per_host"] == 8
    samples = list(ShardSource(tmp_path / "shards"))
    assert [s.meta["row"] for s in samples] == [row for row, _ in good]  # table order
    assert [s.image for s in samples] == [data for _, data in good]  # bytes as served
    assert [s.captions for s in samples] == [(f"image {row}",) for row, _ in good]


def test_url_tables_default_to_16_workers_and_strict_names_the_row(server, tmp_path):
    base, _ = server
    table = url_table(tmp_path / "urls.jsonl", [f"{base}/img/wide.png", f"{base}/404"])
    assert open_file_source(str(table) + "?image=url", URL_OPTIONS).workers == 16
    assert open_file_source(str(table) + "?image=url", {**URL_OPTIONS, "workers": "3"}).workers == 3
    strict = open_file_source(str(table) + "?image=url", {**URL_OPTIONS, "strict": "true"})
    with pytest.raises(DataError, match=r"urls\.jsonl: line 2: http_404: .*/404"):
        list(strict)


def test_resize_on_write_downscales_the_shorter_side_and_keeps_the_format(server, tmp_path):
    base, _ = server
    names = list(IMAGES)
    table = url_table(tmp_path / "urls.jsonl", [f"{base}/img/{name}" for name in names])
    api.shard(str(table), tmp_path / "shards", options={**URL_OPTIONS, "resize": "10"})
    assert read_manifest(tmp_path / "shards")["info"]["resize"] == 10
    for name, sample in zip(names, ShardSource(tmp_path / "shards"), strict=True):
        with (
            Image.open(io.BytesIO(IMAGES[name])) as original,
            Image.open(io.BytesIO(sample.image)) as resized,
        ):
            assert resized.format == original.format and sample.image_ext == name.rsplit(".", 1)[1]
            if min(original.size) <= 10:
                assert sample.image == IMAGES[name]  # never upscaled: bytes untouched
                continue
            assert min(resized.size) == 10
            assert max(resized.size) == round(max(original.size) * 10 / min(original.size))
            assert (resized.width >= resized.height) == (original.width >= original.height)


def test_resize_image_keeps_jpeg_quality_exif_and_png_transparency():
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: the tag must survive, or the resized photo turns sideways
    buffer = io.BytesIO()
    Image.new("RGB", (300, 200), (120, 30, 60)).save(buffer, format="JPEG", exif=exif)
    with Image.open(io.BytesIO(resize_image(buffer.getvalue(), 50))) as small:
        assert small.format == "JPEG" and small.size == (75, 50)
        assert small.getexif()[0x0112] == 6
        assert max(abs(a - b) for a, b in zip(small.getpixel((30, 20)), (120, 30, 60), strict=True)) <= 4
    palette = Image.new("P", (64, 32), 1)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG", transparency=0)
    with Image.open(io.BytesIO(resize_image(buffer.getvalue(), 8))) as small:
        assert small.format == "PNG" and small.size == (16, 8) and small.mode == "RGBA"
        assert small.getpixel((8, 4)) == (255, 0, 0, 255)


def test_credentials_in_a_url_are_refused_without_printing_the_password(server):
    """``http://user:pass@host/...`` failed as "Name or service not known" (urllib took
    ``user:pass@host`` for the host name): refused, saying why, and the password is never shown."""
    base, state = server
    host = base.removeprefix("http://")
    for url in (f"http://alice:s3cret@{host}/img/wide.png", f"https://alice:s3cret@{host}/img/wide.png"):
        error = failure(fast(), url)
        assert error.reason == "bad_url" and "credentials" in error.detail, error.detail
        assert "s3cret" not in str(error) and "s3cret" not in error.detail and "alice" not in str(error)
        assert "Name or service" not in str(error)
    assert state.attempts == {}  # nothing was sent


def test_a_table_names_the_row_and_the_unsupported_scheme_or_the_credentials(server, tmp_path):
    """An ``ftp://`` cell was read as a local path ("image .../ftp:/host/x.png cannot be read",
    counted as missing_image): it is a ``bad_url`` naming the row and the scheme, as a URL with
    credentials is (without the password)."""
    base, _ = server
    host = base.removeprefix("http://")
    said = {
        "ftp://127.0.0.1/x.png": r"ftp://127\.0\.0\.1/x\.png: ftp:// URLs are not downloaded \(only http",
        "FTP://example.org/y.png": r"FTP://example\.org/y\.png: ftp:// URLs are not downloaded",
        "file:///etc/hostname": r"file:///etc/hostname: file:// URLs are not downloaded",
        f"http://bob:hunter2@{host}/img/tall.jpg": rf"http://{host}/img/tall\.jpg: .*credentials",
    }
    table = url_table(tmp_path / "urls.jsonl", [f"{base}/img/wide.png", *said])
    source = open_file_source(str(table), URL_OPTIONS)
    assert [s.key for s in source] == ["0"] and source.skipped == {"bad_url": 4}
    for cell, message in said.items():
        table = url_table(tmp_path / "one.jsonl", [f"{base}/img/wide.png", cell])
        with pytest.raises(DataError, match=rf"one\.jsonl: line 2: bad_url: {message}") as caught:
            list(open_file_source(str(table), {**URL_OPTIONS, "strict": "true"}))
        assert "hunter2" not in str(caught.value) and "bob" not in str(caught.value)
        assert str(caught.value).count("line 2") == 1  # the row is named once
