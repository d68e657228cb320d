"""Concept-held-out splits of real captioned images, for tuning and checking the own-data defaults.

``clipkit train RECIPE --data TRAIN.jsonl --eval-data EVAL.jsonl --label concept`` on one of these
splits trains on some concepts and evaluates retrieval and zero-shot on concepts it never saw
(docs/own-data.md gives the figures). Built from ``../shared/data`` (not shipped with clipkit):

- ``openclipart-<salt>``: the 2 512 OpenClipArt drawings, captioned by their title; the concept of
  a drawing is its category below the top level (``food/fruit`` -> ``fruit``, ``people`` ->
  ``people``). Concepts with at least ``--min-rows`` drawings are held out by a salted hash
  (about a quarter of them); the concepts ``flags`` and ``led`` (one style each) always train.
  A training drawing whose title or picture also occurs among the held-out ones is dropped, so
  no held-out drawing was seen in training under another category.
- ``keywords-<salt>``: the same drawings with the concept taken from their keywords instead (the
  first of a fixed list of common nouns that the drawing's keywords hold), held out the same way;
  a drawing with none of them is trained on.

Usage::

    python benchmarks/own_data_splits.py OUT [--data ../shared/data] [--salts 0 1]

writes ``OUT/<split>/train.jsonl`` and ``OUT/<split>/eval.jsonl`` (absolute image paths, columns
``image``, ``caption``, ``concept``) and prints each split's sizes and held-out concepts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter
from pathlib import Path

ALWAYS_TRAINED = {"flags", "led"}
#: Keyword concepts (common nouns) for the ``keywords`` splits, in order of precedence.
KEYWORD_CONCEPTS = (
    "bird", "cat", "dog", "fish", "insect", "flower", "tree", "fruit", "car", "house", "boat",
    "book", "phone", "computer", "clock", "guitar", "ball", "hat", "shoe", "food", "drink",
    "cake", "star", "heart", "arrow", "map", "person", "face", "woman", "man", "child", "tool",
    "animal", "plant", "building", "vehicle", "music", "sport", "game", "money",
)  # fmt: skip


def held_out(concept: str, salt: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{salt}:{concept}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def category_concept(row: dict) -> str:
    parts = row["category"].split("/")
    return (parts[1] if len(parts) > 1 else parts[0]).replace("_", " ")


def keyword_concept(row: dict) -> str | None:
    words = {word.lower() for word in row.get("keywords") or []}
    return next((concept for concept in KEYWORD_CONCEPTS if concept in words), None)


def split(rows: list[dict], concept_of, salt: int, fraction: float, min_rows: int):
    """(train rows, eval rows) with every row's ``concept``; no drawing on both sides."""
    rows = [{**row, "concept": concept_of(row) or ""} for row in rows]  # no concept: trained on
    counts = Counter(row["concept"] for row in rows if row["concept"])
    eligible = [c for c, n in counts.items() if n >= min_rows and c not in ALWAYS_TRAINED]
    held = {c for c in eligible if held_out(c, salt, fraction)}
    evals = [row for row in rows if row["concept"] in held]
    seen_titles = {row["title"].lower() for row in evals}
    seen_pictures = {row["source_png"].rsplit("/", 1)[-1] for row in evals}
    train = [
        row
        for row in rows
        if row["concept"] not in held
        and row["title"].lower() not in seen_titles
        and row["source_png"].rsplit("/", 1)[-1] not in seen_pictures
    ]
    return train, evals


def write(rows: list[dict], path: Path, images: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            record = {"image": str(images / row["image"]), "caption": row["caption"]}
            record["concept"] = row["concept"]
            out.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    parser.add_argument("--salts", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--min-rows", type=int, default=8)
    args = parser.parse_args()
    root = (args.data / "openclipart").resolve()
    rows = [json.loads(line) for line in (root / "captions.jsonl").read_text(encoding="utf-8").splitlines()]
    for kind, concept_of in (("openclipart", category_concept), ("keywords", keyword_concept)):
        for salt in args.salts:
            train, evals = split(rows, concept_of, salt, args.fraction, args.min_rows)
            name = f"{kind}-{salt}"
            write(train, args.out / name / "train.jsonl", root)
            write(evals, args.out / name / "eval.jsonl", root)
            counts = Counter(row["concept"] for row in evals)
            majority = max(counts.values()) / len(evals)
            print(
                f"{name}: train {len(train)}, eval {len(evals)} ({len(counts)} concepts, majority "
                f"{majority:.3f}, retrieval chance 1/{len(evals)}): {dict(counts.most_common())}"
            )


if __name__ == "__main__":
    main()
