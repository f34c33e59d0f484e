"""The suite's check for what a run leaves in the temp dir (tests/temp_leftovers.py, run by conftest)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import temp_leftovers


def test_new_entries_of_the_checked_names_are_reported_and_others_are_not(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "runner_storage" / "kept-from-before").mkdir(parents=True)
    (tmp_path / "dask-scratch-space").mkdir()
    before = temp_leftovers.snapshot()
    (tmp_path / "runner_storage" / "1b4e28ba-2fa1-11d2-883f-0016d3cca427").mkdir()
    (tmp_path / "prefect-workspace-attempt-abc").mkdir()
    (tmp_path / "org.chromium.Chromium.xyz").mkdir()
    (tmp_path / "someone-elses-file").write_text("")  # another process's: not ours to judge
    (tmp_path / "dask-scratch-space" / "worker-1").mkdir()  # in a directory that was there before: not new
    assert temp_leftovers.left_since(before) == ["org.chromium.Chromium.xyz", "prefect-workspace-attempt-abc",
                                                  "runner_storage/1b4e28ba-2fa1-11d2-883f-0016d3cca427"]


def test_a_temp_dir_without_runner_storage_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = temp_leftovers.snapshot()
    assert before == set()
    (tmp_path / "dask-scratch-space").mkdir()
    assert temp_leftovers.left_since(before) == ["dask-scratch-space"]
