"""Opening one shard where it lives: a local file, ``http(s)://``, ``pipe:COMMAND`` or an fsspec URL
(``s3://``, ``gs://``, ``hf://``, ...), as a readable binary stream.

Transient failures (connection errors, timeouts, HTTP 408/429/5xx) are retried with exponential
back-off (:class:`Patience`), and an HTTP body broken off mid-way is continued with a ``Range``
request, so a flaky link costs time, not samples. Every read has a timeout, so a stalled server
or a stalled ``pipe:`` command fails the shard (:class:`ShardUnavailable`) instead of hanging the
run. Credentials come from each backend's usual place (``~/.netrc`` for HTTP, the AWS / Google
environment and config files for fsspec); a URL carrying ``user:password@`` is refused, and URLs
are shown with their query values hidden (:func:`redact`), so no secret reaches a log.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import os
import random
import re
import select
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from clipkit import __version__, install_hint
from clipkit.errors import ClipkitError, redact_text

HTTP_SCHEMES = ("http", "https")
#: fsspec protocols -> the package that provides them (the error says which to install).
FSSPEC_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "hf": "huggingface_hub",
    "az": "adlfs",
    "abfs": "adlfs",
}
#: The clipkit extra that installs each package (pyproject.toml).
EXTRAS = {"s3fs": "s3", "gcsfs": "gcs"}
TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
#: Every exception class reading a stream can raise besides ShardUnavailable: sockets and files
#: (OSError, timeouts), the HTTP protocol (IncompleteRead, BadStatusLine, LineTooLong: not
#: OSErrors), URL parsing (ValueError), ``pipe:`` processes (TimeoutExpired) and an archive ending
#: early (EOFError). Readers turn each into a ShardUnavailable, so the retry/skip policy sees them.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    EOFError,
    ValueError,
    http.client.HTTPException,
    subprocess.SubprocessError,
)


class ShardUnavailable(Exception):
    """A shard that could not be read (after the retries); ``reason`` is the counter's name."""

    def __init__(self, url: str, reason: str, detail: str) -> None:
        super().__init__(f"{redact(url)}: {detail}")
        self.url, self.reason, self.detail = url, reason, detail


@dataclass(frozen=True)
class Patience:
    """How long to wait for a shard: ``timeout`` seconds per connect / read, ``retries`` extra
    attempts after a transient failure, waiting ``backoff · 2^attempt`` (capped, jittered)."""

    timeout: float = 30.0
    retries: int = 3
    backoff: float = 1.0
    max_delay: float = 30.0

    def delay(self, attempt: int, url: str) -> float:
        # Jitter seeded by the URL: reproducible, yet ranks retrying one server do not stampede.
        jitter = random.Random(f"{url}:{attempt}").uniform(0.5, 1.0)
        return min(self.backoff * 2.0 ** min(attempt, 64), self.max_delay) * jitter


OPENING = "cannot open"


def transport_fault(url: str, error: BaseException, doing: str = "") -> ShardUnavailable:
    """``error`` (one of :data:`TRANSPORT_ERRORS`) as the ShardUnavailable it is counted under."""
    if isinstance(error, ShardUnavailable):
        return error
    if isinstance(error, subprocess.TimeoutExpired) or timeout_or_unreachable(error) == "timeout":
        reason = "timeout"
    elif isinstance(error, http.client.HTTPException):
        reason = "broken_stream"
    elif isinstance(error, subprocess.SubprocessError):
        reason = "pipe_failed"
    elif isinstance(error, ValueError):  # at opening: the URL does not parse; later: bad data
        reason = "bad_url" if doing == OPENING else "broken_stream"
    else:
        reason = "unreachable"
    prefix = f"{doing}: " if doing else ""
    return ShardUnavailable(url, reason, f"{prefix}{type(error).__name__}: {redact_text(str(error))}")


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be parsed (a bad IPv6 host, a port that is not a number...), or None."""
    if scheme_of(url) in ("", "pipe"):
        return None
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port is the check (ValueError when it is no number)
    except ValueError as error:
        return f"{redact_text(url)} is not a valid URL ({error})"
    if scheme_of(url) in HTTP_SCHEMES and not parts.hostname:
        return f"{redact_text(url)} is not a valid URL (no host)"
    return None


def scheme_of(url: str) -> str:
    """``http``, ``s3``, ``pipe``, ... or ``""`` for a local path."""
    if url.startswith("pipe:"):
        return "pipe"
    if "://" in url:
        return url.split("://", 1)[0].lower()
    return ""


def redact(url: str) -> str:
    """``url`` safe to print: user info dropped, query values hidden (signed URLs carry tokens);
    the URLs inside a ``pipe:`` command are redacted the same way."""
    if scheme_of(url) in ("", "pipe"):
        return redact_text(url)
    try:
        parts = urlsplit(url)
    except ValueError:  # unparseable (a bad IPv6 host): hide everything after the path
        return url.split("?", 1)[0].split("#", 1)[0].rpartition("@")[2]
    netloc = parts.netloc.rpartition("@")[2]
    query = (
        "&".join(f"{item.partition('=')[0]}=***" for item in parts.query.split("&")) if parts.query else ""
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def check_url(url: str) -> None:
    """Refuse what would put a secret into the recipe, an unparseable URL, or a scheme no installed
    package reads."""
    scheme = scheme_of(url)
    if scheme in ("", "pipe", "file"):
        return
    problem = url_problem(url)
    if problem:
        raise ClipkitError(problem)
    secret = [key for key in query_keys(url) if SECRET_PARAMETER.search(key)]
    if secret:
        raise ClipkitError(
            f"{redact(url)}: the query parameter {secret[0]!r} looks like a credential, which would be saved "
            "in the run's recipe; give credentials the backend's usual way (~/.netrc, AWS_* / GOOGLE_* "
            "environment or config files)"
        )
    if "@" in urlsplit(url).netloc:
        raise ClipkitError(
            f"{redact(url)}: credentials in a URL would be saved in the run's recipe; give them the "
            "backend's usual way instead (~/.netrc for HTTP, AWS_* / GOOGLE_* environment or config files)"
        )
    if scheme in HTTP_SCHEMES:
        return
    fsspec_filesystem(url)


#: Query parameters that carry credentials (signed URLs, tokens, keys).
SECRET_PARAMETER = re.compile(r"signature|token|secret|password|credential|^sig$|^key$|apikey|api_key", re.I)


def query_keys(url: str) -> list[str]:
    return [item.partition("=")[0] for item in urlsplit(url).query.split("&") if item]


def fsspec_filesystem(url: str):
    """The fsspec file system class for ``url``'s protocol; a ClipkitError naming what to install."""
    scheme = scheme_of(url)
    package = FSSPEC_PACKAGES.get(scheme, f"the fsspec implementation of {scheme}://")
    extra = EXTRAS.get(package)
    how = f"{install_hint(extra)} (or pip install {package})" if extra else f"pip install {package}"
    try:
        import fsspec
    except ImportError:
        raise ClipkitError(
            f"{redact(url)}: reading {scheme}:// shards needs fsspec and {package}: {how}"
        ) from None
    try:
        return fsspec.get_filesystem_class(scheme)
    except ImportError:
        raise ClipkitError(f"{redact(url)}: reading {scheme}:// shards needs {package}: {how}") from None
    except ValueError:
        raise ClipkitError(f"{redact(url)}: no installed package reads {scheme}:// URLs") from None


def open_shard(url: str, patience: Patience = Patience(), start: int = 0, end: int | None = None):
    """A binary stream of the shard at ``url`` from byte ``start`` (close it when done);
    ShardUnavailable when it cannot be opened after the retries. ``end``: the byte it need not
    read past — HTTP asks for no more (a ``Range``); other streams are read up to it by the caller.
    A ``pipe:`` command starts at 0; a server that ignores ``Range`` raises :class:`RangeIgnored`."""
    scheme = scheme_of(url)
    if scheme == "pipe" and (start or end is not None):
        raise ValueError(f"a pipe: command is read from its start: {redact(url)}")
    if scheme == "":
        try:
            stream = open(url, "rb")  # noqa: SIM115 - the caller closes it
            stream.seek(start)
            return stream
        except OSError as error:
            raise ShardUnavailable(url, "unreachable", str(error)) from error
    if scheme == "file":
        return open_shard(urlsplit(url).path, patience, start, end)
    if scheme == "pipe":
        return PipeReader(url[len("pipe:") :], patience.timeout)
    if scheme in HTTP_SCHEMES:
        return HttpReader(url, patience, start, end)
    # A window with an end is fetched as asked (no read-ahead past it): a block cache would fetch
    # the next lane's bytes too.
    stream = open_fsspec(url, patience, cache_type="none" if end is not None else None)
    stream.seek(start)
    return stream


def stream_size(stream) -> int | None:
    """The whole file's bytes behind a stream :func:`open_shard` gave, where it says (a local file,
    an fsspec file, an HTTP response with a length); None otherwise."""
    if isinstance(stream, HttpReader):
        return stream.total
    size = getattr(stream, "size", None)  # fsspec
    if isinstance(size, int):
        return size
    try:
        return os.fstat(stream.fileno()).st_size
    except (OSError, AttributeError, io.UnsupportedOperation):
        return None


def read_small(url: str, patience: Patience = Patience()) -> bytes | None:
    """The whole (small) file at ``url`` — a manifest beside the shards — or None when it does not
    exist; other failures raise ShardUnavailable."""
    scheme = scheme_of(url)
    if scheme == "":
        return Path(url).read_bytes() if os.path.isfile(url) else None
    if scheme in HTTP_SCHEMES:
        try:
            with HttpReader(url, patience) as stream:
                return stream.read()
        except ShardUnavailable as error:
            if error.reason == "http_404" or error.reason == "http_403":
                return None
            raise
    filesystem = fsspec_filesystem(url)(**storage_options(url, patience))
    try:
        with filesystem.open(url, "rb") as stream:
            return stream.read()
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001 - backends raise their own types (botocore, aiohttp)
        raise ShardUnavailable(url, "unreachable", f"{type(error).__name__}: {error}") from error


def storage_options(url: str, patience: Patience) -> dict:
    """fsspec options giving the backend clipkit's timeouts and retries (credentials: its own)."""
    if scheme_of(url) in ("s3", "s3a"):
        config = {
            "connect_timeout": patience.timeout,
            "read_timeout": patience.timeout,
            "retries": {"max_attempts": patience.retries + 1, "mode": "standard"},
        }
        options: dict = {"config_kwargs": config}
        # AWS_ENDPOINT_URL is botocore's own variable; s3fs's aiobotocore may predate it.
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
        return options
    return {}


#: fsspec's block size for shards (one request per block), and the read size of a window fetched
#: without a cache (:func:`clipkit.data.tar_stream.window_records`).
FSSPEC_BLOCK = 8 << 20


def open_fsspec(url: str, patience: Patience, cache_type: str | None = None):
    """The object at ``url`` opened with fsspec (``cache_type``: the backend's default when None)."""
    filesystem = fsspec_filesystem(url)
    cache = {} if cache_type is None else {"cache_type": cache_type}
    last: Exception | None = None
    for attempt in range(patience.retries + 1):
        try:
            fs = filesystem(**storage_options(url, patience))
            return fs.open(url, "rb", block_size=FSSPEC_BLOCK, **cache)
        except FileNotFoundError as error:
            raise ShardUnavailable(url, "missing", "no such object") from error
        except PermissionError as error:
            raise ShardUnavailable(url, "forbidden", str(error)) from error
        except Exception as error:  # noqa: BLE001 - backends raise their own types (botocore, aiohttp)
            last = error
            if attempt < patience.retries:
                time.sleep(patience.delay(attempt, url))
    raise ShardUnavailable(url, "unreachable", f"{type(last).__name__}: {last}")


class RangeIgnored(ShardUnavailable):
    """The first request for part of a body was not answered with that part (the server ignores
    ``Range``, or the range lies past the end): the caller may read the whole body instead."""


class HttpReader(io.RawIOBase):
    """An HTTP(S) body as a stream: retried on transient failures, continued with ``Range`` after
    a break mid-way, every socket operation under ``patience.timeout``. ``start`` / ``end``: only
    bytes [start, end) of the body (``end`` None: to its end), asked for with ``Range``."""

    def __init__(self, url: str, patience: Patience, start: int = 0, end: int | None = None) -> None:
        self.url, self.patience = url, patience
        self.start, self.end = start, end
        self.offset, self.failures = start, 0
        self.total: int | None = None  # the whole body's bytes, when the response says
        self.response = self.connect()

    def readable(self) -> bool:
        return True

    def request(self) -> urllib.request.Request:
        headers = {"User-Agent": f"clipkit/{__version__}"}
        if self.ranged:
            headers["Range"] = f"bytes={self.offset}-{'' if self.end is None else self.end - 1}"
        try:
            request = urllib.request.Request(self.url, headers=headers)
        except ValueError as error:  # unparseable (validate refuses these; a plugin may not)
            raise transport_fault(self.url, error, OPENING) from None
        authorize(request)
        return request

    @property
    def ranged(self) -> bool:
        return bool(self.offset) or self.end is not None

    def connect(self):
        while True:
            try:
                response = OPENER.open(self.request(), timeout=self.patience.timeout)
                if self.ranged and response.status != 206:
                    response.close()  # the server ignores Range: the rest cannot be fetched alone
                    if self.offset == self.start:
                        raise RangeIgnored(self.url, "broken_stream", "the server ignores Range")
                    raise ShardUnavailable(
                        self.url, "broken_stream", "the connection broke and the server ignores Range"
                    )
                self.total = body_size(response)
                return response
            except urllib.error.HTTPError as error:
                reason = f"http_{error.code}"
                if error.code == 416 and self.offset == self.start:  # the range starts past the end
                    raise RangeIgnored(self.url, reason, f"HTTP 416 {error.reason}") from None
                if error.code not in TRANSIENT_HTTP:
                    raise ShardUnavailable(self.url, reason, f"HTTP {error.code} {error.reason}") from None
                self.wait(reason, f"HTTP {error.code}")
            except (OSError, http.client.HTTPException) as error:  # URLError, reset, BadStatusLine
                self.wait(timeout_or_unreachable(error), redact_text(str(getattr(error, "reason", error))))
            except ValueError as error:  # a redirect to an unparseable URL
                raise transport_fault(self.url, error, OPENING) from None

    def wait(self, reason: str, detail: str) -> None:
        """Sleep before the next attempt, or raise when the retries are spent."""
        if self.failures >= self.patience.retries:
            raise ShardUnavailable(self.url, reason, f"{detail} (after {self.failures + 1} attempts)")
        time.sleep(self.patience.delay(self.failures, self.url))
        self.failures += 1

    def readinto(self, buffer) -> int:
        while True:
            try:
                count = self.response.readinto(buffer)
            except (OSError, ValueError, http.client.HTTPException) as error:  # reset, IncompleteRead
                self.response.close()
                detail = (
                    f"read failed at byte {self.offset}: {type(error).__name__}: {redact_text(str(error))}"
                )
                self.wait(timeout_or_unreachable(error), detail)
                self.response = self.connect()
                continue
            length = self.response.length  # None when the server sent no Content-Length
            if count == 0 and length:  # the body ended early: continue it
                self.response.close()
                self.wait("broken_stream", f"the body ended at byte {self.offset}, {length} bytes short")
                self.response = self.connect()
                continue
            self.offset += count
            return count

    def close(self) -> None:
        if not self.closed:
            self.response.close()
        super().close()


def body_size(response) -> int | None:
    """The whole body's bytes: a ``Content-Range`` total (``bytes 0-99/1234``), else the length of a
    whole (200) response; None when the response does not say."""
    content_range = response.headers.get("Content-Range", "")
    total = content_range.rpartition("/")[2]
    if total.isdigit():
        return int(total)
    return response.length if response.status == 200 else None


def timeout_or_unreachable(error: BaseException) -> str:
    inner = getattr(error, "reason", error)
    return "timeout" if isinstance(inner, (socket.timeout, TimeoutError)) else "unreachable"


def authorize(request: urllib.request.Request) -> None:
    """Give ``request`` its host's ``~/.netrc`` credentials as an *unredirected* header: urllib
    copies ordinary headers onto a redirect, which would hand them to another host."""
    request.remove_header("Authorization")
    auth = netrc_authorization(request.full_url)
    if auth:
        request.add_unredirected_header("Authorization", auth)


class CredentialSafeRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects that follow http(s) only and never carry an ``Authorization`` header to another
    host (whatever set it); the new host gets its own netrc entry, if it has one."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        target = urllib.parse.urljoin(req.full_url, newurl)
        if scheme_of(target) not in HTTP_SCHEMES:
            raise ShardUnavailable(
                req.full_url, "unreachable", f"redirect to a non-http(s) URL refused: {redact(target)}"
            )
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            same_host = urlsplit(target).netloc.lower() == urlsplit(req.full_url).netloc.lower()
            kept = req.unredirected_hdrs.get("Authorization") if same_host else None
            new.remove_header("Authorization")
            if kept:
                new.add_unredirected_header("Authorization", kept)
            else:
                authorize(new)
        return new


#: The opener shards are fetched with (its redirect handler keeps credentials on their host).
OPENER = urllib.request.build_opener(CredentialSafeRedirects)


def netrc_authorization(url: str) -> str | None:
    """A Basic ``Authorization`` header from ``~/.netrc`` (or ``$NETRC``) for the URL's host."""
    import base64
    import netrc

    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(urlsplit(url).hostname or "")
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return None
    if not entry:
        return None
    login, _, password = entry
    return "Basic " + base64.b64encode(f"{login}:{password or ''}".encode()).decode()


#: Seconds a ``pipe:`` command may take to exit after the reader closed its output (see
#: :meth:`PipeReader.close`); one that ignores the broken pipe is killed after them.
PIPE_CLOSE_GRACE_S = 5.0


class PipeReader(io.RawIOBase):
    """The standard output of ``command`` (run by the shell) as a stream. A read that waits longer
    than ``timeout`` kills the command; a non-zero exit status fails the shard."""

    def __init__(self, command: str, timeout: float) -> None:
        self.command, self.timeout = command, timeout
        import tempfile

        # stderr to a file: a chatty command must not block on a full pipe nobody reads.
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115 — closed in close(), it outlives this call
        self.process = subprocess.Popen(
            command, shell=True, stdout=subprocess.PIPE, stderr=self.errors, start_new_session=True
        )
        self.fd = self.process.stdout.fileno()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        ready, _, _ = select.select([self.fd], [], [], self.timeout)
        if not ready:
            self.kill()
            raise ShardUnavailable(f"pipe:{self.command}", "timeout", f"no output for {self.timeout:g} s")
        data = os.read(self.fd, len(buffer))
        if not data:
            self.check_exit()
        buffer[: len(data)] = data
        return len(data)

    def check_exit(self) -> None:
        """After the output ended: wait for the command (at most ``timeout``; one that closes its
        output and lingers is killed) and fail the shard on a non-zero exit status."""
        try:
            status = self.process.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ShardUnavailable(
                f"pipe:{self.command}", "timeout",
                f"the command closed its output but did not exit within {self.timeout:g} s",
            ) from None  # fmt: skip
        if status != 0:
            self.errors.seek(0)
            error = redact_text(self.errors.read(2000).decode("utf-8", "replace").strip())
            raise ShardUnavailable(f"pipe:{self.command}", "pipe_failed", f"exit status {status}: {error}")

    def kill(self) -> None:
        """The shell and what it started (its own session: ``aws s3 cp`` under ``sh -c``)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop reading. Our end of the pipe is closed first, so a command still writing gets a
        broken pipe and ends by itself; it is given :data:`PIPE_CLOSE_GRACE_S` (at most the
        timeout) to finish what it does beside the pipe — ``tee`` writing its last chunk to a cache
        file, which a kill would cut short — and killed after that."""
        if not self.closed:
            self.process.stdout.close()
            try:
                self.process.wait(timeout=min(self.timeout, PIPE_CLOSE_GRACE_S))
            except subprocess.TimeoutExpired:
                self.kill()  # stopped early and still running (it ignores the broken pipe)
                self.process.wait()
            self.errors.close()
        super().close()
