"""csrc/comm's includes form no cycle (scripts/check_includes.py; issue 41)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_comm_has_no_include_cycle():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_includes.py")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no include cycle" in result.stdout


def test_a_cycle_is_found(tmp_path):
    (tmp_path / "a.h").write_text('#include "comm/b.h"\n')
    (tmp_path / "b.h").write_text("#pragma once\n")
    (tmp_path / "b.cpp").write_text('#include "comm/b.h"\n#include "comm/a.h"\n')
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_includes.py"), str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "a -> b -> a" in result.stdout
