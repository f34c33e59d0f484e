"""The error hierarchy: one printable line, declared fields that survive Prefect's pickling, retry flags."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest

import mergeflow.tasks as tasks_package
from mergeflow import errors as E


class _State:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def result(self) -> None:
        raise self.exc


def test_messages_are_one_printable_line() -> None:
    exc = E.BaseModelError("class \x1b[2J\x1b[1mEvil\x1b[0m\nnext \x1b]0;title\x07line\x00")
    assert str(exc) == "class Evil next line"
    assert exc.message.startswith("class \x1b[2J")  # the raw text stays available to code


def test_declared_fields_survive_pickling() -> None:
    exc = E.ShardLayoutError("bad layout").kept_in("/tmp/.out.mergeflow-staging-1")
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is E.ShardLayoutError
    assert again.staging_dir == "/tmp/.out.mergeflow-staging-1" and str(again) == "bad layout"
    assert E.CheckpointError("x").staging_dir is None


def test_builtin_bases_and_exit_codes() -> None:
    full = E.DiskFullError("no space left")
    assert isinstance(full, OSError) and isinstance(full, E.MergeflowError)
    assert full.exit_code == 2
    assert not issubclass(E.ArtifactInvalidError, ValueError)  # not pydantic's or the Hub's ValidationError


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (E.CheckpointError("bad input stays bad"), False),
        (E.DiskFullError("free space first"), False),
        (E.UploadTransientError("the Hub had a hiccup"), True),
        (ConnectionResetError("peer reset"), True),
        (OSError(5, "EIO"), True),
    ],
)
def test_the_retry_policy_reads_the_retryable_flag(exc: BaseException, retry: bool) -> None:
    assert E.is_retryable(exc) is retry
    assert tasks_package.retry_transient(None, None, _State(exc)) is retry


@pytest.mark.parametrize("code,error,words", [
    (errno.ENOSPC, "DiskFullError", "no space left"),
    (errno.EDQUOT, "DiskFullError", "quota"),
    (errno.EFBIG, "DiskFullError", "file size"),
    (errno.EACCES, "FileAccessError", "permission denied"),
    (errno.EPERM, "FileAccessError", "permission denied"),
    (errno.EROFS, "FileAccessError", "read-only filesystem"),
    (errno.ENOENT, "InputChangedError", "vanished"),
    (errno.EIO, "StorageIOError", "rerun once it is healthy"),
])
def test_the_os_errors_users_meet_become_one_line_refusals(code: int, error: str, words: str) -> None:
    from mergeflow.io.os_errors import typed_os_error

    typed = typed_os_error(OSError(code, os.strerror(code), "/data/out/model.safetensors"), "writing model.safetensors")
    assert type(typed).__name__ == error and typed.exit_code == 2
    assert words in str(typed) and "/data/out/model.safetensors" in str(typed) and "\n" not in str(typed)
    assert typed.retryable == (code == errno.EIO)  # only a failing disk may heal on a retry
    assert typed.resumable == (code != errno.ENOENT)  # a vanished input is a new export, not a resume


@pytest.mark.parametrize("code,words", [(errno.EROFS, "read-only filesystem"), (errno.EACCES, "permission denied")])
def test_a_failing_write_in_prefect_home_names_prefect_home(code: int, words: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from mergeflow.io.os_errors import typed_os_error

    home = tmp_path / "prefect"
    monkeypatch.setenv("PREFECT_HOME", str(home))
    typed = typed_os_error(OSError(code, os.strerror(code), str(home / "storage" / "x")))
    assert typed is not None and str(typed) == (f"{words}: {home / 'storage' / 'x'} is in PREFECT_HOME ({home}); "
                                                "set PREFECT_HOME to a writable directory")
    elsewhere = typed_os_error(OSError(code, os.strerror(code), str(tmp_path / "out")))
    assert elsewhere is not None and "PREFECT_HOME" not in str(elsewhere)


def test_other_os_errors_stay_internal() -> None:
    from mergeflow.io.os_errors import typed_os_error

    assert typed_os_error(OSError(errno.EINVAL, "Invalid argument")) is None
    full = E.DiskFullError("no space left")
    assert typed_os_error(full) is full
