"""Local-file data sources for ``clipkit shard`` and evaluation: tables, caption folders, class folders.

URIs (all ``trylast``, so a third-party ``open_source`` can take any of them over):

* ``PATH.jsonl`` / ``PATH.csv`` / ``PATH.tsv`` / ``PATH.parquet``
  [``?image=COL&caption=COL1,COL2&meta=COL3,COL4``]: one row per image (parquet is read a batch at a
  time with pyarrow, and its image cells may hold the encoded image itself, see
  :mod:`clipkit.plugins.sources.dataset_sources`). Defaults: the image column is the first of ``image``,
  ``file``, ``path``, ``url``; the caption columns are those of ``caption``, ``captions`` and
  ``caption_0`` .. ``caption_k`` present (a string, or a list of strings, so COCO's 5 captions per
  image stay together), else the first of ``text``, ``txt``, ``TEXT``; a table with none of them is
  refused naming its columns; meta is every other scalar column.
  Image paths are relative to the table's directory (absolute paths are kept). Key = data row number.
  ``http(s)://`` cells are downloaded (:mod:`clipkit.data.download`; options ``timeout``, ``retries``,
  ``backoff``, ``retry_after_cap``, ``per_host``, ``min_interval``, ``max_bytes``, ``user_agent``);
  ``resize=N`` downscales each image's shorter side to N on write.
* ``folder:PATH`` (or a bare directory whose images have same-stem ``.txt`` files): images with
  same-stem ``.txt`` captions (one per line) and optional same-stem ``.json`` meta objects.
* ``classes:PATH``: ``PATH/<class>/<images>`` for zero-shot evaluation; meta ``{"label": index,
  "class": name}``, caption "a photo of a {name}.", and ``info()["labels"]["class"]`` in the format
  :func:`clipkit.plugins.sources.synthetic_shapes.zero_shot_labels` uses (``classes`` + ``templates``).

A bad row is skipped and counted by reason in ``source.skipped``; ``info()`` reports those counts
after a full iteration. Reasons: ``missing_image``, ``bad_image`` (does not fully decode),
``unsupported_image``, ``image_too_large`` (decompression-bomb guard), ``missing_caption``,
``empty_caption``, ``bad_caption`` (not a string, or holds NUL), ``caption_too_long`` (option
``max_caption_chars``, default 10 000), ``bad_encoding`` (not UTF-8), ``bad_line`` (unparsable
row), ``bad_meta`` (not strict JSON scalars / flat lists), and the downloader's for URLs. With
``options["strict"]`` true the first bad row raises :class:`clipkit.errors.DataError` naming the file
and row instead. Torch is never imported here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clipkit.contract.types import Sample
from clipkit.errors import DataError

# Re-exported: the shared machinery and the table source are part of this module's interface.
from .source_base import (  # noqa: F401
    DEFAULT_MAX_CAPTION_CHARS,
    IMAGE_SUFFIXES,
    LINE_BREAKS,
    OTHER_IMAGE_SUFFIXES,
    PIL_FORMAT_EXT,
    BadRow,
    FileSource,
    check_meta,
    check_path,
    check_utf8,
    clean_captions,
    common_options,
    is_scalar,
    ordered_map,
    positive_int,
    preview,
    read_image,
    read_regular_file,
    truthy,
    verify_image_bytes,
)
from .table_source import TABLE_SUFFIXES, TableSource, table_columns, table_options  # noqa: F401

if TYPE_CHECKING:
    pass


CLASS_TEMPLATE = "a photo of a {}."
MANIFEST = "manifest.json"  # clipkit.data.shard.MANIFEST; a shard directory is not a caption folder


def open_file_source(uri: str, options: dict[str, Any] | None = None):
    """The file source for ``uri`` (see module docs), or None when ``uri`` is not a local-file URI."""
    options = dict(options or {})
    common = common_options(options)
    if uri.startswith("folder:"):
        return CaptionFolderSource(uri[len("folder:") :], **common)
    if uri.startswith("classes:"):
        return ClassFolderSource(uri[len("classes:") :], **common)
    if "://" in uri:
        return None
    path, _, query = uri.partition("?")
    if Path(path).suffix.lower() in TABLE_SUFFIXES:
        return TableSource(path, **table_columns(uri, query, options), **table_options(options, common))
    if not query and is_caption_folder(Path(uri)):
        return CaptionFolderSource(uri, **common)
    return None


def is_caption_folder(path: Path) -> bool:
    """A directory (not a shard directory) with at least one top-level image that has a .txt caption."""
    if not path.is_dir() or (path / MANIFEST).is_file():
        return False
    return any(image.with_suffix(".txt").is_file() for image in image_files(path, recursive=False))


def image_files(directory: Path, *, recursive: bool = True) -> list[Path]:
    """Entries named like images under ``directory`` (hidden ones left out: ``.DS_Store``, macOS's
    ``._x.jpg`` resource forks), sorted so keys and order are stable. Not only regular files: a
    FIFO, a device, a directory or a dangling or looping symbolic link named ``*.png`` is listed
    too, so reading it skips and counts it (left out here, it would vanish from the data without a
    trace); so are images in formats the shards do not store (``.gif``, ``.tif``, ``.svg``: see
    :func:`read_listed_image`)."""
    candidates = directory.rglob("*") if recursive else directory.iterdir()
    return sorted(
        path
        for path in candidates
        if path.suffix.lower() in IMAGE_SUFFIXES + OTHER_IMAGE_SUFFIXES
        and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    )


def read_listed_image(path: Path, max_bytes: int) -> tuple[bytes, str]:
    """:func:`read_image` for a file a folder source listed: its format is read from its bytes
    (a ``.jfif`` JPEG is stored; a GIF or TIFF is ``unsupported_image``), and a file named like an
    image in a format PIL does not read at all (SVG, HEIC without a plugin) is ``unsupported_image``
    too, not ``bad_image``: nothing in it is damaged."""
    try:
        return read_image(path, max_bytes)
    except BadRow as bad:
        if bad.reason != "bad_image" or path.suffix.lower() not in OTHER_IMAGE_SUFFIXES:
            raise
        if "not a readable image" not in bad.detail:  # identified but damaged: stays bad_image
            raise
        stored = ", ".join(suffix.lstrip(".") for suffix in IMAGE_SUFFIXES)
        raise BadRow("unsupported_image", f"image {path}: {path.suffix} images are not read (the shards "
                     f"store {stored}); convert it, e.g. to PNG") from None  # fmt: skip


class FolderSource(FileSource):
    """A :class:`FileSource` rooted at a directory (checked when opened)."""

    def __init__(self, path: Path | str, **settings: Any) -> None:
        """``settings``: those of :class:`FileSource` (strict, workers, max_caption_chars)."""
        super().__init__(path, **settings)
        if not self.path.is_dir():
            raise DataError(f"{self.path}: not a directory")


class CaptionFolderSource(FolderSource):
    """Images under a directory with same-stem ``.txt`` captions (one per line) and ``.json`` meta."""

    name = "folder"

    def candidates(self) -> Iterator[tuple[str, Callable[[], Sample]]]:
        for image_path in image_files(self.path):
            yield str(image_path), lambda p=image_path: self.build(p)

    def build(self, image_path: Path) -> Sample:
        where = str(image_path)
        check_path(image_path, f"image {image_path}")  # a FIFO, device, loop: counted as what it is
        caption_path = image_path.with_suffix(".txt")
        if not os.path.lexists(caption_path):
            raise BadRow("missing_caption", f"{where}: no caption file {caption_path.name}")
        # Read as a regular file only, size-limited: a FIFO named x.txt must not hang the run.
        raw = read_regular_file(caption_path, self.max_image_bytes, str(caption_path), "missing_caption")
        try:
            text = raw.decode("utf-8-sig")  # a byte-order mark (Windows editors) is not a caption's
        except UnicodeDecodeError:
            raise BadRow("bad_encoding", f"{caption_path}: not valid UTF-8") from None
        # Lines end at \n (\r\n, \r): str.splitlines would also split at \x0b, \x1c, \u2028...
        captions = clean_captions(LINE_BREAKS.split(text), str(caption_path), self.max_caption_chars)
        meta = self.meta(image_path)
        image, image_ext = read_listed_image(image_path, self.max_image_bytes)  # last: the costly check
        key = image_path.relative_to(self.path).with_suffix("").as_posix()
        return Sample(key=key, image=image, image_ext=image_ext, captions=captions, meta=meta)

    def meta(self, image_path: Path) -> dict[str, Any]:
        meta_path = image_path.with_suffix(".json")
        if not os.path.lexists(meta_path):
            return {}
        raw = read_regular_file(meta_path, self.max_image_bytes, str(meta_path), "bad_meta")
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (OSError, ValueError, RecursionError) as error:  # unreadable; not UTF-8; not JSON; deep
            raise BadRow("bad_meta", f"{meta_path}: invalid JSON ({preview(str(error), 200)})") from None
        if not isinstance(meta, dict):
            raise BadRow("bad_meta", f"{meta_path}: expected a JSON object")
        return check_meta(meta, str(meta_path))


def class_name(folder: str) -> str:
    """Folder name -> class name in prompts ("golden_retriever" -> "golden retriever")."""
    return folder.replace("_", " ")


def refuse_aliased_classes(root: Path, folders: list[str]) -> None:
    """DataError when two class folders are one directory (a symbolic link to a sibling): each of
    its images would be scored under two labels, one of them necessarily wrong. A link to a folder
    elsewhere is a class like any other."""
    seen: dict[Path, str] = {}
    for folder in folders:
        real = (root / folder).resolve()
        if real in seen:
            raise DataError(f"{root}: class folders {seen[real]!r} and {folder!r} are the same "
                            f"directory ({real}; a symbolic link): its images would be labelled twice; "
                            "remove one")  # fmt: skip
        seen[real] = folder


class ClassFolderSource(FolderSource):
    """``PATH/<class>/<images>``: a labelled evaluation set; classes are the sorted folder names."""

    name = "classes"

    def __init__(self, path: Path | str, **settings: Any) -> None:
        super().__init__(path, **settings)
        folders = (p.name for p in self.path.iterdir() if p.is_dir() and not p.name.startswith("."))
        self.folders = sorted(folders)
        if not self.folders:
            raise DataError(f"{self.path}: no class sub-directories")
        refuse_aliased_classes(self.path, self.folders)
        self.classes = [class_name(folder) for folder in self.folders]

    def candidates(self) -> Iterator[tuple[str, Callable[[], Sample]]]:
        for label, folder in enumerate(self.folders):
            for image_path in image_files(self.path / folder):
                yield str(image_path), lambda p=image_path, i=label: self.build(p, i)

    def build(self, image_path: Path, label: int) -> Sample:
        image, image_ext = read_listed_image(image_path, self.max_image_bytes)
        name = self.classes[label]
        return Sample(
            key=image_path.relative_to(self.path).with_suffix("").as_posix(),
            image=image,
            image_ext=image_ext,
            captions=(CLASS_TEMPLATE.format(name),),
            meta={"label": label, "class": name},
        )

    def info(self) -> dict[str, Any]:
        labels = {"classes": list(self.classes), "templates": [CLASS_TEMPLATE]}
        return {**super().info(), "labels": {"class": labels}}
