#!/usr/bin/env python3
"""Fails when the includes of csrc/comm form a cycle (issue 41: "no include cycle in csrc/comm").

A module is a header and its source file together (foo.h and foo.cpp), so that a header declaring
what a source file of another module defines, while that module includes the first, shows as the
cycle it is. Prints the modules in dependency order (each after everything it includes, with its
floor: 1 for a module that includes none of the folder's, else one above the highest it includes) and
exits 0, or prints a cycle and exits 1.
    python3 scripts/check_includes.py [csrc/comm]
"""

import re
import sys
from pathlib import Path

INCLUDE = re.compile(r'^\s*#\s*include\s+"comm/([\w./]+)\.h"', re.MULTILINE)


def module_graph(folder: Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.h")) + sorted(folder.glob("*.cpp")):
        edges = graph.setdefault(path.stem, set())
        for name in INCLUDE.findall(path.read_text()):
            if name != path.stem:
                edges.add(name)
                graph.setdefault(name, set())
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of modules (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return path[path.index(child) :] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def topological_order(graph: dict[str, set[str]]) -> list[str]:
    order: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> None:
        done.add(node)
        for child in sorted(graph[node]):
            if child not in done:
                visit(child)
        order.append(node)

    for node in sorted(graph):
        if node not in done:
            visit(node)
    return order


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor, for an acyclic graph."""
    floor: dict[str, int] = {}
    for node in topological_order(graph):
        floor[node] = 1 + max((floor[child] for child in graph[node]), default=0)
    return floor


def main() -> int:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "csrc" / "comm"
    graph = module_graph(folder)
    cycle = find_cycle(graph)
    if cycle:
        print(f"check_includes: include cycle in {folder}: " + " -> ".join(cycle))
        return 1
    floor = floors(graph)
    for node in topological_order(graph):
        print(f"  {floor[node]:>2} {node:<18} includes {', '.join(sorted(graph[node])) or '-'}")
    print(
        f"check_includes: {len(graph)} modules of {folder} on {max(floor.values(), default=0)} floors, no include cycle"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
