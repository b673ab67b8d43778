"""The shape issues 41 and 51 ask of the code, checked on every run: csrc/comm's includes form no cycle
(scripts/check_includes.py), no source file in csrc, no Python file and no test module is over 800 lines,
no test module imports another (what several use lives in tests/helpers.py), and no release source
carries a test hook (Note [Test seam] in csrc/comm/part_factory.h)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_LINES_LIMIT = 800


def test_comm_has_no_include_cycle():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_includes.py")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no include cycle" in result.stdout


def test_a_cycle_is_found(tmp_path):
    (tmp_path / "a.h").write_text('#include "comm/b.h"\n')
    (tmp_path / "b.h").write_text("#pragma once\n")
    (tmp_path / "b.cpp").write_text('#include "comm/b.h"\n#include "comm/a.h"\n')
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_includes.py"), str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "a -> b -> a" in result.stdout


def test_floors_count_the_longest_include_chain(tmp_path):
    (tmp_path / "a.h").write_text('#include "comm/b.h"\n#include "comm/c.h"\n')
    (tmp_path / "b.h").write_text('#include "comm/c.h"\n')
    (tmp_path / "c.h").write_text("#pragma once\n")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_includes.py"), str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
    assert "3 modules" in result.stdout and "on 3 floors" in result.stdout


def test_no_source_file_is_over_the_limit():
    sources = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in {".cpp", ".h", ".cu", ".cuh"}]
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > SOURCE_LINES_LIMIT}
    assert sources and not long, long


def lines_over_the_limit(paths) -> dict:
    return {str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) > SOURCE_LINES_LIMIT}


def test_no_python_file_is_over_the_limit():
    sources = [
        p
        for folder in ("python", "benchmarks", "notebooks", "scripts", "examples")
        for p in (ROOT / folder).rglob("*.py")
    ] + list(ROOT.glob("*.py"))
    assert sources and not lines_over_the_limit(sources), lines_over_the_limit(sources)


def test_no_test_module_is_over_the_limit():
    long = lines_over_the_limit((ROOT / "tests").glob("*.py"))
    assert not long, long


def test_no_test_module_imports_another():
    imports = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found = [name for name in names if name.split(".")[0].startswith("test_")]
            if found:
                imports[path.name] = found
    assert not imports, imports


def test_no_release_source_carries_a_test_hook():
    """Outside csrc/testing/ (compiled into a testing build only), no source includes a testing header,
    is compiled differently for a testing build, or names a fault or a test variable in its code:
    the faults come in through the testing build's part factory alone."""
    script = (ROOT / "scripts" / "check_release_strings.sh").read_text()
    names = "|".join(re.findall(r'^names="(?:\$names\|)?([^"]*)"', script, re.MULTILINE))
    assert "die_at_hello" in names and "no_liveness_poll" in names, names
    hook = re.compile(rf'#\s*include\s+"testing/|DDPKIT_TESTING|{names}')
    found = {}
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in {".cpp", ".h", ".cu", ".cuh"} or "testing" in path.relative_to(ROOT / "csrc").parts:
            continue
        code = re.sub(r"//.*", "", path.read_text())  # what a comment says is documentation, not a hook
        hits = sorted({match.group(0) for match in hook.finditer(code)})
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, found
