"""Merge the GPU check's part files into ``results.json`` and a short Markdown ``table.md``; print the table.

    python benchmarks/gpu/summarize.py --parts WORK --status STATUS.tsv --junit pytest.xml --results DIR

``WORK`` holds one ``NAME.json`` per part (benchmarks/gpu/common.py ``write_part``); ``STATUS.tsv``
the run script's ``step<TAB>status<TAB>seconds`` lines; ``pytest.xml`` the gpu tests' JUnit report
(absent when the tests did not run). Every figure goes to results.json as measured; the table
rounds them.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def read_parts(work: Path) -> list[dict]:
    parts = []
    for path in sorted(work.glob("*.json")):
        try:
            parts.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as error:
            parts.append({"part": path.stem, "figures": [], "skipped": [f"unreadable result file: {error}"]})
    return parts


def read_status(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        name, status, seconds = (line.split("\t") + ["", ""])[:3]
        rows.append({"step": name, "status": status, "seconds": int(seconds or 0)})
    return rows


def read_junit(path: Path) -> dict:
    """Counts of the gpu tests and the names (with the first line of the message) of those that failed."""
    if not path.is_file():
        return {"ran": False}
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError as error:
        return {"ran": False, "error": f"unreadable {path.name}: {error}"}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in root.iter("testcase"):
        if case.get("name") is None:  # what pytest writes when a signal stops it: no test
            continue
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            counts["failed"] += 1
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            failures.append(f"{case.get('classname')}::{case.get('name')}: {(message or [''])[0][:200]}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {"ran": True, **counts, "failures": failures}


def format_value(value) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if value == 0 or 0.01 <= abs(value) < 1e5:
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return f"{value:.3g}"


def markdown(parts: list[dict], status: list[dict], tests: dict) -> str:
    device = next((p["device"] for p in parts if p.get("device")), {})
    lines = [
        f"GPU check on {device.get('gpu') or 'CPU (rehearsal)'}, torch {device.get('torch', '?')}"
        + (" — REHEARSAL, toy sizes: no figure here means anything" if device.get("rehearsal") else ""),
        "",
        "| step | status | s |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {row['step']} | {row['status']} | {row['seconds']} |" for row in status]
    if tests.get("ran"):
        counts = f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped"
        finished = next((row["status"] == "ok" for row in status if row["step"] == "tests"), True)
        partial = (
            "" if finished else " (PARTIAL: the step did not finish; pytest.log names the last test run)"
        )
        lines += ["", f"gpu tests: {counts}{partial}"]
        lines += [f"- FAILED {failure}" for failure in tests["failures"]]
    lines += ["", "| part | figure | value | unit | goal | met |", "| --- | --- | --- | --- | --- | --- |"]
    for part in parts:
        for fig in part.get("figures", []):
            met = {True: "yes", False: "**no**", None: ""}[fig.get("met")]
            lines.append(
                f"| {part['part']} | {fig['name']} | {format_value(fig['value'])} | {fig.get('unit', '')} "
                f"| {fig.get('goal') or ''} | {met} |"
            )
    skipped = [(part["part"], reason) for part in parts for reason in part.get("skipped", [])]
    if skipped:
        lines += ["", "Not measured:"] + [f"- {name}: {reason}" for name, reason in skipped]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", type=Path, required=True)
    parser.add_argument("--status", type=Path, required=True)
    parser.add_argument("--junit", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    args = parser.parse_args()
    status, tests = read_status(args.status), read_junit(args.junit)
    order = {row["step"]: place for place, row in enumerate(status)}
    parts = sorted(
        (p for p in read_parts(args.parts) if p.get("part")), key=lambda p: order.get(p["part"], 99)
    )
    args.results.mkdir(parents=True, exist_ok=True)
    record = {"steps": status, "tests": tests, "parts": parts}
    (args.results / "results.json").write_text(json.dumps(record, indent=1, default=str))
    table = markdown(parts, status, tests)
    (args.results / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
