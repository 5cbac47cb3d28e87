"""The layers of ``docs/architecture.md``: imports only go down, patterns do
not lean on each other, state machines never touch sockets, and there is no
import cycle."""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "mdp"

GROUND = {"mdp.interfaces", "mdp.errors", "mdp.policy", "mdp.handlers", "mdp.messages", "mdp.machine",
          "mdp.tracing", "mdp._compiled"}  # (the build's own module: imports nothing of ours)
#: modules that may import from every layer below them
ENTRY = ("mdp.app", "mdp.spark", "mdp.testing", "mdp.blocking", "mdp.handlerthreads", "mdp.uvreactor",
         "mdp")


def layer(module: str) -> int:
    if module in GROUND:
        return 0
    if module in ("mdp.transport", "mdp.session") or module.startswith(("mdp.transport.",
                                                                         "mdp.session.")):
        return 1  # sessions are a transport (session+tcp:, session+zmq:)
    if module.startswith(ENTRY[0]) or module in ENTRY[1:]:
        return 3
    return 2  # a pattern


def family(module: str) -> str:
    """``mdp.majordomo.broker`` → ``mdp.majordomo``; ``mdp.freelance`` → itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def modules() -> Iterator[tuple[str, pathlib.Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


KNOWN = {name for name, _ in modules()}


def imports(module: str, path: pathlib.Path) -> Iterator[tuple[str, bool]]:
    """(imported mdp module, at module level?) for each import of ours."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            submodules = [f"{base}.{a.name}" for a in node.names]
            names = [n for n in submodules if n in KNOWN] or [base]
        else:
            continue
        for name in names:
            if name in KNOWN:
                yield name, id(node) in top


def test_imports_only_go_down() -> None:
    wrong = []
    for module, path in modules():
        for target, _ in imports(module, path):
            if target == module or module == "mdp":
                continue
            if layer(target) > layer(module):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


#: patterns built on another one, as its client or worker (docs/architecture.md)
USES = {"mdp.titanic": {"mdp.majordomo"}}


def test_patterns_do_not_import_each_other() -> None:
    wrong = []
    for module, path in modules():
        if layer(module) != 2:
            continue
        for target, _ in imports(module, path):
            if (layer(target) == 2 and family(target) != family(module)
                    and family(target) not in USES.get(family(module), ())):
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("forbidden", ["zmq", "txzmq", "socket"])
def test_state_machines_and_codecs_never_import_sockets(forbidden: str) -> None:
    wrong = []
    for module, path in modules():
        if layer(module) not in (0, 2):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == forbidden
                                                    for a in node.names):
                wrong.append(module)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == forbidden:
                wrong.append(module)
    assert not wrong, f"{forbidden} imported by {wrong}"


def test_no_import_cycle_at_module_level() -> None:
    graph: dict[str, set[str]] = {}
    for module, path in modules():
        graph[module] = {t for t, top in imports(module, path) if top and t != module
                         and not module.startswith(t + ".")}  # a package's own __init__
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, trail: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle.extend(trail[trail.index(nxt):] + [node, nxt] if nxt in trail
                             else [node, nxt])
                return True
            if state.get(nxt) is None and visit(nxt, trail + [node]):
                return True
        state[node] = 2
        return False

    for module in sorted(graph):
        if state.get(module) is None and visit(module, []):
            break
    assert not cycle, " -> ".join(cycle)
