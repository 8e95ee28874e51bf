"""Imports flow one way: no cycle between the product's modules, nor between its top-level
packages (import statements read from the source, lazy ones inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOT_PRODUCT = {"tests"}


def product_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every product .py file in the repo."""
    modules = {}
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0] in NOT_PRODUCT or any(p.startswith(".") for p in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[0] == "launch":  # the launcher package's root (launch/pyproject.toml)
            if len(parts) < 2 or parts[1] in ("tests", "examples"):
                continue
            parts = parts[1:]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules `name` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `from pkg import name`: pkg's module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def module_graph() -> dict[str, set[str]]:
    modules = product_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_no_import_cycle_between_modules() -> None:
    assert cycles(module_graph()) == []


def test_no_import_cycle_between_top_level_packages() -> None:
    packages: dict[str, set[str]] = {}
    for name, targets in module_graph().items():
        top = name.split(".")[0]
        packages.setdefault(top, set()).update(t.split(".")[0] for t in targets)
        packages[top].discard(top)
    assert cycles(packages) == []


def test_launch_and_report_import_no_torch() -> None:
    """The launcher side and the sweep report (launch/) import only torch-free modules."""
    graph = module_graph()
    reached, todo = set(), [m for m in graph if m.split(".")[0] == "ddp_launcher"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += graph[name]
    with_torch = []
    for name in sorted(reached):
        tree = ast.parse(product_modules()[name].read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "torch" or n.startswith("torch.") for n in names):
                with_torch.append(name)
                break
    # Lazily, in their own processes only: torchrun's agent, a plain torchrun rank's entry point
    # (the agreed start time); and the GPU count, only where a GPU driver is present; a rank of
    # a job across nodes, for the store that says which node was lost.
    assert set(with_torch) <= {
        "ddp_launcher.ranks.agent",
        "ddp_launcher.ranks.entry",
        "ddp_launcher.core.world",
        "ddp_launcher.ranks.nodes",
    }, with_torch


def test_the_cycle_finder_finds_one() -> None:
    """The check can fail: a two-module cycle and a three-package cycle are found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == [["x", "y", "z"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


# ---------------------------------------------------------------------------------------------
# The seam: the experiment (the fork) uses the launcher package only through its public API


FORK_OUTSIDE = {"launch", "tests", "docs"}  # what is not the fork's own code
# Config values that name code by import path: `_target_`s, and the gate's hooks (RunGate's
# checks, attempts, progress), which it imports by name.
NAMES_CODE = ("_target_", "checks", "attempts", "progress")


def past_the_api(path: Path, public: set[str]) -> list[str]:
    """Each `ddp_launcher` import in a Python file that is not `from ddp_launcher import
    <public name>`, as `file:line: the import`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.split(".")[0] == "ddp_launcher"]
            bad = [n for n in bad if n != "ddp_launcher"]  # (`import ddp_launcher`: public)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == (
            "ddp_launcher"
        ):
            names = [a.name for a in node.names]
            bad = [] if node.module == "ddp_launcher" and set(names) <= public else [node.module]
        else:
            continue
        found += [f"{path.relative_to(REPO)}:{node.lineno}: {name}" for name in bad]
    return found


def targets_past_the_api(path: Path, public: set[str]) -> list[str]:
    """Each config value of NAMES_CODE in a YAML file that names ddp_launcher but not one of
    its public names (`ddp_launcher.<public name>`)."""
    import yaml

    found = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                names_ours = isinstance(value, str) and value.startswith("ddp_launcher")
                if key in NAMES_CODE and names_ours:
                    module, _, name = value.replace(":", ".").rpartition(".")
                    if module != "ddp_launcher" or name not in public:
                        found.append(f"{path.relative_to(REPO)}: {key}: {value}")
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for document in yaml.safe_load_all(path.read_text()):
        walk(document)
    return found


def fork_files(suffix: str) -> list[Path]:
    return [
        p
        for p in sorted(REPO.rglob(f"*{suffix}"))
        if p.relative_to(REPO).parts[0] not in FORK_OUTSIDE
        and not any(part.startswith(".") for part in p.relative_to(REPO).parts)
    ]


def test_the_fork_uses_the_launcher_only_through_its_public_api() -> None:
    """No module of the experiment imports a ddp_launcher module past its __init__ (the public
    API, ddp_launcher.__all__), and no config names one by `_target_` or hook."""
    import ddp_launcher

    public = set(ddp_launcher.__all__)
    found = [line for p in fork_files(".py") for line in past_the_api(p, public)]
    found += [line for p in fork_files(".yaml") for line in targets_past_the_api(p, public)]
    assert not found, "\n".join(found)


def test_the_seam_check_finds_imports_and_targets_past_the_api(tmp_path) -> None:
    """The check can fail: an import of a module below the API, a name the API lacks, and a
    config target naming an internal module are each found."""
    public = {"UserError", "RunGate"}
    source = tmp_path / "app.py"
    source.write_text(
        "from ddp_launcher import UserError\n"
        "from ddp_launcher.core.errors import one_line\n"
        "from ddp_launcher import one_line\n"
        "import ddp_launcher.core.gate\n"
    )
    config = tmp_path / "app.yaml"
    config.write_text(
        "hydra:\n  callbacks:\n    gate:\n      _target_: ddp_launcher.core.gate.RunGate\n"
        "      attempts: ddp_launcher.resume.RunAttempts\n"
        "    ok:\n      _target_: ddp_launcher.RunGate\n"
    )
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        lines = past_the_api(source, public) + targets_past_the_api(config, public)
    finally:
        REPO = saved
    assert [line.split(": ", 1)[1] for line in lines] == [
        "ddp_launcher.core.errors",
        "ddp_launcher",
        "ddp_launcher.core.gate",
        "_target_: ddp_launcher.core.gate.RunGate",
        "attempts: ddp_launcher.resume.RunAttempts",
    ], lines


# ---------------------------------------------------------------------------------------------
# the seed lesson's lines are the fork's (issue 67): calls in train.py or components/, none in
# the launcher package, which holds no rank-side module of the experiment

SEED_CALLS = {"init_process_group", "set_device", "DDP", "DistributedDataParallel"}
GONE_FROM_THE_PACKAGE = (
    "ranks/distributed.py",
    "ranks/preemption.py",
    "ranks/faults.py",
    "core/manifest.py",
)


def calls_in(path: Path) -> set[str]:
    """The names of the functions `path` calls (`f(...)`, `x.f(...)`): code, not docstrings."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name:
                found.add(name)
    return found


def test_the_seed_lessons_lines_are_calls_in_the_fork() -> None:
    """init_process_group(, set_device( and DDP( are calls in train.py or components/, and
    nowhere in the launcher package; its rank-side modules of the experiment are gone, and a
    training step calls no fault hook (fault injection is the suite's: tests/faults.py)."""
    fork = [REPO / "train.py", *sorted((REPO / "components").glob("*.py"))]
    in_fork = set().union(*(calls_in(path) for path in fork))
    assert {"init_process_group", "set_device"} <= in_fork, in_fork & SEED_CALLS
    assert in_fork & {"DDP", "DistributedDataParallel"}, in_fork & SEED_CALLS
    package = REPO / "launch" / "ddp_launcher"
    in_package = {
        str(path.relative_to(package)): calls_in(path) & SEED_CALLS
        for path in sorted(package.rglob("*.py"))
    }
    assert {path: calls for path, calls in in_package.items() if calls} == {}
    assert [p for p in GONE_FROM_THE_PACKAGE if (package / p).exists()] == []
    step = REPO / "components" / "train_step.py"
    assert [name for name in calls_in(step) if "fault" in name.lower()] == []


def test_train_py_opens_with_its_entry_call() -> None:
    """train.py's first screen tells the story: its docstring, then one entry call (under
    `if __name__ == "__main__":`) before the experiment's own imports."""
    tree = ast.parse((REPO / "train.py").read_text())
    docstring, first = tree.body[0], tree.body[1]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
    assert isinstance(first, ast.If) and ast.unparse(first.test) == "__name__ == '__main__'"
    calls = [n for n in first.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    assert [ast.unparse(c.value.func) for c in calls] == ["entry_point"]
    assert first.end_lineno <= 45, first.end_lineno  # within the first screen
