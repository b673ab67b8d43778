"""Every script of examples/ runs as its docstring says, and the README's Python snippets are lines of them."""

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.py"))


def documented_command(path: Path) -> list[str]:
    """The torchrun line of the example's docstring, as argv."""
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    lines = [line.strip() for line in docstring.splitlines() if line.strip().startswith("torchrun ")]
    assert len(lines) == 1, f"{path.name}: its docstring should give one torchrun command"
    return shlex.split(lines[0])


def test_there_are_the_four_examples():
    assert [path.stem for path in EXAMPLES] == ["collectives", "ddp_accumulation", "syncbn", "torch_ddp_on_ddpkit"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.stem)
def test_example_runs_as_documented(path):
    command = documented_command(path)
    assert command[0] == "torchrun" and command[-1] == f"examples/{path.name}"
    # torchrun as the module of this interpreter: the same program as .venv/bin/torchrun.
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", *command[1:]], cwd=REPO,
                            capture_output=True, text=True, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # The last line, from rank 0 once every check has passed on every rank.
    assert result.stdout.strip().splitlines()[-1].startswith(f"{path.stem}: "), output


def python_snippet_lines(markdown: str) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", markdown, flags=re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_python_snippets_are_lines_of_the_examples():
    examples = "\n".join(path.read_text() for path in EXAMPLES)
    example_lines = {line.strip() for line in examples.splitlines()}
    lines = python_snippet_lines((REPO / "README.md").read_text())
    assert lines, "the README shows no Python"
    assert [line for line in lines if line not in example_lines] == []
