"""What installing hydra-ddp-launcher costs every Hydra app in the environment: Hydra's plugin
scan, which imports every module under `hydra_plugins` at every app's start.

    python launch/bench/plugin_scan.py [--runs 20] [--hydra 1.3.8] [--venvs DIR]

Two venvs (made in --venvs unless there, from this interpreter): `without` holds hydra-core
alone, `with` the same plus this checkout's launch/ installed as a user installs it (`pip
install ./launch`, no dependencies: the scan must import none of them, and another plugin's own
scan, hydra-submitit-launcher's, would blur the package's). Then `python -c "from
hydra.core.plugins import Plugins; Plugins.instance()"` in each, `--runs` times, alternating
(without, with, without, ...: a loaded machine slows both alike). Each run gives the command's
wall time and its CPU time (user + system: what the process itself spent, much less disturbed by
other processes than the wall), and from inside it Hydra's own scan statistics: the whole
scan's time and the package's modules' import time. Prints medians, their differences, the
spread (min, quartiles, max) and the machine's load; no assertion: figures only.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCH = Path(__file__).resolve().parents[1]
SCAN = "from hydra.core.plugins import Plugins; Plugins.instance()"
# The same scan, then what Hydra measured: the whole scan, and the package's plugin modules.
MEASURED = (
    f"{SCAN}; s = Plugins.instance().get_stats(); print(s.total_time, "
    "sum(t for m, t in s.modules_import_time.items() if 'hydra_ddp_launcher' in m))"
)


def venv(path: Path, hydra: str, package: bool) -> Path:
    """`path`'s interpreter, the venv made first where it is not there."""
    python = path / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, f"hydra-core=={hydra}"], check=True)
        if package:  # from a copy: pip builds in the source tree, and a stale build/ would ship
            with tempfile.TemporaryDirectory() as scratch:
                source = Path(scratch) / "launch"
                stale = shutil.ignore_patterns("build", "*.egg-info")
                shutil.copytree(LAUNCH, source, ignore=stale)
                subprocess.run([*pip, "--no-deps", str(source)], check=True)
    return python


def timed(python: Path, code: str) -> dict[str, float]:
    """`python -c code` run from /: its wall and CPU seconds, and what it printed (Hydra's
    scan time and the package's modules' import time)."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, cwd="/", check=True
    )
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    scan, modules = (float(v) for v in proc.stdout.split()[-2:])
    return {"wall": wall, "cpu": cpu, "scan": scan, "modules": modules}


def spread(values: list[float]) -> str:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return (
        f"median {statistics.median(values) * 1e3:7.1f} ms  (min {min(values) * 1e3:.1f}, "
        f"q1 {q1 * 1e3:.1f}, q3 {q3 * 1e3:.1f}, max {max(values) * 1e3:.1f})"
    )


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--hydra", default="1.3.8", help="hydra-core version in both venvs")
    parser.add_argument("--venvs", type=Path, default=Path("/tmp/hydra-ddp-plugin-scan"))
    args = parser.parse_args()
    without = venv(args.venvs / f"without-{args.hydra}", args.hydra, package=False)
    with_ = venv(args.venvs / f"with-{args.hydra}", args.hydra, package=True)
    timed(without, MEASURED), timed(with_, MEASURED)  # warm the file cache first
    load = os.getloadavg()
    runs: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
    for _ in range(args.runs):
        runs["without"].append(timed(without, MEASURED))
        runs["with"].append(timed(with_, MEASURED))
    print(f"Hydra {args.hydra}'s plugin scan, {args.runs} runs each, alternating")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {load} -> {os.getloadavg()}")
    for what, title in (
        ("wall", "`python -c ...` wall time"),
        ("cpu", "`python -c ...` CPU time (user + system)"),
        ("scan", "Plugins.instance()'s scan, Hydra's total_time"),
    ):
        print(title)
        for name, found in runs.items():
            print(f"  {name:>7} the package: {spread([r[what] for r in found])}")
        medians = [statistics.median(r[what] for r in runs[n]) for n in ("with", "without")]
        print(f"  the package's cost (difference of the medians): {medians[0] - medians[1]:.4f} s")
    print("the package's plugin modules, Hydra's modules_import_time")
    print(f"     with the package: {spread([r['modules'] for r in runs['with']])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
