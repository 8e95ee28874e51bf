"""What a newcomer would get today: requirements.txt resolved afresh, without the lock, and the
packages that moved against requirements.lock (the workflow's weekly drift job runs this, then
the not-slow layer under the fresh resolution).

    python .ci/drift.py [--out FILE]     resolve afresh (uv, as `lock.py refresh --upgrade`),
                                         print what moved, write the fresh lock to FILE
    python .ci/drift.py compare OLD NEW  what moved between two lock files (no network)

One line per package that moved, `name old -> new (where)`: `(none)` for a package that
came or went, and the Pythons (and platforms, where not all) it moved for. Exit status 0 when
it resolved (moved or not; the tests under the fresh lock decide), 1 when requirements.txt no
longer resolves at all (uv's reason printed), 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lock  # noqa: E402
from lockfile import LOCKS, REPO, Lock, Move, compare  # noqa: E402

APP = LOCKS[0]  # requirements.txt and requirements.lock


def moved_lines(moves: list[Move], old: str, new: str) -> list[str]:
    if not moves:
        return [f"nothing moved: {new} holds what {old} holds"]
    return [f"{len(moves)} package(s) moved from {old} to {new}:", *(f"  {m}" for m in moves)]


def fresh(out: Path | None) -> int:
    with tempfile.TemporaryDirectory(prefix="drift-") as folder:
        work = Path(folder)
        try:
            lock.resolve((APP,), work, upgrade=True)
        except SystemExit as failed:  # uv's reason: requirements.txt itself no longer resolves
            print(f"requirements.txt does not resolve afresh: {failed}", file=sys.stderr)
            return 1
        committed = Lock.read(REPO / APP.lock)
        moves = compare(committed, Lock.read(work / APP.lock), APP.oldest_python)
        print("\n".join(moved_lines(moves, APP.lock, "the fresh resolution")))
        if out is not None:
            shutil.copyfile(work / APP.lock, out)
            print(f"the fresh resolution: {out}")
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
            moves = compare(Lock.read(args.old), Lock.read(args.new), APP.oldest_python)
        except ValueError as bad:  # not a lock uv wrote (lockfile.Lock.read says the line)
            print(f"python .ci/drift.py compare: {bad}", file=sys.stderr)
            return 2
        print("\n".join(moved_lines(moves, str(args.old), str(args.new))))
        return 0
    parser.add_argument(
        "--out", type=Path, help="write the fresh lock here (e.g. requirements.lock)"
    )
    args = parser.parse_args(argv)
    return fresh(args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
