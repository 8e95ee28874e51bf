"""What a newcomer would get today: the requirements files resolved afresh, without the locks,
and the packages that moved against the committed ones (the workflow's weekly drift job runs
this, then the not-slow layer under the fresh resolution).

    python .ci/drift.py [--write]        resolve afresh (uv, as `lock.py refresh --upgrade`),
                                         print what moved; --write puts the fresh locks in
                                         place of requirements.lock and .ci/requirements.lock
    python .ci/drift.py compare OLD NEW  what moved between two lock files (no network)

One line per package that moved, `name old -> new (where)`: `(none)` for a package that
came or went, and the Pythons (and platforms, where not all) it moved for. Exit status 0 when
it resolved (moved or not: the tests under the fresh locks decide), 1 when a requirements file
no longer resolves at all (uv's reason printed), 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lock  # noqa: E402
from lockfile import LOCKS, REPO, Lock, Move, compare  # noqa: E402


def moved_lines(moves: list[Move], old: str, new: str) -> list[str]:
    if not moves:
        return [f"nothing moved: {new} holds what {old} holds"]
    return [f"{len(moves)} package(s) moved from {old} to {new}:", *(f"  {m}" for m in moves)]


def fresh(write: bool) -> int:
    with tempfile.TemporaryDirectory(prefix="drift-") as folder:
        work = Path(folder)
        try:
            lock.resolve(LOCKS, work, upgrade=True)  # no preferences: what pip would pick today
        except SystemExit as failed:  # uv's reason: a requirements file no longer resolves
            print(f"no fresh resolution: {failed}", file=sys.stderr)
            return 1
        for spec in LOCKS:
            committed, now = REPO / spec.lock, work / spec.lock
            moves = compare(Lock.read(committed), Lock.read(now), spec.oldest_python)
            print("\n".join(moved_lines(moves, spec.lock, f"a fresh {spec.lock}")))
        if write:  # every lock resolved before any is replaced
            for spec in LOCKS:
                staged = REPO / f"{spec.lock}.new"
                shutil.copyfile(work / spec.lock, staged)
                os.replace(staged, REPO / spec.lock)
            print(f"written: {', '.join(spec.lock for spec in LOCKS)}")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python .ci/drift.py", description=__doc__.split("\n")[0])
    if argv[:1] == ["compare"]:
        parser.add_argument("compare", choices=["compare"])
        parser.add_argument("old", type=Path)
        parser.add_argument("new", type=Path)
        args = parser.parse_args(argv)
        for path in (args.old, args.new):
            if not path.is_file():
                parser.error(f"{path} is not a file")
        try:
            moves = compare(Lock.read(args.old), Lock.read(args.new), LOCKS[0].oldest_python)
        except ValueError as bad:  # not a lock uv wrote (lockfile.Lock.read says the line)
            print(f"python .ci/drift.py compare: {bad}", file=sys.stderr)
            return 2
        print("\n".join(moved_lines(moves, str(args.old), str(args.new))))
        return 0
    parser.add_argument(
        "--write", action="store_true", help="replace the repository's locks with the fresh ones"
    )
    args = parser.parse_args(argv)
    return fresh(args.write)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
