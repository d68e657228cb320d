"""What every file source shares: bad rows skipped and counted (or raised), ordered concurrent
building, resumable positions, and the checks on images, captions and meta-data.

A source subclasses :class:`FileSource` and yields ``(where, build)`` candidates; ``build()``
returns a :class:`~clipkit.contract.types.Sample` or raises :class:`BadRow` with the reason it is counted
under. Torch is never imported here.
"""

from __future__ import annotations

import abc
import collections
import errno
import io
import itertools
import json
import os
import re
import stat
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipkit.contract.types import Sample
from clipkit.errors import ClipkitError, DataError

if TYPE_CHECKING:
    pass


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
#: Other names of image files people keep beside those. A folder source lists them too, so each is
#: read and counted (a ``.jfif`` is a JPEG and is stored; a GIF, TIFF, AVIF, HEIC or SVG is
#: ``unsupported_image``) instead of vanishing from the data without a trace.
OTHER_IMAGE_SUFFIXES = (".jfif", ".jpe", ".gif", ".tif", ".tiff", ".avif", ".heic", ".heif",
                        ".svg", ".svgz", ".ico", ".jp2", ".jxl", ".psd", ".tga")  # fmt: skip
#: PIL format -> the shard field name; only encodings clipkit.data.shard.decode_record reads back.
#: "MPO" is how PIL reads camera JPEGs that carry a multi-picture extension: plain JPEG files to any decoder.
PIL_FORMAT_EXT = {"PNG": "png", "JPEG": "jpg", "MPO": "jpg", "WEBP": "webp", "BMP": "bmp"}
#: Longest caption kept, in characters (option ``max_caption_chars``). A 77-token CLIP text encoder
#: reads ~300 characters and detailed-caption datasets average around a thousand; ten thousand
#: leaves room for any real caption but catches what is not one (a scraped page, a file pasted into
#: a cell), which would bloat every shard record and tokenizer call.
DEFAULT_MAX_CAPTION_CHARS = 10_000
#: Largest image file read, in bytes (option ``max_image_bytes``, e.g. ``64MiB``). Real images are
#: far smaller (a 50-megapixel camera JPEG is ~25 MB); the limit is there so that a path naming
#: something endless (``/dev/zero``) or a huge non-image is refused instead of read into memory.
DEFAULT_MAX_IMAGE_BYTES = 64 * 2**20
LINE_BREAKS = re.compile(r"\r\n|\r|\n")
#: C0 controls but tab, line feed and carriage return; DEL; C1 controls. NUL is refused before this.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def truthy(value: Any) -> bool:
    """Options from a CLI arrive as strings: "false" and "0" must mean False."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def positive_int(options: dict[str, Any], key: str, default: int) -> int:
    """``options[key]`` as an int >= 1 (CLI options arrive as strings); DataError naming the key."""
    value = options.get(key, default)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise DataError(f"source option {key}={value!r} is not an integer") from None
    if number < 1:
        raise DataError(f"source option {key}={value!r} must be >= 1")
    return number


#: The options every file source takes (:func:`common_options`).
COMMON_OPTIONS = ("strict", "workers", "max_caption_chars", "background", "max_image_bytes")


def common_options(options: dict[str, Any]) -> dict[str, Any]:
    """The :class:`FileSource` settings every source here takes (as the file sources read them)."""
    return {
        "strict": truthy(options.get("strict", False)),
        "workers": positive_int(options, "workers", 1),
        "max_caption_chars": positive_int(options, "max_caption_chars", DEFAULT_MAX_CAPTION_CHARS),
        "background": options.get("background") or None,
        "max_image_bytes": byte_size(options, "max_image_bytes", DEFAULT_MAX_IMAGE_BYTES),
    }


def byte_size(options: dict[str, Any], key: str, default: int) -> int:
    """``options[key]`` as a number of bytes >= 1 (``"64MiB"``, ``"500MB"``, ``"4096"``); DataError
    naming the key otherwise."""
    from clipkit.data.shard_writer import parse_size

    value = options.get(key)
    if value is None or value == "":
        return default
    try:
        number = parse_size(value if isinstance(value, (int, str)) else str(value))
    except ClipkitError:  # parse_size's message does not name the option; this one does
        number = None
    if not isinstance(number, int) or number < 1:
        raise DataError(f"source option {key}={value!r} must be a size >= 1 byte, e.g. 64MiB or 500MB")
    return number


class BadRow(Exception):
    """One row cannot become a sample; ``reason`` is the key it is counted under in ``skipped``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def read_image(path: Path, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> tuple[bytes, str]:
    """The file's bytes and shard extension; BadRow if it is missing or not a readable image.

    Only regular files are read: a FIFO would block forever, a device such as ``/dev/zero`` never
    ends, a directory is no image ("not_a_file"). A symbolic link that loops is "symlink_loop"; a
    file of more than ``max_bytes`` bytes is "too_large" (at most ``max_bytes + 1`` bytes are read).
    """
    data = read_regular_file(Path(path), max_bytes, f"image {path}")
    return data, verify_image_bytes(data, f"image {path}")


def read_regular_file(path: Path, max_bytes: int, where: str, missing: str = "missing_image") -> bytes:
    """The bytes of the regular file ``path`` (see :func:`read_image` for the reasons it refuses);
    a file that cannot be opened otherwise is counted under ``missing``."""
    try:
        check_path(path, where, missing)  # stat first, so a device is never even opened
        # O_NONBLOCK: a FIFO swapped in after the check must not block the open; fstat re-checks.
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise unreadable(error, where, missing) from None
    with os.fdopen(handle, "rb") as stream:
        check_regular(os.fstat(stream.fileno()), where)
        data = stream.read(max_bytes + 1)  # one byte more tells "exactly at the limit" from "over it"
    if len(data) > max_bytes:
        raise BadRow("too_large", f"{where} is larger than max_image_bytes ({max_bytes} bytes)")
    return data


def check_path(path: Path, where: str, missing: str = "missing_image") -> None:
    """BadRow unless ``path`` names a regular file (after symlinks): cheap, nothing is opened."""
    try:
        status = os.stat(path)
    except OSError as error:
        raise unreadable(error, where, missing) from None
    except ValueError as error:  # a NUL in the path
        raise BadRow(missing, f"{where} cannot be read ({error})") from None
    check_regular(status, where)


def check_regular(status: os.stat_result, where: str) -> None:
    if not stat.S_ISREG(status.st_mode):
        kind = FILE_KINDS.get(stat.S_IFMT(status.st_mode), "not a regular file")
        raise BadRow("not_a_file", f"{where} is {kind}; only regular files are read")


#: File type -> words for messages about paths that are not regular files.
FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def unreadable(error: OSError, where: str, missing: str = "missing_image") -> BadRow:
    """The BadRow for a path that cannot be opened: a symlink loop, else ``missing``."""
    if error.errno == errno.ELOOP:
        return BadRow("symlink_loop", f"{where}: symbolic links loop ({error.strerror})")
    if error.errno == errno.ENXIO:  # a socket, or a device without a driver
        return BadRow("not_a_file", f"{where} is not a regular file ({error.strerror})")
    return BadRow(missing, f"{where} cannot be read ({error.strerror or error})")


# warnings.catch_warnings swaps the process-wide filter list, which is not thread-safe before Python
# 3.14, and sources verify images in a thread pool (``workers``): the swap is serialised. Only the
# header parse (``Image.open``, where PIL checks the pixel count) runs under this lock.
_BOMB_CHECK_LOCK = threading.Lock()


def verify_image_bytes(data: bytes, where: str) -> str:
    """The shard extension of encoded image ``data`` (read from a file or downloaded); BadRow naming
    ``where`` unless the image fully decodes, in a format the shards store.

    The pixels are decoded (``load()`` under PIL's default ``LOAD_TRUNCATED_IMAGES = False``), as the
    training loader decodes them, so what passes here decodes there; ``Image.verify`` alone lets a
    JPEG or BMP truncated inside its pixel data through. The bytes are kept as given (no re-encoding).
    Reasons: "bad_image" (empty, not an image, truncated, corrupt, zero-size), "unsupported_image"
    (a format other than PNG / JPEG / WebP / BMP), "image_too_large" (more than
    ``PIL.Image.MAX_IMAGE_PIXELS`` pixels: PIL's decompression-bomb guard; its warning counts as an error).
    """
    from PIL import Image

    if not data:
        raise BadRow("bad_image", f"{where} is empty (0 bytes)")
    try:
        with _BOMB_CHECK_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise BadRow("image_too_large", f"{where}: {error}") from None
    except Exception as error:  # PIL raises many types (UnidentifiedImageError, OSError, SyntaxError...)
        raise BadRow("bad_image", f"{where} is not a readable image ({pil_error_text(error)})") from None
    with image:
        # Checked before decoding: only the formats the shards store are ever decoded.
        if image.format not in PIL_FORMAT_EXT:
            raise BadRow("unsupported_image", f"{where}: {image.format} is not stored in shards "
                         "(PNG, JPEG, WebP and BMP are)")  # fmt: skip
        if image.width < 1 or image.height < 1:
            raise BadRow("bad_image", f"{where}: zero-size image {image.size}")
        try:
            image.load()
        except Exception as error:
            raise BadRow("bad_image", f"{where} does not decode ({error})") from None
        return PIL_FORMAT_EXT[image.format]


#: How PIL names an in-memory file in its messages: a memory address, different on every run.
BYTES_IO_REPR = re.compile(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


def pil_error_text(error: Exception) -> str:
    """PIL's message without the ``<_io.BytesIO object at 0x...>`` it names in-memory data by: the
    message is kept in the manifest (``info.skipped_examples``), which must not change from run to
    run of the same source."""
    return BYTES_IO_REPR.sub("", str(error))


def clean_captions(
    values: list[Any], where: str, max_chars: int = DEFAULT_MAX_CAPTION_CHARS
) -> tuple[str, ...]:
    """Stripped non-empty captions, control characters turned into spaces.

    BadRow: "bad_caption" for a non-string or a caption holding NUL (binary data, or UTF-16 text
    read as UTF-8); "bad_encoding" for non-UTF-8 text; "caption_too_long" for a caption of more
    than ``max_chars`` characters; "empty_caption" when none is left (a caption showing nothing,
    only zero-width or other invisible characters, counts as none: :func:`is_blank`). Other
    control characters (C0 but tab / line feed / carriage return, DEL, C1) are stray bytes from
    scraping or legacy encodings, harmless to keep the sample for: each becomes a space.
    """
    captions = []
    for value in values:
        if not isinstance(value, str):
            raise BadRow("bad_caption", f"{where}: caption {preview(value)} is not a string")
        check_utf8(value, where)
        if "\x00" in value:
            raise BadRow("bad_caption", f"{where}: caption contains NUL (binary data or UTF-16 text?)")
        text = CONTROL_CHARACTERS.sub(" ", value).strip()
        if len(text) > max_chars:
            raise BadRow("caption_too_long", f"{where}: caption of {len(text)} characters (max_caption_chars "
                         f"is {max_chars}): {preview(text)}")  # fmt: skip
        if not is_blank(text):
            captions.append(text)
    if not captions:
        raise BadRow("empty_caption", f"{where}: no non-empty caption")
    return tuple(captions)


def bad_row_message(where: str, bad: BadRow) -> str:
    """``WHERE: REASON: DETAIL``, the row named once (many details start with it already)."""
    return f"{where}: {bad.reason}: {bad.detail.removeprefix(f'{where}: ')}"


def preview_text(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters (a skipped row's message kept in the manifest)."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


#: Letters that render as nothing (Hangul fillers, the blank Braille pattern); with whitespace and
#: the invisible format characters (category Cf: zero-width space, byte-order mark, joiners) they
#: make up captions that only look non-empty.
BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def is_blank(text: str) -> bool:
    """Whether ``text`` shows nothing: only whitespace, invisible format characters (``\u200b``,
    ``\ufeff``, ...) and blank letters. Such a caption gives a text tower only its start and end
    tokens; it is counted as ``empty_caption`` rather than trained on. A caption holding anything
    else keeps its format characters (an emoji sequence's zero-width joiners)."""
    import unicodedata

    return all(ch.isspace() or ch in BLANK_LETTERS or unicodedata.category(ch) == "Cf" for ch in text)


def preview(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for messages about huge values."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def check_utf8(text: str, where: str) -> None:
    # Text read with errors="surrogateescape" keeps undecodable bytes as lone surrogates.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRow("bad_encoding", f"{where}: text is not valid UTF-8") from None


def check_meta(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """``meta`` when it can be stored; BadRow("bad_meta") naming the first offending key otherwise.

    Each value must be a JSON scalar or a flat list of them: the loader collates meta-data by key
    into lists that losses turn into ``[N]`` / ``[N, p]`` tensors, so an object (or a list of lists)
    is a row that would fail there. The whole record must be strict UTF-8 JSON: Python's ``json``
    reads and writes NaN and Infinity, which JSON has no numbers for (other readers of the shards
    and the manifest reject them), and a lone surrogate is no UTF-8 text.
    """
    for key, value in meta.items():
        if not (is_scalar(value) or (isinstance(value, list) and all(is_scalar(v) for v in value))):
            raise BadRow("bad_meta", f"{where}: meta-data {key!r} = {preview(value)} is neither a JSON "
                         "scalar nor a flat list of them")  # fmt: skip
        try:
            json.dumps({key: value}, allow_nan=False, ensure_ascii=False).encode("utf-8")
        except (ValueError, TypeError) as error:  # NaN / inf; a non-JSON type; UnicodeEncodeError
            raise BadRow("bad_meta", f"{where}: meta-data {key!r} = {preview(value)} is not strict "
                         f"JSON ({error})") from None  # fmt: skip
    return meta


def attempt(where: str, build: Callable[[], Sample]) -> Sample | BadRow:
    """``build()``, with a :class:`BadRow` returned instead of raised (for thread pools)."""
    try:
        return build()
    except BadRow as bad:
        return bad


def ordered_map(
    function: Callable[[str, Callable[[], Sample]], Any],
    candidates: Iterator[tuple[str, Callable[[], Sample]]],
    workers: int,
) -> Iterator[tuple[str, Any]]:
    """``(where, function(where, build))`` for each candidate, in input order.

    With ``workers`` > 1 the calls run in a thread pool (image reads, verification and downloads
    release the GIL) with at most ``4 × workers`` in flight, so memory stays bounded on big sources.
    """
    if workers <= 1:
        for where, build in candidates:
            yield where, function(where, build)
        return
    from concurrent.futures import ThreadPoolExecutor

    window = 4 * workers
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="clipkit-source") as pool:
        pending: collections.deque = collections.deque()
        for where, build in candidates:
            pending.append((where, pool.submit(function, where, build)))
            if len(pending) >= window:
                done_where, future = pending.popleft()
                yield done_where, future.result()
        while pending:
            done_where, future = pending.popleft()
            yield done_where, future.result()


class FileSource(abc.ABC):
    """Base of the file sources: iteration that skips-and-counts (or raises on) bad rows.

    Subclasses implement ``candidates()`` yielding ``(where, build)``: ``where`` names the file and
    row for messages, ``build()`` returns the :class:`Sample` or raises :class:`BadRow`.
    """

    name = "files"

    def __init__(
        self,
        path: Path | str,
        *,
        strict: bool = False,
        workers: int = 1,
        max_caption_chars: int = DEFAULT_MAX_CAPTION_CHARS,
        background: Any = None,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    ) -> None:
        from clipkit.data.image_modes import parse_background

        self.path = Path(path)
        self.strict = strict
        # Option ``background``: images with transparency are composited onto it and stored as PNG.
        self.background = None if background is None else parse_background(background, "option background")
        self.image_counts = ImageCounts()
        self.max_caption_chars = int(max_caption_chars)
        self.max_image_bytes = int(max_image_bytes)
        if int(workers) < 1:
            raise DataError(f"{self.path}: workers must be >= 1, got {workers}")
        self.workers = int(workers)
        self.skipped: dict[str, int] = {}
        #: reason -> the first row skipped for it ("FILE row N: detail"), so a count can be traced.
        self.skipped_examples: dict[str, str] = {}
        self.yielded = 0
        self.consumed = 0
        self.complete = False
        self._length: int | None = None
        self._resume_from: dict[str, Any] | None = None

    @abc.abstractmethod
    def candidates(self) -> Iterator[tuple[str, Callable[[], Sample]]]:
        """Every row or file of the source as ``(where, build)``, in a stable order."""

    def __iter__(self) -> Iterator[Sample]:
        resume = self._resume_from or {}
        self._resume_from = None
        self.consumed = int(resume.get("consumed", 0))
        self.yielded = int(resume.get("yielded", 0))
        self.skipped = dict(resume.get("skipped", {}))
        self.skipped_examples = dict(resume.get("skipped_examples", {}))
        self.image_counts = ImageCounts.from_state(resume.get("images"))
        self.complete = False
        remaining = itertools.islice(self.candidates(), self.consumed, None)
        for where, outcome in ordered_map(attempt, remaining, self.workers):
            # Counted in source order (not completion order), so state() matches what was yielded.
            self.consumed += 1
            if isinstance(outcome, BadRow):
                if self.strict:
                    raise DataError(bad_row_message(where, outcome))
                self.skipped[outcome.reason] = self.skipped.get(outcome.reason, 0) + 1
                message = preview_text(bad_row_message(where, outcome))
                self.skipped_examples.setdefault(outcome.reason, message)
                continue
            self.yielded += 1
            yield self.image_counts.normalise(outcome, self.background)
        self.complete = True

    def state(self) -> dict[str, Any]:
        """Where iteration stands: candidates consumed, samples yielded, skips by reason (JSON-able)."""
        return {"consumed": self.consumed, "yielded": self.yielded, "skipped": dict(self.skipped),
                "skipped_examples": dict(self.skipped_examples),
                "images": self.image_counts.state()}  # fmt: skip

    def restore(self, state: dict[str, Any]) -> None:
        """Make the next iteration continue after ``state`` (from :meth:`state`) without rebuilding
        the candidates it had consumed (resumable ``clipkit shard``)."""
        self._resume_from = dict(state)

    def __len__(self) -> int:
        """Rows (or images) found; an upper bound on the samples yielded, as bad ones are skipped."""
        if self._length is None:
            self._length = sum(1 for _ in self.candidates())
        return self._length

    def info(self) -> dict[str, Any]:
        """Name and path; after a full iteration also ``n`` (samples yielded) and ``skipped``."""
        info: dict[str, Any] = {"name": self.name, "path": str(self.path)}
        if self.complete:
            info.update(
                n=self.yielded, skipped=dict(sorted(self.skipped.items())), **self.image_counts.info()
            )
            if self.skipped_examples:
                info["skipped_examples"] = dict(sorted(self.skipped_examples.items()))
        if self.background is not None:
            info["background"] = list(self.background)
        return info


def is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


class ImageCounts:
    """What the stored images are (counted for the manifest), and shard-time flattening.

    ``modes``: PIL mode -> images; ``alpha_images``: images with transparency (the loader composites
    them onto ``data.background``); ``alpha_flattened``: those composited at shard time (option
    ``background``) and stored as PNG; ``exif_rotated``: images with an EXIF orientation other than
    upright (turned by the loader, or when flattened).
    """

    def __init__(self) -> None:
        self.modes: dict[str, int] = {}
        self.alpha_images = self.alpha_flattened = self.exif_rotated = 0

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> ImageCounts:
        counts = cls()
        state = state or {}
        counts.modes = dict(state.get("modes", {}))
        counts.alpha_images = int(state.get("alpha_images", 0))
        counts.alpha_flattened = int(state.get("alpha_flattened", 0))
        counts.exif_rotated = int(state.get("exif_rotated", 0))
        return counts

    def state(self) -> dict[str, Any]:
        return {"modes": dict(self.modes), "alpha_images": self.alpha_images,
                "alpha_flattened": self.alpha_flattened, "exif_rotated": self.exif_rotated}  # fmt: skip

    def info(self) -> dict[str, Any]:
        """The manifest's counts (``info.image_modes``, ``info.alpha_images``, ...)."""
        state = self.state()
        state["image_modes"] = dict(sorted(state.pop("modes").items()))
        return state

    def normalise(self, sample: Sample, background: tuple[int, int, int] | None) -> Sample:
        """Count ``sample``'s image; with a ``background``, composite an image with transparency
        onto it (stored as PNG, upright: the re-encoded file carries no EXIF)."""
        import dataclasses

        from clipkit.data.image_modes import describe, flatten_image_bytes

        facts = describe(sample.image)  # header only: the source already checked the image decodes
        self.modes[facts["mode"]] = self.modes.get(facts["mode"], 0) + 1
        self.exif_rotated += facts["orientation"] != 1
        if not facts["alpha"]:
            return sample
        self.alpha_images += 1
        if background is None:
            return sample
        self.alpha_flattened += 1
        image = flatten_image_bytes(sample.image, background)
        return dataclasses.replace(sample, image=image, image_ext="png")
