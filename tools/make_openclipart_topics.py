"""Build the CLOOB-ablation table from the OpenClipArt drawings of ``../shared/data``.

    python tools/make_openclipart_topics.py /work/shared/data/openclipart topics.jsonl

Writes one JSONL row per drawing: ``image`` (absolute path), ``caption`` (the drawing's title, as
in the source table) and ``topic`` (the first component of its category, underscores as spaces:
``signs_and_symbols/flags/europe`` -> ``signs and symbols``; 16 topics), the label that
``clipkit experiment cloob-ablation --label topic`` classifies zero-shot. clipkit itself never
needs this folder; the script only reshapes a table a user could write by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def topic_rows(folder: Path):
    """Rows of ``folder``/captions.jsonl with absolute image paths and a ``topic`` column."""
    for line in (folder / "captions.jsonl").read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        yield {
            "image": str((folder / row["image"]).resolve()),
            "caption": row["caption"],
            "topic": row["category"].split("/")[0].replace("_", " "),
        }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    folder, out = Path(argv[0]), Path(argv[1])
    rows = list(topic_rows(folder))
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {out}: {len(rows)} rows, {len({row['topic'] for row in rows})} topics")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
