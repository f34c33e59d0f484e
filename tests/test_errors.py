"""The error hierarchy: one printable line, declared fields that survive Prefect's pickling, retry flags."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest

import mergeflow.tasks as tasks_package
from mergeflow import errors as E
from mergeflow.io.os_errors import is_retryable


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
    for cls in (E.DiskFullError, E.FileAccessError, E.StorageIOError):  # code handling OSErrors handles them too
        made = cls("reason\nsecond line", staging_dir="/tmp/s")
        assert isinstance(made, OSError) and str(made) == "reason second line" and made.args == ("reason\nsecond line",)
        assert made.errno is None and made.filename is None and made.staging_dir == "/tmp/s"
    assert not issubclass(E.ArtifactInvalidError, ValueError)  # not pydantic's or the Hub's ValidationError


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (E.CheckpointError("bad input stays bad"), False),
        (E.DiskFullError("free space first"), False),
        (E.FileAccessError("fix the permissions first"), False),
        (E.StorageIOError("the disk failed"), True),
        (E.UploadTransientError("the Hub had a hiccup"), True),
        # Transient OS errors: a retry a second later may get past them.
        (ConnectionResetError("peer reset"), True),
        (TimeoutError(), True),
        *[(OSError(code, os.strerror(code), "/data/x"), True) for code in (
            errno.EIO, errno.ENXIO, errno.ESTALE, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT,
            errno.ECONNRESET, errno.ECONNABORTED)],
        # Refusals that wait for a person, and OS errors users do not meet (bugs): never retried.
        *[(OSError(code, os.strerror(code), "/data/x"), False) for code in (
            errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT,
            errno.EINVAL, errno.EISDIR, errno.EBADF)],
        (FileNotFoundError("no such file"), False),
        # Bugs: a second run of the same code fails the same way.
        (TypeError("unsupported operand"), False),
        (KeyError("weight"), False),
        (AssertionError(), False),
        (ValueError("bad value"), False),
        (RuntimeError("CUDA out of memory"), False),
    ],
    ids=lambda v: v if isinstance(v, bool) else f"{type(v).__name__}-{getattr(v, 'errno', None)}",
)
def test_the_retry_policy_retries_only_what_may_heal(exc: BaseException, retry: bool) -> None:
    assert is_retryable(exc) is retry
    assert tasks_package.retry_transient(None, None, _State(exc)) is retry


def _count_attempts(tmp_path: Path, raises: BaseException, succeed_on: int | None = None) -> tuple[int, object]:
    """Run a task with the file tasks' retry options (no delay) in a real flow; (attempts, result or the exception)."""
    from prefect import flow, task

    attempts = tmp_path / "attempts"

    @task(**{**tasks_package.RETRY_IO, "retry_delay_seconds": 0})
    def flaky() -> str:
        with attempts.open("a") as log:  # the count lives in a file: nothing in the process could fake it
            log.write("x")
        if succeed_on is not None and attempts.stat().st_size >= succeed_on:
            return "done"
        raise raises

    @flow(name="retry-policy-check")
    def run_it() -> object:
        state = flaky(return_state=True)
        return state.result(raise_on_failure=False)

    outcome = run_it()
    return attempts.stat().st_size, outcome


@pytest.mark.parametrize("bug", [TypeError("unsupported operand"), KeyError("weight"), AssertionError("invariant")],
                         ids=lambda e: type(e).__name__)
def test_a_task_that_hits_a_bug_runs_exactly_once(bug: BaseException, tmp_path: Path, prefect_api: object) -> None:
    attempts, outcome = _count_attempts(tmp_path, bug)
    assert attempts == 1 and type(outcome) is type(bug)
    assert tasks_package.RETRY_IO["retries"] == 2  # retries were on offer: the condition refused them


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "Input/output error", "/data/x"), OSError(errno.EAGAIN, "again"),
                                 ConnectionResetError("peer reset"), E.StorageIOError("the disk failed")],
                         ids=lambda e: f"{type(e).__name__}-{getattr(e, 'errno', None)}")
def test_a_task_that_meets_a_transient_error_is_retried(exc: OSError, tmp_path: Path, prefect_api: object) -> None:
    attempts, outcome = _count_attempts(tmp_path, exc)
    assert attempts == 1 + tasks_package.RETRY_IO["retries"] and isinstance(outcome, OSError)
    healed = tmp_path / "healed"
    healed.mkdir()
    assert _count_attempts(healed, exc, succeed_on=2) == (2, "done")  # the retry's result is the task's


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.ENOENT])
def test_a_task_refused_by_the_os_runs_once(code: int, tmp_path: Path, prefect_api: object) -> None:
    attempts, outcome = _count_attempts(tmp_path, OSError(code, os.strerror(code), "/data/x"))
    assert attempts == 1 and isinstance(outcome, OSError) and outcome.errno == code


@pytest.mark.parametrize("code,error", [(errno.ENOSPC, "DiskFullError"), (errno.EACCES, "FileAccessError"),
                                        (errno.EROFS, "FileAccessError"), (errno.EIO, "StorageIOError")])
def test_typed_os_errors_keep_errno_and_file_names_through_pickling(code: int, error: str) -> None:
    from mergeflow.io.os_errors import typed_os_error

    typed = typed_os_error(OSError(code, os.strerror(code), "/data/a", None, "/data/b"), "renaming")
    assert type(typed).__name__ == error and isinstance(typed, OSError)
    again = pickle.loads(pickle.dumps(typed))  # as Prefect stores a failed task's exception
    for exc in (typed, again):
        assert (exc.errno, exc.filename, exc.filename2) == (code, "/data/a", "/data/b")
        assert str(exc) == str(typed) and "\n" not in str(exc) and "/data/a -> /data/b" in str(exc)
    assert typed_os_error(typed) is typed  # an OSError now, yet never typed twice


def test_a_lock_that_cannot_be_made_beside_an_existing_target_is_still_named(tmp_path: Path) -> None:
    # clear_publish_leftovers catches OSErrors (an export holds the lock); FileAccessError became one,
    # and must still say why no lock file can be made there.
    from mergeflow.io.paths import lock_path_for
    from mergeflow.io.staging import check_target

    target = tmp_path / "published"
    target.mkdir()
    lock_path_for(target).mkdir()  # os.open(O_CREAT) of a directory: EISDIR, even for root
    with pytest.raises(E.FileAccessError, match="cannot create files in") as refused:
        check_target(target)
    assert refused.value.errno == errno.EISDIR and os.fspath(refused.value.filename) == str(lock_path_for(target))


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
