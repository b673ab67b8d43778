"""What a torch user expects of an installed package: version, license, authors, typing marker, changelog."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import tomllib

import ddpkit

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_version_comes_from_the_installed_metadata():
    assert ddpkit.__version__ == importlib.metadata.version("ddpkit") == PYPROJECT["project"]["version"]


def test_license_and_authors_are_declared_and_shipped():
    metadata = importlib.metadata.metadata("ddpkit")
    assert metadata["License-Expression"] == "BSD-3-Clause"
    assert metadata["Author"] == "the ddpkit developers"
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "the ddpkit developers" in text
    # The metadata names the file it ships (wheels put it under .dist-info/licenses/).
    assert metadata.get_all("License-File") == ["LICENSE"]


def test_the_package_carries_its_typing_marker():
    # pyproject's wheel.packages ships every file of python/ddpkit, py.typed included (checked on a built
    # wheel: ddpkit/py.typed is listed beside the modules).
    assert (Path(ddpkit.__file__).parent / "py.typed").is_file()


def test_changelog_has_an_unreleased_section_and_the_current_version():
    text = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert headings[0] == "Unreleased"
    assert any(heading.startswith(PYPROJECT["project"]["version"]) for heading in headings[1:]), headings


def dry_run(target: str) -> list[str]:
    """The setup commands `make TARGET` would run (make -n prints them without running them)."""
    printed = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [line for line in printed.splitlines() if "scripts/setup.sh" in line]


def test_make_main_installs_only_what_it_runs():
    # The training comparison and its plot need matplotlib; pytest and jupyter are the suite's and the report's.
    assert dry_run("main") == ["bash scripts/setup.sh plot"]
    assert PYPROJECT["project"]["optional-dependencies"]["plot"] == ["matplotlib"]
    # CI runs `make test` on a fresh clone: it still gets everything the suite needs.
    assert dry_run("test") == ["bash scripts/setup.sh test,report,ray"]


def test_importing_ddpkit_leaves_dynamo_for_torch_compile_to_import():
    """Note [Compile support waits for Dynamo] (comm.py): no Dynamo at import; registered once it is imported."""
    script = """
import sys
import ddpkit
assert "torch._dynamo" not in sys.modules, "import ddpkit imported torch._dynamo"
assert ddpkit.syncbn._sync_batch_norm_op_eagerly is None
import torch._dynamo
from torch._dynamo.trace_rules import _polyfilled_function_ids
assert id(ddpkit._C.all_reduce_eager) in _polyfilled_function_ids, "all_reduce's binding has no substitute"
assert ddpkit.comm._all_reduce_op._torchdynamo_disable
assert ddpkit.syncbn._sync_batch_norm_op_eagerly._torchdynamo_disable
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
