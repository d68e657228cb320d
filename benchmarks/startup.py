"""Process wall time of shell commands, run interleaved (A B C A B C ...) so load drifts hit all alike.

    python benchmarks/startup.py --runs 7 "python -c 'import torch'" "clipkit eval EXPORT ..."

Prints, per command, the median and range (min-max) of the wall times in seconds. The commands
must succeed (a failing one stops the measurement with its output).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time


def measure(commands: list[str], runs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {command: [] for command in commands}
    for _ in range(runs):
        for command in commands:
            start = time.perf_counter()
            done = subprocess.run(command, shell=True, capture_output=True, text=True)
            elapsed = time.perf_counter() - start
            if done.returncode != 0:
                raise SystemExit(f"{command!r} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
            times[command].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commands", nargs="+")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    for command, values in measure(args.commands, args.runs).items():
        print(f"{statistics.median(values):6.2f} s  (range {min(values):.2f}-{max(values):.2f}, "
              f"{len(values)} runs)  {command}")  # fmt: skip


if __name__ == "__main__":
    main()
