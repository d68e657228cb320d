"""Polite HTTP(S) image downloads for URL tables (``clipkit shard table.jsonl`` with URL cells).

Standard library only (``urllib``). A :class:`Downloader` is a picklable configuration plus
lazily created per-host state:

* ``timeout``: seconds to wait for the connection and for each read (not the whole body);
* ``retries``: extra attempts after a timeout, a connection error, a truncated body, HTTP 408,
  429 or 5xx, spaced by exponential backoff (``backoff × 2**attempt``, capped at ``backoff_cap``)
  with jitter drawn from a generator seeded by ``(seed, url, attempt)``, so delays are
  reproducible whatever the thread scheduling; ``Retry-After`` on 429/503 replaces the backoff,
  capped at ``retry_after_cap``. Other 4xx are final at once;
* ``per_host``: at most this many requests in flight to one host name (a semaphore per host);
  ``min_interval``: at least this many seconds between the starts of two requests to one host;
* ``max_bytes``: larger bodies are refused (from ``Content-Length`` when sent, else while reading).

Failures raise :class:`DownloadError` whose ``reason`` is one of :data:`REASONS` or ``http_<code>``
(the last status seen), the key ``clipkit shard`` counts skipped rows under. Only ``http`` and
``https`` URLs (and redirects to them) are fetched: a table of URLs never reads local files. A URL
carrying credentials (``user:password@``) is refused (``bad_url``) before anything is sent, as
streamed shards refuse them (:func:`clipkit.data.remote.check_url`): a password in a table is read
by whoever reads the table, and would follow redirects to other hosts. No message shows it.

:func:`resize_image` is the optional resize-on-write (img2dataset's ``keep_ratio`` mode, but only
ever downscaling). Nothing here touches the network at import time.
"""

from __future__ import annotations

import email.utils
import http.client
import io
import random
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

from clipkit import __version__
from clipkit.errors import DataError

DEFAULT_USER_AGENT = f"clipkit/{__version__} (image downloader for clipkit shard; Python-urllib)"
ALLOWED_SCHEMES = ("http", "https")
#: Statuses worth another attempt: request timeout, rate limit, server errors.
RETRY_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
RETRY_AFTER_STATUSES = frozenset({429, 503})
#: Failure reasons other than ``http_<code>``.
REASONS = ("bad_url", "timeout", "too_large", "download_failed")
CHUNK_BYTES = 1 << 16


class DownloadError(DataError):
    """A URL could not be fetched; ``reason`` is the short key failures are counted under."""

    def __init__(self, reason: str, url: str, detail: str) -> None:
        super().__init__(f"{redact(url)}: {detail}")
        self.reason, self.url, self.detail = reason, url, detail


def redact(url: str) -> str:
    """``url`` without a ``user:password@`` part, for messages and manifests. Never raises: it
    runs in error handlers, including for URLs ``urlsplit`` refuses (``http://[::1``)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        # Malformed: cut anything between "//" and the last "@" before the path by hand.
        return USERINFO.sub(r"\1", url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


#: ``scheme://user:password@`` -> ``scheme://`` (for URLs urlsplit cannot parse).
USERINFO = re.compile(r"^([^:/?#]*://)[^/?#]*@")


def is_url(text: str) -> bool:
    """True for an ``http://`` or ``https://`` address (case-insensitive scheme)."""
    return text.strip().lower().startswith(("http://", "https://"))


#: ``scheme://`` at the start of a table cell: a URL (``ftp://``, ``s3://``, ``file://``), not a path.
URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def has_scheme(text: str) -> bool:
    """True for any ``scheme://...`` address, fetchable or not (a relative path never has one)."""
    return URL_SCHEME.match(text.strip()) is not None


@dataclass
class Downloader:
    """Fetch URLs politely; see the module docs for the meaning of each setting."""

    timeout: float = 10.0
    retries: int = 2
    backoff: float = 1.0
    backoff_cap: float = 30.0
    retry_after_cap: float = 30.0
    per_host: int = 4
    min_interval: float = 0.0
    max_bytes: int = 50 * 1024 * 1024
    user_agent: str = DEFAULT_USER_AGENT
    jitter: bool = True
    seed: int = 0
    # Runtime state (locks, semaphores, the opener): rebuilt lazily, never pickled or compared.
    _state: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        checks = {
            "timeout": self.timeout > 0,
            "retries": self.retries >= 0,
            "backoff": self.backoff >= 0,
            "backoff_cap": self.backoff_cap >= 0,
            "retry_after_cap": self.retry_after_cap >= 0,
            "per_host": self.per_host >= 1,
            "min_interval": self.min_interval >= 0,
            "max_bytes": self.max_bytes >= 1,
            "user_agent": bool(self.user_agent.strip()),
        }
        bad = [f"{name}={getattr(self, name)!r}" for name, ok in checks.items() if not ok]
        if bad:
            raise DataError(f"invalid download setting(s): {', '.join(bad)}")
        self._state = {"lock": threading.Lock(), "semaphores": {}, "next_start": {}}

    # -- configuration ----------------------------------------------------------------------

    #: Source options (``clipkit shard SRC OUT -o key=value``) -> field, with the parser for strings.
    OPTION_TYPES = {
        "timeout": float, "retries": int, "backoff": float, "retry_after_cap": float, "per_host": int,
        "min_interval": float, "max_bytes": int, "user_agent": str,
    }  # fmt: skip
    #: Of those, the options that change how patiently samples arrive, not which ones end up in the
    #: shards' bytes (max_bytes decides what is refused, so it is not one of them).
    PATIENCE_OPTIONS = frozenset(OPTION_TYPES) - {"max_bytes"}

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Downloader:
        """A downloader from source options (CLI values arrive as strings); unset keys keep defaults."""
        settings = {}
        for key, kind in cls.OPTION_TYPES.items():
            value = options.get(key)
            if value is None:
                continue
            try:
                settings[key] = kind(value)
            except (TypeError, ValueError):
                raise DataError(f"source option {key}={value!r} is not a valid {kind.__name__}") from None
        return cls(**settings)

    def info(self) -> dict[str, Any]:
        """The settings, for the manifest (JSON-able; no runtime state)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def __getstate__(self) -> dict[str, Any]:
        return self.info()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    # -- fetching -----------------------------------------------------------------------------

    def fetch(self, url: str) -> bytes:
        """The body of ``url``; :class:`DownloadError` after the allowed retries."""
        host = self.check_url(url)
        attempt = 0
        while True:
            try:
                with self.host_slot(host):
                    return self.fetch_once(url)
            except RetryableError as error:
                if attempt >= self.retries:
                    detail = f"{error.detail} (after {attempt + 1} attempts)"
                    raise DownloadError(error.reason, url, detail) from None
                if error.retry_after is not None:
                    time.sleep(min(error.retry_after, self.retry_after_cap))
                else:
                    time.sleep(self.backoff_delay(url, attempt))
                attempt += 1

    def check_url(self, url: str) -> str:
        """The (lower-case) host name of a fetchable URL; DownloadError("bad_url") otherwise."""
        try:
            parts = urlsplit(url.strip())
            host = parts.hostname
        except ValueError as error:
            raise DownloadError("bad_url", url, f"malformed URL ({error})") from None
        scheme = parts.scheme.lower()
        if scheme not in ALLOWED_SCHEMES:
            what = f"{scheme}:// URLs are" if scheme else "a local path is"
            raise DownloadError("bad_url", url, f"{what} not downloaded (only http:// and https:// are): "
                                "fetch the file yourself and give its local path")  # fmt: skip
        if "@" in parts.netloc:
            raise DownloadError("bad_url", url, "the URL carries credentials (user:password@ before the "
                                "host), which are never sent: serve the image without a login, or "
                                "download it and give its local path")  # fmt: skip
        if not host:
            raise DownloadError("bad_url", url, "URL has no host")
        return host.lower()

    def backoff_delay(self, url: str, attempt: int) -> float:
        """Seconds before retry ``attempt + 1``: ``backoff × 2**attempt`` (capped), jittered to
        [0.5, 1.5)× by a generator seeded from (seed, url, attempt), so runs are reproducible."""
        delay = min(self.backoff * 2**attempt, self.backoff_cap)
        if self.jitter:
            delay *= 0.5 + random.Random(f"{self.seed}:{url}:{attempt}").random()
        return delay

    def host_slot(self, host: str) -> HostSlot:
        """Context manager: waits for ``min_interval`` since the previous start to ``host`` and
        for one of its ``per_host`` connections."""
        with self._state["lock"]:
            semaphore = self._state["semaphores"].get(host)
            if semaphore is None:
                semaphore = self._state["semaphores"][host] = threading.BoundedSemaphore(self.per_host)
        return HostSlot(self, host, semaphore)

    def reserve_start(self, host: str) -> float:
        """Book the next start time for ``host`` (``min_interval`` after the previous booking)."""
        with self._state["lock"]:
            now = time.monotonic()
            start = max(now, self._state["next_start"].get(host, now))
            self._state["next_start"][host] = start + self.min_interval
        return start - now

    def opener(self) -> urllib.request.OpenerDirector:
        with self._state["lock"]:
            if "opener" not in self._state:
                self._state["opener"] = urllib.request.build_opener(HttpOnlyRedirects())
            return self._state["opener"]

    def fetch_once(self, url: str) -> bytes:
        """One attempt; RetryableError for failures worth retrying, DownloadError for final ones."""
        request = urllib.request.Request(
            url.strip(), headers={"User-Agent": self.user_agent, "Accept": "image/*,*/*;q=0.5"}
        )
        try:
            with self.opener().open(request, timeout=self.timeout) as response:
                return self.read_body(url, response)
        except urllib.error.HTTPError as error:
            error.close()
            reason, detail = f"http_{error.code}", f"HTTP {error.code} {error.reason}"
            if error.code not in RETRY_STATUSES:
                raise DownloadError(reason, url, detail) from None
            retry_after = None
            if error.code in RETRY_AFTER_STATUSES:
                retry_after = retry_after_seconds(error.headers.get("Retry-After"))
            raise RetryableError(reason, detail, retry_after) from None
        except RedirectRefused as error:
            raise DownloadError("bad_url", url, str(error.reason)) from None
        except urllib.error.URLError as error:
            if isinstance(error.reason, TimeoutError):
                raise RetryableError("timeout", f"no answer within {self.timeout} s") from None
            raise RetryableError("download_failed", f"connection failed ({error.reason})") from None
        except TimeoutError:
            raise RetryableError("timeout", f"no data within {self.timeout} s") from None
        except (http.client.HTTPException, OSError) as error:
            raise RetryableError("download_failed", f"{type(error).__name__}: {error}") from None
        except ValueError as error:  # urllib: "unknown url type", bad ports
            raise DownloadError("bad_url", url, f"malformed URL ({error})") from None

    def read_body(self, url: str, response: http.client.HTTPResponse) -> bytes:
        """The whole body, in chunks, refusing more than ``max_bytes``; a body shorter than its
        ``Content-Length`` is an error (``read(n)`` alone just returns the short body)."""
        declared = response.headers.get("Content-Length")
        expected = int(declared) if declared and declared.strip().isdigit() else None
        if expected is not None and expected > self.max_bytes:
            raise DownloadError("too_large", url, f"Content-Length {expected} > max_bytes {self.max_bytes}")
        chunks, total = [], 0
        while chunk := response.read(CHUNK_BYTES):
            total += len(chunk)
            if total > self.max_bytes:
                raise DownloadError("too_large", url, f"body exceeds max_bytes {self.max_bytes}")
            chunks.append(chunk)
        if expected is not None and total != expected:
            raise RetryableError("download_failed", f"body ended after {total} of {expected} bytes")
        return b"".join(chunks)


class HostSlot:
    """Holds one of a host's connections for the duration of a ``with`` block."""

    def __init__(self, downloader: Downloader, host: str, semaphore: threading.BoundedSemaphore) -> None:
        self.downloader, self.host, self.semaphore = downloader, host, semaphore

    def __enter__(self) -> HostSlot:
        self.semaphore.acquire()
        wait = self.downloader.reserve_start(self.host)
        if wait > 0:
            time.sleep(wait)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.semaphore.release()


class RetryableError(Exception):
    """An attempt failed in a way another attempt may fix (internal to :meth:`Downloader.fetch`)."""

    def __init__(self, reason: str, detail: str, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.retry_after = reason, detail, retry_after


class RedirectRefused(urllib.error.URLError):
    """A redirect pointed outside http(s)."""


class HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to http(s): a URL must never lead to ``file://`` or ``ftp://``
    (urllib itself would follow ``ftp://`` and answers ``file://`` with an HTTPError 30x)."""

    def http_error_302(self, req, fp, code, msg, headers):
        target = headers.get("location") or headers.get("uri")
        if target is not None:
            scheme = urlsplit(urljoin(req.full_url, target.strip())).scheme.lower()
            if scheme not in ALLOWED_SCHEMES:
                fp.close()
                raise RedirectRefused(f"redirect to a non-http(s) URL refused: {redact(target)}")
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date, RFC 9110 §10.2.3);
    None when absent or unparsable. Never negative."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


# --------------------------------------------------------------------------------------------
# Resize on write


#: PIL format -> save options; JPEG/WebP re-encoded at quality 95 (img2dataset's default).
SAVE_OPTIONS = {"JPEG": {"quality": 95}, "WEBP": {"quality": 95}, "PNG": {}, "BMP": {}}
#: PIL reads camera JPEGs with a multi-picture extension as "MPO"; they are written back as plain JPEG.
SAVE_FORMAT = {"MPO": "JPEG"}


def resize_image(data: bytes, shorter_side: int, *, quality: int = 95) -> bytes:
    """``data`` re-encoded in its own format with the shorter side downscaled to ``shorter_side``
    (aspect ratio kept, longer side rounded); images already small enough come back unchanged.

    EXIF (so its orientation tag) and the ICC profile are carried over. Raises ``OSError`` /
    ``ValueError`` (from PIL) for undecodable data.
    """
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image_format = SAVE_FORMAT.get(image.format, image.format)
        width, height = image.size
        if min(width, height) <= shorter_side:
            return data
        if image_format not in SAVE_OPTIONS:
            raise ValueError(f"cannot re-encode {image_format} images")
        scale = shorter_side / min(width, height)
        size = (
            (shorter_side, max(1, round(height * scale)))
            if width <= height
            else (max(1, round(width * scale)), shorter_side)
        )
        info = {key: image.info[key] for key in ("exif", "icc_profile") if image.info.get(key)}
        if image.mode in ("P", "1"):  # palette / bilevel images resample only with NEAREST
            image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        resized = image.resize(size, Image.Resampling.LANCZOS)
    if image_format == "JPEG" and resized.mode not in ("RGB", "L", "CMYK"):
        resized = resized.convert("RGB")
    options = dict(SAVE_OPTIONS[image_format])
    if "quality" in options:
        options["quality"] = quality
    if image_format in ("JPEG", "PNG", "WEBP"):
        options.update(info)
    buffer = io.BytesIO()
    resized.save(buffer, format=image_format, **options)
    return buffer.getvalue()
