"""The locks: refresh them, check them, and check what pip makes of them.

    python .ci/lock.py refresh [--upgrade]   rewrite requirements.lock and .ci/requirements.lock
    python .ci/lock.py check                 what a requirements file asks that its lock lacks
    python .ci/lock.py pip-dry-run PYTHON... pip's resolution of requirements.txt, per Python,
                                             against the lock

`refresh` runs uv (`pip install -r .ci/requirements.txt` brings the pinned one) as
`uv pip compile --universal --python-version <oldest>`: one file for every Python
requires-python allows, with markers where they differ, every platform. It keeps the versions
the lock already holds where the requirements still allow them (uv reads the output file as
preferences), so a changed pin moves only that package and what must move with it;
`--upgrade` resolves everything anew (what .ci/drift.py does, without writing). The launcher
(`-e ./launch`) is left out of the lock (pip refuses a constraint on a local project; its
dependencies, and those of the extras requirements.txt asks for, are in). The requirements
files' own `-c` lines are dropped from the copies uv reads: a lock is not resolved inside
itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lockfile  # noqa: E402
from lockfile import LOCKS, REFRESH, REPO, Lock, LockSpec, compare  # noqa: E402


def uv() -> str:
    """The uv executable: the `uv` package of this Python (.ci/requirements.txt), else PATH."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
    if found is None:
        raise SystemExit(
            "uv is not installed here: pip install -r .ci/requirements.txt (it pins uv), then "
            f"{REFRESH}"
        )
    return found


def without_constraints(source: Path, copy: Path) -> None:
    """`source` without its -c lines (a lock is not resolved inside itself)."""
    kept = []
    for line in source.read_text().splitlines():
        option = line.split(maxsplit=1)[0] if line.strip() else ""
        if option in ("-c", "--constraint") or option.startswith("--constraint="):
            continue
        kept.append(line)
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text("\n".join(kept) + "\n")


def compile_command(uv_bin: str, spec: LockSpec, local: list[str], upgrade: bool) -> list[str]:
    """uv's command for one lock, run in a folder laid out as the repository (relative paths:
    uv's `# via -r requirements.txt` annotations name the repository's files)."""
    command = [uv_bin, "pip", "compile", spec.requirements, "--output-file", spec.lock]
    command += ["--universal", "--python-version", spec.oldest_python]
    command += ["--custom-compile-command", REFRESH, "--quiet", "--no-python-downloads"]
    if spec.constrained_by:
        command += ["--constraints", spec.constrained_by]
    for name in local:
        command += ["--no-emit-package", name]
    return command + (["--upgrade"] if upgrade else [])


def resolve(specs: tuple[LockSpec, ...], work: Path, upgrade: bool, root: Path = REPO) -> None:
    """Write each spec's lock under `work` (laid out as `root`), in order (a lock another is
    resolved within comes first). Without `upgrade`, `root`'s locks are the preferences."""
    for spec in specs:
        without_constraints(root / spec.requirements, work / spec.requirements)
        found = lockfile.read_requirements(root / spec.requirements, root)
        for folder in found.local_folders:  # -e ./launch: uv reads it from `work`
            link = work / folder
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(root / folder, target_is_directory=True)
        if not upgrade and (root / spec.lock).exists():
            shutil.copyfile(root / spec.lock, work / spec.lock)
        command = compile_command(uv(), spec, found.local, upgrade)
        done = subprocess.run(command, cwd=work, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(
                f"uv could not lock {spec.requirements} (exit {done.returncode}):\n"
                + (done.stderr or done.stdout).strip()
            )
        problems = lockfile.stale(
            work / spec.requirements, work, work / spec.lock, spec.oldest_python
        )
        if problems:  # uv wrote something that does not hold what was asked: never keep it
            raise SystemExit("\n".join([f"{spec.lock} as uv wrote it:", *problems]))


def refresh(upgrade: bool) -> int:
    with tempfile.TemporaryDirectory(prefix="lock-") as folder:
        work = Path(folder)
        resolve(LOCKS, work, upgrade)  # every lock, before any is replaced
        for spec in LOCKS:
            old, new = REPO / spec.lock, work / spec.lock
            if not old.exists():
                said, moves = "new", []
            elif old.read_text() == new.read_text():
                said, moves = "unchanged", []
            else:
                moves = compare(Lock.read(old), Lock.read(new), spec.oldest_python)
                said = f"{len(moves)} package(s) moved" if moves else "annotations changed"
            staged = old.with_name(old.name + ".new")  # the lock is whole or not replaced
            shutil.copyfile(new, staged)
            os.replace(staged, old)
            print(f"{spec.lock}: {len(Lock.read(old).pins)} pins, {said}")
            for move in moves:
                print(f"  {move}")
    return 0


def check() -> int:
    problems = lockfile.check()
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print(", ".join(spec.lock for spec in LOCKS) + ": every version asked for is held")
    return 1 if problems else 0


def pip_dry_run(pythons: list[str]) -> int:
    """For each interpreter: a throwaway venv, `pip install --dry-run --ignore-installed
    --report -r requirements.txt` from the repository, and each package pip would install
    against the lock's version for that interpreter's environment (pip's report holds it)."""
    lock = Lock.read(REPO / LOCKS[0].lock)
    local = set(lockfile.read_requirements(REPO / LOCKS[0].requirements).local)
    failed = 0
    for python in pythons:
        with tempfile.TemporaryDirectory(prefix="pip-dry-run-") as folder:
            venv, report = Path(folder) / "venv", Path(folder) / "report.json"
            subprocess.run([python, "-m", "venv", str(venv)], check=True)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
            # an old ensurepip pip reads no PEP 658 metadata: it would download each wheel
            # (torch's CUDA build: GBs) only to read its dependencies
            subprocess.run([*pip, "install", "-q", "-U", "pip"], check=True)
            command = [*pip, "install", "--dry-run", "--ignore-installed", "--quiet"]
            command += ["--report", str(report), "-r", LOCKS[0].requirements]
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{python}: pip failed:\n{done.stderr.strip()}", file=sys.stderr)
                failed += 1
                continue
            found = json.loads(report.read_text())
        env = {**found["environment"], "extra": ""}
        held = lock.versions(env)
        wrong = []
        for item in found["install"]:
            name = lockfile.canonicalize_name(item["metadata"]["name"])
            version = lockfile.Version(item["metadata"]["version"]).public  # 2.14.1+cpu: 2.14.1
            if name in local:
                continue
            if held.get(name) != version:
                wrong.append(f"{name} {version} (the lock: {held.get(name) or 'none'})")
        label = f"Python {env['python_full_version']} ({python})"
        count = len(found["install"]) - len(local)
        if wrong:
            failed += 1
            print(f"{label}: {len(wrong)} of {count} off the lock: {', '.join(wrong)}")
        else:
            print(f"{label}: pip would install {count} packages, each at the lock's version")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python .ci/lock.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    refresh_cmd = commands.add_parser("refresh", help="rewrite the locks (uv)")
    refresh_cmd.add_argument(
        "--upgrade", action="store_true", help="resolve every package anew, not only what moved"
    )
    commands.add_parser("check", help="the requirements files against their locks (no network)")
    dry = commands.add_parser("pip-dry-run", help="pip's resolution per Python against the lock")
    dry.add_argument("python", nargs="+", help="interpreters (e.g. python3.10)")
    args = parser.parse_args(argv)
    if args.command == "refresh":
        return refresh(args.upgrade)
    if args.command == "check":
        return check()
    return pip_dry_run(args.python)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
