"""The shape issues 41, 51 and 61 ask of the code, checked on every run: csrc/comm's includes form no
cycle, its folders include only folders below them and those their README allows, none holds more than 15
modules (scripts/check_includes.py), every code name of its vocabulary (Note [Vocabulary]) is one the
code uses, no source file in csrc, no Python file and no test module is over 800 lines,
no test module imports another (what several use lives in tests/helpers.py), and no release source
carries a test hook (Note [Test seam] in csrc/comm/engine/part_factory.h)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_LINES_LIMIT = 800
MODULES_PER_FOLDER_LIMIT = 15


def test_comm_has_no_include_cycle():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_includes.py")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no include cycle" in result.stdout


def run_check_includes(folder: Path | None = None) -> subprocess.CompletedProcess:
    arguments = [] if folder is None else [str(folder)]
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_includes.py"), *arguments], capture_output=True, text=True
    )


def test_comm_is_in_folders_that_include_only_folders_below_them():
    result = run_check_includes()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no folder includes one above it" in result.stdout
    comm = ROOT / "csrc" / "comm"
    assert not [p.name for p in comm.iterdir() if p.suffix in {".h", ".cpp"}], (
        "every source of csrc/comm is in a folder"
    )
    modules = {}
    for folder in (p for p in comm.iterdir() if p.is_dir()):
        modules[folder.name] = len({p.stem for p in folder.iterdir() if p.suffix in {".h", ".cpp"}})
        assert (folder / "README.md").exists(), folder
    assert len(modules) >= 5 and max(modules.values()) <= MODULES_PER_FOLDER_LIMIT, modules


def test_a_folder_including_one_above_it_is_found(tmp_path):
    # No module cycle (a/x -> b/y, b/z -> a/x), but the folders include each other.
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "README.md").write_text(f"# {folder}/\n\nModules. It may include `a/` and `b/`.\n")
    (tmp_path / "a" / "x.h").write_text('#include "comm/b/y.h"\n')
    (tmp_path / "b" / "y.h").write_text("#pragma once\n")
    (tmp_path / "b" / "z.cpp").write_text('#include "comm/a/x.h"\n')
    result = run_check_includes(tmp_path)
    assert result.returncode == 1
    assert "folders include each other: a -> b -> a" in result.stdout, result.stdout


def test_a_folder_including_one_its_readme_does_not_allow_is_found(tmp_path):
    for folder, allows in (("a", "It includes no other folder."), ("b", "It may include `c/`.")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "README.md").write_text(f"# {folder}/\n\nModules. {allows}\n\nMore.\n")
    (tmp_path / "a" / "x.h").write_text('#include "comm/b/y.h"\n')
    (tmp_path / "b" / "y.h").write_text("#pragma once\n")
    result = run_check_includes(tmp_path)
    assert result.returncode == 1
    assert "a/x includes b/y, which a/README.md does not allow" in result.stdout, result.stdout


def test_the_vocabulary_names_what_the_code_uses():
    """Note [Vocabulary] defines each noun of the comm layer by the type or name that stands for it:
    every such name is one the code (not only a comment) uses."""
    header = (ROOT / "csrc" / "comm" / "core" / "communicator.h").read_text()
    note = re.search(r"// Note \[Vocabulary\]\n((?://.*\n)+)", header)
    assert note, "Note [Vocabulary] in csrc/comm/core/communicator.h"
    text = re.sub(r"Note\s+\[[^\]]*\]", "", note.group(1).replace("//", ""))
    # Type names (CamelCase, X::y) and constants (kName) anywhere, and single capitalised words in brackets.
    names = set(re.findall(r"\b(?:[A-Z][a-z]+[A-Z]\w*|k[A-Z]\w+|[A-Z]\w*::\w+)\b", text))
    for bracket in re.findall(r"\(([^()]*)\)", " ".join(text.split())):
        names.update(re.findall(r"(?<![\w'])[A-Z][a-z]+\b(?!::)", bracket))
    code = "\n".join(
        re.sub(r"//.*", "", p.read_text()) for p in (ROOT / "csrc").rglob("*") if p.suffix in {".h", ".cpp"}
    )
    unused = sorted(name for name in names if not re.search(rf"\b{re.escape(name.split('::')[-1])}\b", code))
    assert len(names) >= 20 and not unused, (sorted(names), unused)


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
