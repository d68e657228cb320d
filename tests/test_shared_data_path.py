"""tests/shared_data_path.py: CLIPKIT_TESTS_SHARED_DATA chooses the shared data folder the suite sees."""

from __future__ import annotations

from pathlib import Path

from shared_data_path import VARIABLE, shared_data_dir


def test_none_runs_as_if_the_folder_were_absent(monkeypatch):
    monkeypatch.setenv(VARIABLE, "none")
    folder = shared_data_dir()
    assert not folder.exists() and not list(folder.glob("coco-*/images/*.jpg"))


def test_a_path_is_used_as_given(monkeypatch, tmp_path):
    monkeypatch.setenv(VARIABLE, str(tmp_path))
    assert shared_data_dir() == tmp_path


def test_unset_is_the_folder_beside_the_checkout(monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    checkout = Path(__file__).resolve().parents[1]
    assert shared_data_dir() == checkout.parent / "shared" / "data"
