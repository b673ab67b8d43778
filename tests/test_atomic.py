"""ddpkit.atomic.write_atomically: whole files only, with the permissions a plain open() would give."""

import os
import stat

import pytest

from ddpkit.atomic import write_atomically


@pytest.fixture
def umask():
    """Sets the process's umask for one test and restores it."""
    previous = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask,expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_file_gets_the_umask_not_the_temporary_files_0600(tmp_path, umask, mask, expected):
    umask(mask)
    path = write_atomically(tmp_path / "metrics.json", lambda handle: handle.write(b"{}"))
    assert path.read_bytes() == b"{}" and mode(path) == expected


def test_a_replaced_file_keeps_its_permissions(tmp_path, umask):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"old")
    path.chmod(0o640)
    write_atomically(path, lambda handle: handle.write(b"new"))
    assert path.read_bytes() == b"new" and mode(path) == 0o640


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"old")

    def fail(handle):
        handle.write(b"partial")
        raise ValueError("checksum mismatch")

    with pytest.raises(ValueError, match="checksum mismatch"):
        write_atomically(path, fail)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
