"""What a 2-rank launch costs from the command's start to its exit, this checkout against another, side by side.

    git -C /path/to/repo archive <commit> | tar -x -C /tmp/base     # the checkout to compare with
    python benchmarks/launch_latency.py --base /tmp/base --rounds 3 [RECIPE] [--set KEY=VALUE ...]

Each round runs the same `recipe run` (default: quickstart, 2 optimizer steps without warm-up) once with the other
checkout first on PYTHONPATH, once with this one, alternating, on the same machine; it prints each run's wall time,
its processes' CPU time and the ranks' "first optimizer step after" line, then the medians. Timing a launch on a
shared machine is noisy: compare the two columns of one invocation, not numbers across invocations.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIRST_STEP = re.compile(r"first optimizer step after ([\d.]+)s \((.*)\)")


def one_launch(pythonpath: str | None, recipe: str, sets: list[str], run_dir: Path) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the launcher and its ranks, the phases line) of one run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONUNBUFFERED"] = "1"
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    command = [sys.executable, "-m", "accel_fsdp", "recipe", "run", recipe, "--output-dir", str(run_dir),
               "--overwrite", *[a for s in sets for a in ("--set", s)]]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=run_dir.parent)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"exit status {proc.returncode}:\n{proc.stderr[-3000:]}")
    found = FIRST_STEP.search(proc.stdout)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, cpu, found.group(0) if found else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default="quickstart")
    parser.add_argument("--base", required=True, help="the other checkout (its accel_fsdp/ goes first on PYTHONPATH)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", dest="sets", action="append", default=None)
    args = parser.parse_args()
    sets = args.sets if args.sets is not None else ["training.max_steps=2", "training.warmup_steps=0"]
    recipe = args.recipe if not Path(args.recipe).exists() else str(Path(args.recipe).resolve())
    results: dict[str, list[tuple[float, float]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="launch-latency-") as work:
        for _ in range(args.rounds):
            for label, path in (("base", str(Path(args.base).resolve())), ("this", None)):
                wall, cpu, phases = one_launch(path, recipe, sets, Path(work) / label)
                results[label].append((wall, cpu))
                print(f"{label:4}  wall {wall:6.2f} s  cpu {cpu:6.2f} s  {phases}  (load {os.getloadavg()[0]:.1f})",
                      flush=True)
    for label, rows in results.items():
        print(f"{label:4}  median wall {statistics.median(w for w, _ in rows):.2f} s, "
              f"median cpu {statistics.median(c for _, c in rows):.2f} s")


if __name__ == "__main__":
    main()
