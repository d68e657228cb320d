"""Samples with several captions: reading them from shard fields, and drawing one per training visit.

A shard sample's captions are the ``captions`` list of its ``json`` (what ``clipkit shard``
writes), else its ``txt`` field, which may hold one caption or a JSON list of them
(``["a dog on grass", "a brown dog"]``). Training reads one caption per sample per epoch:
:func:`draw_caption`, a pure function of (seed, epoch, global index), so a resumed run, any
number of workers or ranks, and any augmentation settings see the same caption. Evaluation
(``retrieval``) uses all of them. Torch is never imported here.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence


def captions_from_text(text: str) -> list[str]:
    """A ``txt`` field's captions: a JSON list of strings is several captions, anything else is one.

    Only a whole-field list of strings counts ("[citation needed]" is not JSON; ``[1, 2]`` holds
    no captions), so a caption that merely starts with "[" stays one caption.
    """
    stripped = text.strip()
    if stripped.startswith("[") and stripped.endswith("]"):
        try:
            values = json.loads(stripped)
        except ValueError:
            return [text]
        if isinstance(values, list) and values and all(isinstance(value, str) for value in values):
            return values
    return [text]


def record_captions(meta: dict, txt: bytes | str | None) -> tuple[str, ...]:
    """The captions of a shard record: ``meta["captions"]`` (its json) when present, else those of
    its ``txt`` field (:func:`captions_from_text`), else none (a label-only sample)."""
    if isinstance(meta.get("captions"), list):
        return tuple(str(caption) for caption in meta["captions"])
    if txt is None:
        return ()
    text = txt.decode("utf-8") if isinstance(txt, bytes) else txt
    return tuple(caption for caption in captions_from_text(text) if caption.strip())


def draw_caption(captions: Sequence[str], *, seed: int, epoch: int, index: int | str) -> str:
    """The caption sample ``index`` is trained on in ``epoch`` of a run seeded ``seed``.

    A uniform draw from its own stream (not the augmentation's), so it depends on nothing else:
    not on the batch, the worker, the rank, the view count or the transform.
    """
    return captions[draw_caption_index(len(captions), seed=seed, epoch=epoch, index=index)]


def draw_caption_index(count: int, *, seed: int, epoch: int, index: int | str) -> int:
    """Which of a sample's ``count`` captions :func:`draw_caption` picks (stored teacher text
    embeddings are read by it)."""
    if count == 1:
        return 0
    return random.Random(f"caption:{seed}:{epoch}:{index}").randrange(count)
