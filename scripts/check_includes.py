#!/usr/bin/env python3
"""Fails when the includes of csrc/comm form a cycle, between modules or between folders, or when a
folder includes one its README does not allow (issues 41 and 61).

A module is a header and its source file together (foo.h and foo.cpp), so that a header declaring
what a source file of another module defines, while that module includes the first, shows as the
cycle it is; its name is its path below csrc/comm without the suffix (``shm/segment``). A folder is
a directory of csrc/comm holding modules; it may include modules of its own and of the folders below
it, which the first paragraph of its README.md names ("It may include `core/` and `reduction/`." or
"It includes no other folder."). Prints every folder in dependency order with its floor (1 for a folder
that includes no other, else one above the highest it includes) and its modules with theirs, and
exits 0; or prints what is wrong and exits 1.
    python3 scripts/check_includes.py [csrc/comm]
"""

import re
import sys
from pathlib import Path

INCLUDE = re.compile(r'^\s*#\s*include\s+"comm/([\w./]+)\.h"', re.MULTILINE)
# The sentence of a folder's first paragraph that names what it may include.
MAY_INCLUDE = re.compile(r"It (?:may include (?P<names>[^.]*)|includes no other folder)\.")


def module_name(path: Path, root: Path) -> str:
    return path.relative_to(root).with_suffix("").as_posix()


def folder_of(module: str) -> str:
    return module.rpartition("/")[0] or "."


def module_graph(root: Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.h")) + sorted(root.rglob("*.cpp")):
        name = module_name(path, root)
        edges = graph.setdefault(name, set())
        for included in INCLUDE.findall(path.read_text()):
            if included != name:
                edges.add(included)
                graph.setdefault(included, set())
    return graph


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which folders each folder's modules include, its own left out."""
    folders: dict[str, set[str]] = {}
    for module, edges in graph.items():
        here = folders.setdefault(folder_of(module), set())
        here.update(folder_of(other) for other in edges if folder_of(other) != folder_of(module))
    for edges in list(folders.values()):
        for other in edges:
            folders.setdefault(other, set())
    return folders


def allowed_folders(root: Path, folder: str) -> set[str] | None:
    """The folders `folder`'s README.md says it may include, or None where it says nothing."""
    readme = root / folder / "README.md"
    if folder == "." or not readme.exists():
        return None
    paragraphs = [p for p in readme.read_text().split("\n\n") if p.strip() and not p.lstrip().startswith("#")]
    first = paragraphs[0] if paragraphs else ""
    found = MAY_INCLUDE.search(" ".join(first.split()))
    if found is None:
        return None
    return {name.strip("/") for name in re.findall(r"`([\w/]+)`", found.group("names") or "")}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of nodes (the first repeated at the end), or None."""
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
    """Each node's floor, for an acyclic graph."""
    floor: dict[str, int] = {}
    for node in topological_order(graph):
        floor[node] = 1 + max((floor[child] for child in graph[node]), default=0)
    return floor


def problems(root: Path, graph: dict[str, set[str]], folders: dict[str, set[str]]) -> list[str]:
    found = []
    if cycle := find_cycle(graph):
        found.append("include cycle: " + " -> ".join(cycle))
    if cycle := find_cycle(folders):
        found.append("folders include each other: " + " -> ".join(cycle))
    for folder in sorted(folders):
        allowed = allowed_folders(root, folder)
        if folder == ".":
            continue
        if allowed is None:
            found.append(f"{folder}/README.md does not say what {folder}/ may include")
            continue
        for module in sorted(m for m in graph if folder_of(m) == folder):
            for other in sorted(graph[module]):
                if folder_of(other) not in allowed | {folder}:
                    found.append(f"{module} includes {other}, which {folder}/README.md does not allow")
    return found


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "csrc" / "comm"
    graph = module_graph(root)
    folders = folder_graph(graph)
    found = problems(root, graph, folders)
    if found:
        for problem in found:
            print(f"check_includes: {root}: {problem}")
        return 1
    module_floor, folder_floor = floors(graph), floors(folders)
    for folder in topological_order(folders):
        modules = [m for m in topological_order(graph) if folder_of(m) == folder]
        print(
            f"{folder_floor[folder]:>2} {folder}/: {len(modules)} module{'' if len(modules) == 1 else 's'}, "
            f"includes {', '.join(sorted(folders[folder])) or '-'}"
        )
        for module in modules:
            print(f"    {module_floor[module]:>2} {module:<28} includes {', '.join(sorted(graph[module])) or '-'}")
    print(
        f"check_includes: {len(graph)} modules in {len(folders)} folders of {root} on "
        f"{max(module_floor.values(), default=0)} floors (folders on {max(folder_floor.values(), default=0)}), "
        "no include cycle, no folder includes one above it"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
