"""The repository's locks, read: requirements.lock (every package the README's two commands
install, for every Python requires-python allows, on every platform) and .ci/requirements.lock
(.ci/run's tools). `uv pip compile --universal` writes them (python .ci/lock.py refresh); this
module reads what it wrote, checks that the requirements files and launch/pyproject.toml ask
for nothing the locks do not hold, and compares two locks (python .ci/drift.py).

A lock line is a requirement, `name==version ; marker`, followed by uv's `# via` annotation
(what asked for it: a package of the lock, `-r requirements.txt`, or the launcher itself); one
package may have several lines whose markers pick one per environment (numpy 2.2.6 on Python
3.10, 2.4.6 above). Only `packaging` is needed (pip's vendored copy where it is not installed:
the GPU check reads the lock on a machine that may hold only torch).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.markers import Marker, default_environment  # noqa: F401 (docs/bench/gpu.py)
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ModuleNotFoundError:  # a bare machine: pip's own copy
    from pip._vendor.packaging.markers import Marker, default_environment  # noqa: F401
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (pytest brings tomli there; pip vendors it)
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
REFRESH = "python .ci/lock.py refresh"  # the one command that rewrites both locks


@dataclass(frozen=True)
class LockSpec:
    """A requirements file, the lock it names with `-c`, and the oldest Python it is locked
    for (the newest: the top-level pyproject.toml's requires-python)."""

    requirements: str  # relative to the repository
    lock: str
    oldest_python: str
    constrained_by: str | None = None  # a lock this one is resolved within (shared packages agree)


LOCKS = (
    LockSpec("requirements.txt", "requirements.lock", "3.10"),
    # check-jsonschema needs Python 3.11; .ci/run and the workflow's tools run on 3.11 and up
    LockSpec(".ci/requirements.txt", ".ci/requirements.lock", "3.11", "requirements.lock"),
)

# Where the locks must hold a version: (sys_platform, platform_system, platform_machine, os_name)
PLATFORMS = {
    "linux-x86_64": ("linux", "Linux", "x86_64", "posix"),
    "linux-aarch64": ("linux", "Linux", "aarch64", "posix"),  # GH200-style GPU machines
    "macos-arm64": ("darwin", "Darwin", "arm64", "posix"),
    "windows-amd64": ("win32", "Windows", "AMD64", "nt"),
}


def supported_pythons(oldest: str = "3.10", pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """The Python versions ("3.10", ...) from `oldest` that pyproject.toml's requires-python
    allows."""
    allowed = SpecifierSet(tomllib.loads(pyproject.read_text())["project"]["requires-python"])
    low = int(oldest.split(".")[1])
    return [f"3.{minor}" for minor in range(low, 40) if f"3.{minor}.0" in allowed]


def environment(python: str, platform: str = "linux-x86_64") -> dict[str, str]:
    """The marker environment of CPython `python` ("3.12") on `platform` (PLATFORMS)."""
    sys_platform, system, machine, os_name = PLATFORMS[platform]
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_version": f"{python}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": sys_platform,
        "platform_system": system,
        "platform_machine": machine,
        "os_name": os_name,
        "platform_release": "",
        "platform_version": "",
        "extra": "",
    }


def environments(oldest: str = "3.10") -> dict[tuple[str, str], dict[str, str]]:
    """{(python, platform): marker environment} for every supported Python and PLATFORMS."""
    return {
        (python, platform): environment(python, platform)
        for python in supported_pythons(oldest)
        for platform in PLATFORMS
    }


def applies(marker: Marker | None, env: dict[str, str]) -> bool:
    return marker is None or marker.evaluate(env)


@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: str
    marker: Marker | None
    via: tuple[str, ...]  # uv's annotation: packages (canonical) and sources (-r requirements.txt)
    line: int


@dataclass
class Lock:
    path: Path
    pins: list[Pin] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Lock:
        lock = cls(Path(path))
        pending: tuple[Requirement, int] | None = None
        via: list[str] = []

        def close() -> None:
            if pending is not None:
                try:
                    lock.pins.append(pin(*pending, via))
                except ValueError as bad:
                    raise ValueError(f"{path}:{bad}") from None

        lines = Path(path).read_text().splitlines()
        for number, line in enumerate(lines, 1):
            text = line.strip()
            comment = text.removeprefix("#").strip() if text.startswith("#") else None
            if line.startswith("-"):
                continue  # pip options (--index-url, ...): uv writes them only when asked
            if line[:1] not in ("", " ", "#"):  # a requirement line starts in column 0
                close()
                try:
                    pending, via = (Requirement(line), number), []
                except ValueError:  # InvalidRequirement
                    raise ValueError(f"{path}:{number}: not a lock line: {line!r}") from None
            elif comment is not None and line.startswith(" ") and pending is not None:
                if comment.startswith("via"):
                    via += [comment[3:].strip()] if comment[3:].strip() else []
                elif comment:
                    via.append(comment)
            elif text and not text.startswith("#"):
                raise ValueError(f"{path}:{number}: not a lock line: {line!r}")
        close()
        return lock

    def applicable(self, env: dict[str, str]) -> dict[str, Pin]:
        """{name: pin} of the lines whose markers hold in `env`; two for one name is a broken
        lock."""
        found: dict[str, Pin] = {}
        for p in self.pins:
            if applies(p.marker, env):
                if p.name in found:
                    raise ValueError(
                        f"{self.path}:{p.line}: {p.name} is pinned twice for one environment "
                        f"(lines {found[p.name].line} and {p.line})"
                    )
                found[p.name] = p
        return found

    def versions(self, env: dict[str, str]) -> dict[str, str]:
        return {name: p.version for name, p in self.applicable(env).items()}

    def closure(self, roots: list[str], env: dict[str, str]) -> list[str]:
        """`roots` and every package of the lock that they bring in `env`, by uv's `# via`
        annotations (a package is in when one of the packages that asked for it is), in the
        order found."""
        here = self.applicable(env)
        brings: dict[str, list[str]] = defaultdict(list)
        for name, p in here.items():
            for parent in p.via:  # "matplotlib", "-r requirements.txt", "pkg[extra]"
                brings[canonicalize_name(parent.split("[")[0])].append(name)
        found, todo = [], [canonicalize_name(r) for r in roots]
        while todo:
            name = todo.pop(0)
            if name not in found:
                if name not in here:
                    raise KeyError(f"{self.path} holds no {name} for this environment")
                found.append(name)
                todo += sorted(brings[name])
        return found


def pin(requirement: Requirement, line: int, via: list[str]) -> Pin:
    specs = list(requirement.specifier)
    if len(specs) != 1 or specs[0].operator != "==":
        raise ValueError(f"{line}: {requirement} is not an exact pin")
    (spec,) = specs
    return Pin(
        canonicalize_name(requirement.name), spec.version, requirement.marker, tuple(via), line
    )


# --- the requirements files and the launcher's pyproject.toml --------------------------------


@dataclass(frozen=True)
class Asked:
    """One requirement a file asks for, and where."""

    requirement: Requirement
    where: str  # file:line (or file's table)


@dataclass
class Requirements:
    asked: list[Asked] = field(default_factory=list)
    constraints: list[Path] = field(default_factory=list)  # -c files, as pip finds them
    local: list[str] = field(default_factory=list)  # the local projects' names (-e ./launch)
    local_folders: list[str] = field(default_factory=list)  # and their paths, as written


def logical_lines(path: Path):
    """(line number, text) of a requirements file: comments dropped, `\\` continuations
    joined."""
    pending, start = "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split(" #", 1)[0] if not line.startswith("#") else ""
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text, pending = (pending + line).strip(), ""
        if text:
            yield start, text


def read_requirements(path: Path, root: Path = REPO, shown: str | None = None) -> Requirements:
    """What `pip install -r path` asks for, run from `root`: its requirements (nested -r files
    followed: pip reads them relative to the file), its -c files, and each local project's
    (`-e ./launch[extras]`) dependencies plus those of the extras asked for (its
    pyproject.toml; pip reads a local path relative to the working directory)."""
    path, found = Path(path), Requirements()
    shown = shown or path.name
    for number, text in logical_lines(path):
        where = f"{shown}:{number}"
        option, _, value = text.partition(" ")
        if option.startswith("--") and "=" in option:  # --constraint=FILE
            option, _, value = option.partition("=")
        value = value.strip()
        if option in ("-r", "--requirement"):
            nested = read_requirements(path.parent / value, root, value)
            found.asked += nested.asked
            found.constraints += nested.constraints
            found.local += nested.local
            found.local_folders += nested.local_folders
        elif option in ("-c", "--constraint"):
            found.constraints.append(path.parent / value)
        elif option in ("-e", "--editable") or text.startswith((".", "/")):
            local = value if option in ("-e", "--editable") else text
            folder, extras = local, set()
            if "[" in local:
                folder = local[: local.index("[")]
                extras = Requirement("local" + local[local.index("[") :]).extras
            name, asked = project_requirements(root / folder, extras)
            found.local.append(name)
            found.local_folders.append(folder)
            found.asked += asked
        elif text.startswith("-"):
            continue  # other pip options (--index-url, ...) ask for no package
        else:
            found.asked.append(Asked(Requirement(text.split(" --hash")[0]), where))
    return found


def project_requirements(folder: Path, extras: set[str]) -> tuple[str, list[Asked]]:
    """A local project's name, and its dependencies plus those of `extras` (an extra that
    names the project itself, `pkg[a,b]`, brings a's and b's)."""
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    name = canonicalize_name(project["name"])
    shown = f"{folder.name}/pyproject.toml"
    optional = project.get("optional-dependencies", {})
    asked = [
        Asked(Requirement(r), f"{shown} [project.dependencies]") for r in project["dependencies"]
    ]
    todo, seen = sorted(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise ValueError(f"{shown} has no extra [{extra}] (it has: {', '.join(optional)})")
        for text in optional[extra]:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == name:
                todo += sorted(requirement.extras)
            else:
                where = f"{shown} [project.optional-dependencies] {extra}"
                asked.append(Asked(requirement, where))
    return name, asked


def version_key(python: str) -> tuple[int, ...]:
    return tuple(map(int, python.split(".")))


def where(environments: set[tuple[str, str]]) -> str:
    """(python, platform) pairs, said briefly: "Python 3.11, 3.12" where every platform is in,
    "Python 3.10, 3.11 on windows-amd64" where only some are."""
    platforms: dict[str, set[str]] = defaultdict(set)
    for python, platform in environments:
        platforms[python].add(platform)
    pythons: dict[frozenset[str], list[str]] = defaultdict(list)
    for python in sorted(platforms, key=version_key):
        pythons[frozenset(platforms[python])].append(python)
    return "; ".join(
        f"Python {', '.join(group)}"
        + ("" if len(those) == len(PLATFORMS) else f" on {', '.join(sorted(those))}")
        for those, group in sorted(pythons.items(), key=lambda kv: version_key(kv[1][0]))
    )


def stale(requirements: Path, root: Path = REPO, lock: Path | None = None, oldest: str = "3.10"):
    """What `requirements` (pip install -r from `root`) asks for that its lock does not hold:
    one line per package and ask, naming the package, the file and line that ask, and the
    lock's version; [] when the lock holds it all. The lock is the file's -c (or `lock`)."""
    found = read_requirements(requirements, root)
    if lock is None:
        if len(found.constraints) != 1:
            named = ", ".join(map(str, found.constraints)) or "none"
            return [f"{requirements.name} must name its lock with one -c line (it names {named})"]
        lock = found.constraints[0]
    lock = Path(lock)
    shown = shown_path(lock, root)
    if not lock.exists():
        return [f"{requirements.name}'s lock {shown} does not exist: {REFRESH}"]
    locked = Lock.read(lock)
    problems: dict[tuple[str, str, str | None], set[tuple[str, str]]] = defaultdict(set)
    for key, env in environments(oldest).items():
        versions = locked.versions(env)
        for asked in found.asked:
            requirement, name = asked.requirement, canonicalize_name(asked.requirement.name)
            if not applies(requirement.marker, env):
                continue
            held = versions.get(name)
            if held is None or not requirement.specifier.contains(Version(held), prereleases=True):
                problems[(name, f"{asked.where} asks for '{requirement}'", held)].add(key)
        for local in found.local:  # pip refuses a constraint on a local project (-e ./launch)
            if local in versions:
                why = "pip refuses a constraint on a local project"
                problems[(local, why, versions[local])].add(key)
    return [
        f"{name}: {asked}, {shown} holds {f'{name} {held}' if held else 'none'} "
        f"({where(envs)}): refresh the lock with {REFRESH}"
        for (name, asked, held), envs in sorted(problems.items(), key=lambda kv: kv[0][:2])
    ]


def shown_path(path: Path, root: Path) -> str:
    """`path` as the repository names it (relative to `root`), else its file name."""
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return Path(path).name


def disagreements(lock: str, within: str, oldest: str, root: Path = REPO) -> list[str]:
    """Packages `lock` pins at another version than `within`, the lock it was resolved in."""
    return [
        f"{move.name}: {lock} holds {move.name} {move.new}, {within} holds {move.old} "
        f"({'; '.join(move.where)}): {REFRESH}"
        for move in compare(Lock.read(root / within), Lock.read(root / lock), oldest)
        if move.old and move.new
    ]


def check(root: Path = REPO) -> list[str]:
    """Every lock of LOCKS against its requirements file (which must name it with -c), and
    .ci's lock against the app's."""
    problems = []
    for spec in LOCKS:
        requirements, lock = root / spec.requirements, root / spec.lock
        named = read_requirements(requirements, root).constraints
        if [p.resolve() for p in named] != [lock.resolve()]:
            problems.append(f"{spec.requirements} must name its lock alone: -c {lock.name}")
        found = stale(requirements, root, lock, spec.oldest_python)
        problems += found
        if spec.constrained_by and not found:
            problems += disagreements(spec.lock, spec.constrained_by, spec.oldest_python, root)
    return problems


# --- two locks compared (python .ci/drift.py) ------------------------------------------------


@dataclass(frozen=True)
class Move:
    name: str
    old: str | None  # None: not in the old lock (for those environments)
    new: str | None
    where: tuple[str, ...]

    def __str__(self) -> str:
        old, new = self.old or "(none)", self.new or "(none)"
        return f"{self.name} {old} -> {new} ({'; '.join(self.where)})"


def compare(old: Lock, new: Lock, oldest: str = "3.10") -> list[Move]:
    """The packages whose version differs between two locks, environment by environment,
    grouped: `python-dateutil 2.9.0.post0 -> 4.0.0 (Python 3.11, 3.12, 3.13)`."""
    moved: dict[tuple[str, str | None, str | None], set[tuple[str, str]]] = defaultdict(set)
    for key, env in environments(oldest).items():
        before, after = old.versions(env), new.versions(env)
        for name in before.keys() | after.keys():
            if before.get(name) != after.get(name):
                moved[(name, before.get(name), after.get(name))].add(key)
    order = sorted(moved.items(), key=lambda kv: (kv[0][0], min(version_key(p) for p, _ in kv[1])))
    return [Move(name, a, b, tuple(where(envs).split("; "))) for (name, a, b), envs in order]
