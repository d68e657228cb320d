"""Teacher embeddings stored in shards (``clipkit shard --teacher``; ``train.distill.stored``).

MobileCLIP's "reinforced data": the teacher runs once, when the data is sharded, and training reads
its embeddings instead of running it. Each sample of such a shard set carries three more members:

* ``teacher_image.npy`` — float32 [K, d]: the teacher's embedding of K augmented views of the image;
* ``teacher_text.npy`` — float32 [C, d]: its embedding of each of the sample's C captions (in the
  order of the json's ``captions``);
* ``teacher.json`` — ``{"seeds": [K strings]}``: the seed of each view's augmentation.

View k of sample i is drawn with ``random.Random("aug:{S}:{k}:{i}")`` — the loader's own seed for
epoch k of a run seeded S (``--teacher-seed``) — by the augmentation ``--teacher-augment`` names (the
``data.*`` crop, flip and colour keys; none: the deterministic centre crop), at the teacher's image
size and normalisation, through the loader's decoder (:func:`~clipkit.data.transforms.decode_transformed`).
Training with ``stored: true`` replays view ``epoch mod K``: the loader seeds the sample's
augmentation with the stored seed, so the student sees the same crop, flip and colours the teacher
saw (at the student's size), and takes the text embedding of the caption it draws. The recipe's
augmentation keys must equal the stored ones (checked against the manifest's ``info.teacher``).

The arrays are ``numpy.save`` bytes, read back bit for bit. A sharding run with a teacher resumes by
re-reading the source (the teacher batches samples ahead of the writer, so the source's own position
would be ahead of what was written).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from clipkit.contract.types import Sample
from clipkit.errors import ClipkitError, DataError

IMAGE_MEMBER, TEXT_MEMBER, SEEDS_MEMBER = "teacher_image.npy", "teacher_text.npy", "teacher.json"
STORED_KEYS = ("teacher_image", "teacher_text")  # the batch keys the loader fills
#: The ``data.*`` keys that shape a view's pixels: stored views replay them, so they must match.
AUGMENT_KEYS = ("crop_scale", "crop_ratio", "hflip", "color_jitter", "grayscale", "background")
MANIFEST_KEY = "teacher"  # manifest info.teacher: what the stored embeddings are


@dataclass(frozen=True)
class AnnotatedSample(Sample):
    """A sample with extra tar members stored beside it as given (name -> bytes)."""

    members: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class TeacherSpec:
    """What ``clipkit shard --teacher`` stores: the teacher's path, K views per image drawn with
    seed S under the ``data.*`` augmentation ``augment``, embedded ``batch_size`` samples at a time."""

    path: str
    views: int = 1
    seed: int = 0
    augment: dict = field(default_factory=dict)
    batch_size: int = 64

    def settings(self) -> dict[str, Any]:
        """What a resumed sharding run must repeat (the journal's identity)."""
        return {"teacher": self.path, "views": self.views, "seed": self.seed, "augment": self.augment}


def augment_settings(augment: dict) -> dict[str, Any]:
    """``augment`` (``data.*`` keys) with every :data:`AUGMENT_KEYS` default filled in, as plain JSON."""
    from clipkit.config.settings_schema import DataConfig, check_host

    unknown = sorted(set(augment) - set(AUGMENT_KEYS))
    if unknown:
        raise ClipkitError(
            f"--teacher-augment: {unknown} are not augmentation keys ({', '.join(AUGMENT_KEYS)})"
        )
    errors = check_host({"data": augment})
    if errors:
        raise ClipkitError(f"--teacher-augment: {'; '.join(errors)}")
    data = DataConfig(**augment)
    return json.loads(json.dumps({key: getattr(data, key) for key in AUGMENT_KEYS}))


def view_seed(seed: int, view: int, sample_id: str) -> str:
    """The augmentation seed of view ``view`` of sample ``sample_id``: the loader's for epoch ``view``."""
    return f"aug:{seed}:{view}:{sample_id}"


def encode_array(array) -> bytes:
    """A float32 array -> ``numpy.save`` bytes (little-endian, no pickle)."""
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array, dtype="<f4"), allow_pickle=False)
    return buffer.getvalue()


def decode_array(data: bytes, where: str):
    """``numpy.save`` bytes -> a float32 array [rows, d]; a DataError naming ``where`` otherwise."""
    import numpy as np

    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise DataError(
            f"{where}: cannot be read as a .npy array ({error}); re-shard with --teacher"
        ) from None
    if array.dtype != np.float32 or array.ndim != 2:
        raise DataError(f"{where}: expected a float32 [rows, d] array, got {array.dtype} {array.shape}")
    return array


class TeacherAnnotated:
    """A source whose samples carry the teacher's embeddings (:class:`AnnotatedSample`); the teacher
    runs on ``spec.batch_size`` samples at a time. Has no ``state``/``restore``: see the module docs."""

    def __init__(self, samples: Iterable[Sample], teacher, spec: TeacherSpec) -> None:
        from clipkit.data.image_modes import parse_background
        from clipkit.data.transforms import ImageTransform

        self.samples, self.teacher, self.spec = samples, teacher, spec
        self.augment = augment_settings(spec.augment)
        base = teacher.transform
        options = {**self.augment, "background": parse_background(self.augment["background"])}
        options["crop_scale"], options["crop_ratio"] = (
            tuple(options["crop_scale"]),
            tuple(options["crop_ratio"]),
        )
        self.transform = ImageTransform(image_size=base.image_size, mean=base.mean, std=base.std, **options)

    def info(self) -> dict[str, Any]:
        inner = self.samples.info() if hasattr(self.samples, "info") else {}
        teacher = self.teacher
        return {
            **inner,
            MANIFEST_KEY: {
                "path": self.spec.path,
                "dim": teacher.dim,
                "scale": teacher.scale,
                "bias": teacher.bias,
                "views": self.spec.views,
                "seed": self.spec.seed,
                "augment": self.augment,
            },
        }

    def __iter__(self) -> Iterator[AnnotatedSample]:
        batch: list[Sample] = []
        index = 0  # the writer numbers samples in the order they come (resumes re-read from the start)
        for sample in self.samples:
            batch.append(sample)
            if len(batch) == self.spec.batch_size:
                yield from self.annotate(batch, index)
                index, batch = index + len(batch), []
        if batch:
            yield from self.annotate(batch, index)

    def annotate(self, samples: list[Sample], first_index: int) -> Iterator[AnnotatedSample]:
        """Embed ``samples`` (global indices from ``first_index``): K views each, every caption."""
        import random

        import torch

        from clipkit.data.transforms import decode_transformed

        spec, device = self.spec, self.teacher.device
        seeds = [[view_seed(spec.seed, k, str(first_index + i)) for k in range(spec.views)]
                 for i in range(len(samples))]  # fmt: skip
        views = [
            decode_transformed(s.image, self.transform, random.Random(seed), f"sample {s.key!r}")[0]
            for s, sample_seeds in zip(samples, seeds, strict=True)
            for seed in sample_seeds
        ]
        captions = [caption for s in samples for caption in s.captions]
        if len(captions) < len(samples):
            bare = next(s for s in samples if not s.captions)
            raise DataError(f"sample {bare.key!r} has no caption: --teacher embeds image-caption data")
        images = torch.stack(views).to(device)
        tokens = self.teacher.tokenizer(captions).to(device)
        image_embeddings = self.teacher.embed_image(images).cpu().numpy()  # [n·K, d]
        text_embeddings = self.teacher.embed_text(tokens).cpu().numpy()  # [Σ C, d]
        position = 0
        for i, sample in enumerate(samples):
            count = len(sample.captions)
            members = {
                IMAGE_MEMBER: encode_array(image_embeddings[i * spec.views : (i + 1) * spec.views]),
                TEXT_MEMBER: encode_array(text_embeddings[position : position + count]),
                SEEDS_MEMBER: json.dumps({"seeds": seeds[i]}).encode(),
            }
            position += count
            yield AnnotatedSample(sample.key, sample.image, sample.image_ext, sample.captions,
                                  sample.meta, members)  # fmt: skip


class StoredTeacher(NamedTuple):
    """A shard set's stored teacher (manifest ``info.teacher``): width, logit scale and bias, views."""

    dim: int
    scale: float
    bias: float
    views: int


def stored_teacher(shards: str, data) -> StoredTeacher:
    """The stored teacher of the shard directory ``shards``, after checking that the recipe's
    augmentation (``data``, a DataConfig) is the one its views were drawn with."""
    from pathlib import Path

    from clipkit.data.shard import read_manifest

    if not (Path(shards) / "manifest.json").is_file():
        raise DataError(
            f"{shards}: train.distill.stored reads a clipkit shard directory (with manifest.json)"
        )
    info = (read_manifest(shards).get("info") or {}).get(MANIFEST_KEY)
    if not isinstance(info, dict):
        raise DataError(
            f"{shards}: holds no teacher embeddings (its manifest has no info.teacher); shard it with "
            "`clipkit shard SOURCE OUT --teacher MODEL_DIR`, or set train.distill.teacher to run one"
        )
    recipe_augment = augment_settings({key: getattr(data, key) for key in AUGMENT_KEYS})
    differ = [key for key in AUGMENT_KEYS if recipe_augment[key] != info["augment"].get(key)]
    if differ:
        pairs = ", ".join(f"data.{key}: recipe {recipe_augment[key]!r}, stored {info['augment'].get(key)!r}"
                          for key in differ)  # fmt: skip
        raise DataError(
            f"{shards}: the stored teacher views were drawn with another augmentation ({pairs}); set "
            "those keys as stored, or re-shard with --teacher-augment"
        )
    return StoredTeacher(int(info["dim"]), float(info["scale"]), float(info["bias"]), int(info["views"]))


class StoredView(NamedTuple):
    """What a stored sample gives one epoch: its augmentation seed, image embedding [d] and the
    text embeddings of its captions [C, d]."""

    seed: str
    image: Any
    texts: Any


def stored_view(record: dict[str, Any], epoch: int, where: str) -> StoredView:
    """Sample ``record``'s stored view for ``epoch`` (view ``epoch mod K``)."""
    missing = [name for name in (IMAGE_MEMBER, TEXT_MEMBER, SEEDS_MEMBER) if name not in record]
    if missing:
        raise DataError(
            f"{where}: has no {', '.join(missing)}; train.distill.stored needs shards from "
            "`clipkit shard --teacher`"
        )
    try:
        seeds = json.loads(record[SEEDS_MEMBER])["seeds"]
    except (ValueError, KeyError, TypeError):
        raise DataError(f'{where}: its {SEEDS_MEMBER} is not {{"seeds": [...]}}') from None
    images = decode_array(record[IMAGE_MEMBER], f"{where} {IMAGE_MEMBER}")
    if not isinstance(seeds, list) or len(seeds) != images.shape[0] or not seeds:
        raise DataError(
            f"{where}: {len(seeds) if isinstance(seeds, list) else '?'} seeds for "
            f"{images.shape[0]} stored views"
        )
    view = epoch % len(seeds)
    return StoredView(
        str(seeds[view]), images[view], decode_array(record[TEXT_MEMBER], f"{where} {TEXT_MEMBER}")
    )


@dataclass(frozen=True)
class DistillInputs:
    """What the loader adds to each batch for distillation: the stored embeddings (``stored``) and/or
    the caption tokenized for a live teacher with its own tokenizer (``tokenizer``)."""

    stored: bool = False
    tokenizer: Any = None
