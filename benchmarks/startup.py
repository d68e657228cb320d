"""Start-up cost of shell commands, run interleaved (A B C A B C ...) so load drifts hit all alike.

    python benchmarks/startup.py --runs 9 "python -c 'import torch'" "clipkit eval EXPORT ..."

For each command: the median (min-max) of its process CPU time (user + system of the command and
its children, from ``getrusage(RUSAGE_CHILDREN)``: other jobs on shared cores do not count) and of
its wall time, and the ratio of each to the first command's *in the same round*, median (min-max)
over the rounds. The commands must succeed (a failing one stops the measurement with its output).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import time

from measure import spread


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(command: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one run of ``command``."""
    cpu, start = children_cpu(), time.perf_counter()
    done = subprocess.run(command, shell=True, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, children_cpu() - cpu
    if done.returncode != 0:
        raise SystemExit(f"{command!r} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return cpu, wall


def measure(commands: list[str], runs: int) -> list[list[tuple[float, float]]]:
    """rounds[r][c] = (CPU s, wall s) of command c in round r."""
    return [[run_once(command) for command in commands] for _ in range(runs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commands", nargs="+")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    rounds = measure(args.commands, args.runs)
    print("| command | CPU s | × first, CPU (same round) | wall s | × first, wall (same round) |")
    print("|---|---|---|---|---|")
    for c, command in enumerate(args.commands):
        cpu = [r[c][0] for r in rounds]
        wall = [r[c][1] for r in rounds]
        cpu_ratio = [r[c][0] / r[0][0] for r in rounds]
        wall_ratio = [r[c][1] / r[0][1] for r in rounds]
        cells = [spread(values, 2) for values in (cpu, cpu_ratio, wall, wall_ratio)]
        print(f"| `{command}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
