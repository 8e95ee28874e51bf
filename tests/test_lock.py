"""The locks (requirements.lock, .ci/requirements.lock; docs/architecture.md#versions-and-the-lock):
they hold every version requirements.txt, .ci/requirements.txt and launch/pyproject.toml ask
for, a pin changed without a refresh fails naming its package, and the drift check's comparison
(.ci/drift.py) names what moved. No network: uv runs only in `python .ci/lock.py refresh` and
`python .ci/drift.py`, not here."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
# requirements.txt's editable launcher line (with the extras the experiment asks for)
LAUNCH_LINE = next(
    line + "\n"
    for line in (REPO / "requirements.txt").read_text().splitlines()
    if line.startswith("-e ./launch")
)


def ci(name: str):
    """A module of .ci/ (not a package: its scripts import each other by name)."""
    path = REPO / ".ci" / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None and Path(loaded.__file__).resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: its dataclasses look it up
    spec.loader.exec_module(module)
    return module


lockfile = ci("lockfile")
PYTHONS = lockfile.supported_pythons()


def test_the_locks_hold_every_version_asked_for():
    """requirements.txt (and launch/pyproject.toml through `-e ./launch`) against
    requirements.lock, .ci/requirements.txt against .ci/requirements.lock, and the two locks
    agree on every package they share; each requirements file names its lock with -c."""
    assert lockfile.check() == []
    assert PYTHONS == ["3.10", "3.11", "3.12", "3.13"]  # requires-python, the workflow's matrix


def test_the_lock_pins_each_package_of_requirements_txt_as_asked_on_each_python():
    """Read back, the lock gives each Python the version requirements.txt pins for it (its
    markers: numpy 2.2.6 on 3.10, 2.4.6 above), exactly one per package, and torch by its
    version alone (a local CPU build, 2.14.1+cpu, matches it)."""
    lock = lockfile.Lock.read(REPO / "requirements.lock")
    asked = lockfile.read_requirements(REPO / "requirements.txt").asked
    pins = [a.requirement for a in asked if a.where.startswith("requirements.txt")]
    assert len(pins) > 20
    for python in PYTHONS:
        env = lockfile.environment(python)
        versions = lock.versions(env)
        for requirement in pins:
            if requirement.marker is None or requirement.marker.evaluate(env):
                (spec,) = requirement.specifier
                assert versions[lockfile.canonicalize_name(requirement.name)] == spec.version
    assert {"torch==2.14.1"} == {
        f"{p.name}=={p.version}" for p in lock.pins if p.name == "torch"
    }  # requirements.txt's pin, no local label
    assert "hydra-ddp-launcher" not in {p.name for p in lock.pins}  # pip refuses it (-e ./launch)
    # the launcher's own dependencies are in, brought by it (uv's annotation)
    assert "hydra-ddp-launcher" in next(p for p in lock.pins if p.name == "submitit").via
    lines = (REPO / "requirements.lock").read_text().splitlines()
    assert lines[1].strip() == f"#    {lockfile.REFRESH}"  # written by the documented command
    assert (REPO / "requirements.txt").read_text().splitlines().count("-c requirements.lock") == 1


def changed_copy(tmp_path: Path, source: str, old: str, new: str) -> Path:
    """A copy of the repository's `source` with one line changed, beside copies of the locks
    (its -c line then finds them as pip would)."""
    text = (REPO / source).read_text()
    assert old == new or text.count(old) == 1, old
    copy = tmp_path / source
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text.replace(old, new))
    for lock in ("requirements.lock", ".ci/requirements.lock"):
        if not (tmp_path / lock).exists():
            (tmp_path / lock).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / lock, tmp_path / lock)
    return copy


def pins_of_requirements_txt() -> list[tuple[int, str, Requirement]]:
    """(line number, line, requirement) of requirements.txt's exact pins."""
    found = []
    for number, line in enumerate((REPO / "requirements.txt").read_text().splitlines(), 1):
        if line and not line.startswith(("#", "-")):
            requirement = Requirement(line)
            if [s.operator for s in requirement.specifier] == ["=="]:
                found.append((number, line, requirement))
    return found


def held(name: str, python: str, lock: str = "requirements.lock") -> str:
    return lockfile.Lock.read(REPO / lock).versions(lockfile.environment(python))[name]


FIX = "refresh the lock with python .ci/lock.py refresh"


def test_a_pin_changed_without_refreshing_the_lock_fails_naming_the_package(tmp_path):
    """One pin of requirements.txt moved, one Python-specific pin moved (where a line pins for
    some Pythons only, numpy's on 3.11 and up), one package added: each problem names its
    package, the line asking, what the lock holds, the Pythons concerned and the refresh
    command; the file as committed has none."""
    pins = pins_of_requirements_txt()
    number, line, requirement = next(p for p in pins if p[2].marker is None)
    name, (spec,) = requirement.name, requirement.specifier
    moved = f"{name}=={spec.version}.999"
    copy = changed_copy(tmp_path, "requirements.txt", f"\n{line}\n", f"\n{moved}\n")
    assert lockfile.stale(copy) == [
        f"{name}: requirements.txt:{number} asks for '{moved}', requirements.lock holds {name} "
        f"{spec.version} (Python {', '.join(PYTHONS)}): {FIX}"
    ]

    number, line, requirement = next(
        p for p in pins if p[2].marker and not p[2].marker.evaluate(lockfile.environment("3.10"))
    )
    (spec,) = requirement.specifier
    for_pythons = [p for p in PYTHONS if requirement.marker.evaluate(lockfile.environment(p))]
    assert 0 < len(for_pythons) < len(PYTHONS)
    moved = line.replace(f"=={spec.version}", f"=={spec.version}.999")
    copy = changed_copy(tmp_path, "requirements.txt", f"\n{line}\n", f"\n{moved}\n")
    assert lockfile.stale(copy) == [
        f"{requirement.name}: requirements.txt:{number} asks for '{Requirement(moved)}', "
        f"requirements.lock holds {requirement.name} {spec.version} "
        f"(Python {', '.join(for_pythons)}): {FIX}"
    ]  # the other Pythons have their own pin, which still holds

    copy = changed_copy(tmp_path, "requirements.txt", f"\n{line}\n", f"\n{line}\nno-such-dist\n")
    assert lockfile.stale(copy) == [
        f"no-such-dist: requirements.txt:{number + 1} asks for 'no-such-dist', requirements.lock "
        f"holds none (Python {', '.join(PYTHONS)}): {FIX}"
    ]

    copy = changed_copy(tmp_path, "requirements.txt", f"\n{line}\n", f"\n{line}\n")
    assert lockfile.stale(copy) == []  # the file as committed


LAUNCHER = """\
[project]
name = "hydra-ddp-launcher"
version = "0.1.0"
dependencies = ["hydra-core>=1.3.2", "optuna>=99"]

[project.optional-dependencies]
plots = ["matplotlib>=99"]
wandb = ["wandb>=0.19"]
all = ["hydra-ddp-launcher[plots,wandb]"]
"""


def test_the_launchers_dependencies_and_asked_extras_are_checked_too(tmp_path):
    """A launcher's pyproject.toml (`-e ./launch`): its dependencies, and those of each extra
    requirements.txt asks for (`-e ./launch[...]`, an extra naming the package itself
    included), must be held by the lock too; an extra nobody asks for is not checked; an extra
    that does not exist is an error."""
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "pyproject.toml").write_text(LAUNCHER)
    requirements = changed_copy(tmp_path, "requirements.txt", LAUNCH_LINE, "-e ./launch\n")
    optuna = f"requirements.lock holds optuna {held('optuna', '3.10')}"
    assert lockfile.stale(requirements, root=tmp_path) == [
        "optuna: launch/pyproject.toml [project.dependencies] asks for 'optuna>=99', "
        f"{optuna} (Python {', '.join(PYTHONS)}): {FIX}"
    ]  # and not matplotlib>=99: no extra asked for

    (tmp_path / "launch" / "pyproject.toml").write_text(LAUNCHER.replace("optuna>=99", "optuna"))
    requirements.write_text(requirements.read_text().replace("-e ./launch\n", "-e ./launch[all]\n"))
    asks = "launch/pyproject.toml [project.optional-dependencies] plots asks for 'matplotlib>=99'"
    versions: dict[str, list[str]] = {}
    for python in PYTHONS:
        versions.setdefault(held("matplotlib", python), []).append(python)
    assert lockfile.stale(requirements, root=tmp_path) == [
        f"matplotlib: {asks}, requirements.lock holds matplotlib {version} (Python "
        f"{', '.join(pythons)}): {FIX}"
        for version, pythons in versions.items()
    ]
    requirements.write_text(requirements.read_text().replace("[all]", "[nope]"))
    with pytest.raises(ValueError, match=r"has no extra \[nope\]"):
        lockfile.stale(requirements, root=tmp_path)


def test_a_lock_naming_the_launcher_or_not_named_fails(tmp_path):
    """pip refuses a constraint on a local project: a lock that pins the launcher fails; so
    does a requirements file that names no lock (the lock would not be applied at all)."""
    requirements = changed_copy(tmp_path, "requirements.txt", LAUNCH_LINE, "-e ./launch\n")
    lock = tmp_path / "requirements.lock"
    lock.write_text(lock.read_text() + "hydra-ddp-launcher==0.1.0\n    # via -r requirements.txt\n")
    (problem,) = lockfile.stale(requirements)
    assert problem.startswith("hydra-ddp-launcher: pip refuses a constraint on a local project")
    requirements.write_text(requirements.read_text().replace("-c requirements.lock\n", ""))
    assert lockfile.stale(requirements) == [
        "requirements.txt must name its lock with one -c line (it names none)"
    ]


def test_the_tools_lock_agrees_with_the_apps(tmp_path):
    """.ci/requirements.lock is resolved within requirements.lock: a package both hold (ruff)
    at two versions fails, naming it."""
    for name in ("requirements.txt", ".ci/requirements.txt", "launch/pyproject.toml"):
        changed_copy(tmp_path, name, "\n", "\n")
    assert lockfile.check(tmp_path) == []
    ruff = held("ruff", "3.11")
    assert held("ruff", "3.11", ".ci/requirements.lock") == ruff
    tools = tmp_path / ".ci" / "requirements.lock"
    tools.write_text(tools.read_text().replace(f"ruff=={ruff}\n", "ruff==0.0.1\n"))
    assert lockfile.check(tmp_path) == [
        f"ruff: .ci/requirements.lock holds ruff 0.0.1, requirements.lock holds {ruff} (Python "
        "3.11, 3.12, 3.13): python .ci/lock.py refresh"
    ]


def test_a_lock_that_pins_a_package_twice_for_one_python_is_refused(tmp_path):
    lock = tmp_path / "broken.lock"
    lock.write_text("numpy==2.2.6\nnumpy==2.4.6 ; python_full_version >= '3.11'\n")
    with pytest.raises(ValueError, match=r"numpy is pinned twice for one environment \(lines 1"):
        lockfile.Lock.read(lock).versions(lockfile.environment("3.12"))
    lock.write_text("numpy>=2\n")
    with pytest.raises(ValueError, match="broken.lock:1: numpy>=2 is not an exact pin"):
        lockfile.Lock.read(lock)


OLD = """\
colorama==0.4.6 ; sys_platform == 'win32'
    # via tqdm
numpy==2.2.6 ; python_full_version < '3.11'
    # via -r requirements.txt
numpy==2.4.6 ; python_full_version >= '3.11'
    # via -r requirements.txt
python-dateutil==2.9.0.post0
    # via matplotlib
six==1.17.0
    # via python-dateutil
tqdm==4.70.1
    # via -r requirements.txt
"""
# a week later: dateutil 4 dropped six and needs tzdata, numpy 2.5 for 3.13 only (another split
# of the same Pythons), colorama moved (Windows only), tqdm stayed
NEW = """\
colorama==0.4.7 ; sys_platform == 'win32'
    # via tqdm
numpy==2.2.6 ; python_full_version < '3.11'
    # via -r requirements.txt
numpy==2.4.6 ; python_full_version >= '3.11' and python_full_version < '3.13'
    # via -r requirements.txt
numpy==2.5.0 ; python_full_version >= '3.13'
    # via -r requirements.txt
python-dateutil==4.0.0
    # via matplotlib
tqdm==4.70.1
    # via -r requirements.txt
tzdata==2026.6
    # via python-dateutil
"""
MOVED = [
    "colorama 0.4.6 -> 0.4.7 (Python 3.10, 3.11, 3.12, 3.13 on windows-amd64)",
    "numpy 2.4.6 -> 2.5.0 (Python 3.13)",
    "python-dateutil 2.9.0.post0 -> 4.0.0 (Python 3.10, 3.11, 3.12, 3.13)",
    "six 1.17.0 -> (none) (Python 3.10, 3.11, 3.12, 3.13)",
    "tzdata (none) -> 2026.6 (Python 3.10, 3.11, 3.12, 3.13)",
]


def test_drift_names_each_package_that_moved_for_the_pythons_it_moved_on(tmp_path):
    """The drift check's comparison, environment by environment (not line by line: a new
    marker split of the same versions is no move)."""
    old, new = tmp_path / "old.lock", tmp_path / "new.lock"
    old.write_text(OLD)
    new.write_text(NEW)
    moves = lockfile.compare(lockfile.Lock.read(old), lockfile.Lock.read(new))
    assert [str(m) for m in moves] == MOVED
    assert lockfile.compare(lockfile.Lock.read(old), lockfile.Lock.read(old)) == []
    resplit = OLD.replace(
        "numpy==2.4.6 ; python_full_version >= '3.11'",
        "numpy==2.4.6 ; python_full_version >= '3.11' and python_full_version < '3.13'",
    )
    resplit += "numpy==2.4.6 ; python_full_version >= '3.13'\n    # via -r requirements.txt\n"
    new.write_text(resplit)
    assert lockfile.compare(lockfile.Lock.read(old), lockfile.Lock.read(new)) == []


def test_drift_script_compares_two_lock_files_from_its_command_line(tmp_path):
    """`python .ci/drift.py compare OLD NEW`: the same lines, exit 0; a file that is not a lock:
    one line naming file and line, exit 2."""
    old, new = tmp_path / "old.lock", tmp_path / "new.lock"
    old.write_text(OLD)
    new.write_text(NEW)
    drift = [sys.executable, str(REPO / ".ci" / "drift.py"), "compare"]
    done = subprocess.run([*drift, str(old), str(new)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"{len(MOVED)} package(s) moved from {old} to {new}:",
        *(f"  {line}" for line in MOVED),
    ]
    done = subprocess.run(
        [*drift, str(old), str(REPO / "README.md")], capture_output=True, text=True
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "README.md:3: not a lock line" in done.stderr  # its first line not a comment


def test_the_refresh_and_drift_resolve_as_documented(tmp_path):
    """The command uv runs (the same for the refresh and, with --upgrade, the drift check): one
    universal resolution from the oldest supported Python, the launcher left out, the header
    naming the refresh command; the requirements files reach uv without their own -c line."""
    lock = ci("lock")
    app, tools = lockfile.LOCKS
    command = lock.compile_command("uv", app, ["hydra-ddp-launcher"], upgrade=False)
    assert command[:5] == ["uv", "pip", "compile", "requirements.txt", "--output-file"]
    assert command[command.index("--python-version") + 1] == PYTHONS[0] == app.oldest_python
    assert "--universal" in command and "--upgrade" not in command
    assert command[command.index("--no-emit-package") + 1] == "hydra-ddp-launcher"
    assert command[command.index("--custom-compile-command") + 1] == lockfile.REFRESH
    command = lock.compile_command("uv", tools, [], upgrade=True)
    assert command[command.index("--constraints") + 1] == "requirements.lock"
    assert "--upgrade" in command
    lock.without_constraints(REPO / "requirements.txt", tmp_path / "requirements.txt")
    copied = (tmp_path / "requirements.txt").read_text().splitlines()
    assert "-c requirements.lock" not in copied and LAUNCH_LINE.strip() in copied
    assert len(copied) == len((REPO / "requirements.txt").read_text().splitlines()) - 1


def test_the_workflow_checks_for_drift_weekly_and_on_demand():
    """tests.yml's drift job: on a schedule and workflow_dispatch only, it resolves afresh with
    .ci/drift.py over the locks, runs README command 2's not-slow layer under them, names what
    moved when that fails, and uploads the fresh locks when it passes."""
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "tests.yml").read_text())
    events = workflow[True]  # YAML 1.1 reads the key `on` as True
    assert "schedule" in events and "workflow_dispatch" in events
    jobs = workflow["jobs"]
    drift = jobs["drift"]
    assert "schedule" in drift["if"] and "workflow_dispatch" in drift["if"]
    for name in ("suite", "not-slow"):  # the suite runs on pushes, not weekly
        assert "schedule" not in jobs[name].get("if", "") and "push" in jobs[name]["if"]
    steps = drift["steps"]
    runs = [step.get("run", "") for step in steps]
    resolve = next(n for n, run in enumerate(runs) if ".ci/drift.py --write" in run)
    tests = runs.index('pip install -r requirements.txt && python -m pytest -m "not slow"')
    assert resolve < tests
    named = next(s for s in steps[tests:] if s.get("if") == "failure()")
    assert ".ci/drift.py compare" in named["run"]
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload.get("if", "success()") == "success()"  # only what passed
    assert upload["with"]["path"].split() == ["requirements.lock", ".ci/requirements.lock"]
    assert steps.index(upload) > tests


def test_requirements_parse_as_pip_reads_them():
    """The check reads requirements files as pip does: comments, continuations, options, the
    editable launcher and its pyproject.toml."""
    found = lockfile.read_requirements(REPO / "requirements.txt")
    assert found.local == ["hydra-ddp-launcher"] and found.local_folders == ["./launch"]
    assert [p.name for p in found.constraints] == ["requirements.lock"]
    names = {Requirement(str(a.requirement)).name for a in found.asked}
    assert {"torch", "hydra-core", "wandb", "pytest"} <= names
    assert any(a.where == "launch/pyproject.toml [project.dependencies]" for a in found.asked)


def test_the_launchers_requirements_are_bounded_both_ways():
    """hydra-ddp-launcher, published: each of its dependencies and of its extras' has a floor
    and a ceiling (the next major, or the minor its private APIs were read from: Hydra,
    OmegaConf, submitit), so that a user's pip never pairs it with a release it was not tried
    on; the lock's versions lie within them (test_the_locks_hold_every_version_asked_for)."""
    project = lockfile.tomllib.loads((REPO / "launch" / "pyproject.toml").read_text())["project"]
    asked = [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]
    unbounded = [
        line
        for line in asked
        for ops in [{s.operator for s in Requirement(line).specifier}]
        if not (ops & {">=", ">", "~="} and ops & {"<", "<=", "~="})
    ]
    assert len(asked) >= 8 and unbounded == []
