"""idx files (MNIST, Fashion-MNIST) as a labelled source: ``idx:PATH/t10k-images-idx3-ubyte.gz``
[``?labels=PATH``], or a bare path with that name. Images become lossless grayscale PNGs with meta
``{"label", "class"}``; class names come from a sibling ``classes.json`` (else the digits);
captions and ``info()["labels"]`` follow :class:`clipkit.plugins.sources.file_sources.ClassFolderSource`.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from clipkit.contract.types import Sample
from clipkit.errors import DataError

from .file_sources import (
    CLASS_TEMPLATE,
    FileSource,
)
from .source_base import common_options

IDX_IMAGES_NAME = re.compile(r"images([.-])idx3-ubyte")
#: The ``-o`` options idx files read besides the common ones.
IDX_OPTIONS = ("labels",)


def idx_source(spec: str, options: dict[str, Any]) -> IdxSource:
    path, _, query = spec.partition("?")
    labels = options.get("labels")
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key != "labels":
            raise DataError(f"idx:{spec}: unknown query parameter {key!r}; known: labels")
        labels = value
    return IdxSource(path, labels=labels or None, **common_options(options))


def read_idx(path: Path, rank: int):
    """An idx file (gzipped or raw, told apart by the gzip magic) as a ``uint8`` array of the
    header's dimensions; DataError naming the file for a bad magic, element type, rank or size.

    Format (LeCun's MNIST page): ``00 00 <type> <rank>``, ``rank`` big-endian uint32 sizes, then
    the elements; type ``0x08`` = unsigned byte, the only type MNIST-like sets use.
    """
    import numpy as np

    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: idx file not found") from None
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror or error})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as error:
            raise DataError(f"{path}: broken gzip data ({error})") from None
    if len(raw) < 4 or raw[:2] != b"\0\0":
        raise DataError(f"{path}: not an idx file (magic {raw[:4].hex() or 'empty'}, expected 0000xxxx)")
    if raw[2] != 0x08:
        raise DataError(
            f"{path}: idx element type 0x{raw[2]:02x} is not supported (only 0x08, unsigned bytes)"
        )
    if raw[3] != rank:
        what = "images (count, rows, columns)" if rank == 3 else "labels (count)"
        raise DataError(f"{path}: an idx file of rank {raw[3]}; expected {rank} for {what}")
    header = 4 + 4 * rank
    if len(raw) < header:
        raise DataError(f"{path}: truncated idx header ({len(raw)} of {header} bytes)")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(rank))
    if len(raw) != header + math.prod(dims):
        shape = "×".join(map(str, dims))
        raise DataError(
            f"{path}: the header says {shape} = {math.prod(dims)} bytes of data, "
            f"the file holds {len(raw) - header} after its {header}-byte header"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def idx_labels_path(images: Path) -> Path:
    """``...-images-idx3-ubyte[.gz]`` -> the ``...-labels-idx1-ubyte`` beside it (gzipped or not)."""
    name = IDX_IMAGES_NAME.sub(lambda m: f"labels{m.group(1)}idx1-ubyte", images.name, count=1)
    if name == images.name:
        raise DataError(
            f"{images}: no '-images-idx3-ubyte' in the name to find the labels by; add ?labels=PATH"
        )
    stem = name.removesuffix(".gz")
    for candidate in (name, stem, f"{stem}.gz"):
        if (images.parent / candidate).is_file():
            return images.parent / candidate
    raise DataError(f"{images}: labels file {images.parent / name} not found; add ?labels=PATH")


def idx_classes(path: Path, needed: int) -> list[str]:
    """Class names from ``classes.json`` (``{"classes": [...]}`` or a list), else the digits."""
    if not path.is_file():
        return [str(digit) for digit in range(max(10, needed))]
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: not readable JSON ({error})") from None
    classes = data.get("classes") if isinstance(data, dict) else data
    if not isinstance(classes, list) or not all(isinstance(name, str) for name in classes):
        raise DataError(f'{path}: expected {{"classes": [names...]}} or a list of names')
    if len(classes) < needed:
        raise DataError(f"{path} names {len(classes)} classes but the labels go up to {needed - 1}")
    return classes


class IdxSource(FileSource):
    """Images and labels of an idx pair (MNIST layout), one PNG sample per image."""

    name = "idx"

    def __init__(self, path: Path | str, *, labels: Path | str | None = None, **common: Any) -> None:
        """``labels``: the labels file (default: found by name); ``common``: ``strict``, ``workers``,
        ``max_caption_chars`` (see :class:`FileSource`)."""
        super().__init__(path, **common)
        if not self.path.is_file():
            raise DataError(f"{self.path}: idx images file not found")
        self.labels_path = Path(labels) if labels else idx_labels_path(self.path)
        self.images = read_idx(self.path, 3)
        if 0 in self.images.shape[1:]:  # 0 rows or columns: no image can be made of them
            rows, cols = self.images.shape[1:]
            raise DataError(f"{self.path}: its images are {rows}×{cols} pixels; an idx image needs both > 0")
        self.labels = read_idx(self.labels_path, 1)
        if len(self.labels) != len(self.images):
            raise DataError(
                f"{self.path} holds {len(self.images)} images "
                f"but {self.labels_path} holds {len(self.labels)} labels"
            )
        self.classes = idx_classes(self.path.parent / "classes.json", int(self.labels.max(initial=0)) + 1)

    def candidates(self) -> Iterator[tuple[str, Callable[[], Sample]]]:
        for index in range(len(self.images)):
            yield f"{self.path}: image {index}", lambda i=index: self.build(i)

    def build(self, index: int) -> Sample:
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(self.images[index]).save(buffer, format="PNG")  # uint8 [rows, cols] -> mode "L"
        label = int(self.labels[index])
        name = self.classes[label]
        return Sample(
            key=str(index),
            image=buffer.getvalue(),
            image_ext="png",
            captions=(CLASS_TEMPLATE.format(name),),
            meta={"label": label, "class": name},
        )

    def info(self) -> dict[str, Any]:
        labels = {"classes": list(self.classes), "templates": [CLASS_TEMPLATE]}
        return {**super().info(), "labels_file": str(self.labels_path), "labels": {"class": labels}}
