"""Atomic writes: all or nothing, and the permissions a plain open()/mkdir() would give."""

from __future__ import annotations

import os
import stat

import pytest

from clipkit.artifacts.io import atomic_directory, atomic_path, atomic_write_text


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_files_and_directories_get_umask_permissions(tmp_path, umask_022):
    atomic_write_text(tmp_path / "a.txt", "x")
    assert mode(tmp_path / "a.txt") == 0o644  # not mkstemp's 0600: others may read reports
    with atomic_directory(tmp_path / "export") as building:
        (building / "w").write_text("y")
    assert mode(tmp_path / "export") == 0o755  # not mkdtemp's 0700


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("crash while writing")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_failed_directory_keeps_the_old_directory(tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    (target / "old").write_text("1")
    with pytest.raises(RuntimeError), atomic_directory(target) as building:
        (building / "new").write_text("2")
        raise RuntimeError("crash while exporting")
    assert sorted(p.name for p in target.iterdir()) == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
