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
    # (the agreed start time); and the GPU count, only where a GPU driver is present. The
    # rank's training services (its process group, stop requests, injected faults) are imported
    # by the app's training code alone, in its ranks.
    assert set(with_torch) <= {
        "ddp_launcher.ranks.agent",
        "ddp_launcher.ranks.entry",
        "ddp_launcher.core.world",
        "ddp_launcher.ranks.distributed",
        "ddp_launcher.ranks.preemption",
        "ddp_launcher.ranks.faults",
    }, with_torch


def test_the_cycle_finder_finds_one() -> None:
    """The check can fail: a two-module cycle and a three-package cycle are found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == [["x", "y", "z"]]
    assert cycles({"x": {"y"}, "y": set()}) == []
