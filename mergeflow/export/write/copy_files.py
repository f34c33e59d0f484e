"""Copying the base pipeline's other files into the artifact, byte for byte and hash-verified.

Every file named by the plan is copied to the same relative path (never through a symlink). A
plain file's copy must hash to the sha256 recorded at inspection, so a base file changed since
then is noticed; configs lose only their local-path keys, and the removals are returned for the
manifest. The task is idempotent: a staged copy that already has the expected digest is kept.
"""

from __future__ import annotations

import errno
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mergeflow.errors import InputChangedError
from mergeflow.io.config_paths import is_config_json, strip_local_paths
from mergeflow.io.fs import FileStamp, is_plain_file
from mergeflow.io.interrupt import raise_if_stopped
from mergeflow.io.jsonfiles import write_bytes_durable
from mergeflow.io.os_errors import name_written_file, typed_os_error
from mergeflow.io.ranges import FileRanges, file_digests
from mergeflow.io.session import carry_session, current_session, sha256_file
from mergeflow.records import CopyResult, FileRecord, MergePlan


def _open_source(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise InputChangedError(f"base file {path.name} disappeared during the export") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputChangedError(f"base file {path.name} became a symlink during the export") from None
        raise


def _temp_name(work: Path, rel: str) -> Path:
    # Partial copies live in work/, never in the artifact tree: a crash must not leave a stray
    # file there that would fail validation on resume.
    return work / f"copy-{hashlib.sha256(rel.encode()).hexdigest()[:16]}-{os.getpid()}.partial"


_COPY_CHUNK = 256 << 20


def _copy_bytes(src: Path, dst: Path, tmp: Path) -> None:
    """Kernel-side copy (sendfile) of a plain file into a temp name, fsynced, then renamed into place."""
    fd_in = _open_source(src)
    try:
        size = os.fstat(fd_in).st_size
        fd_out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            while offset < size:
                raise_if_stopped()  # between bounded chunks: a multi-GB text encoder stops within a second
                sent = os.sendfile(fd_out, fd_in, offset, min(size - offset, _COPY_CHUNK))
                if sent == 0:
                    raise InputChangedError(f"base file {src.name} shrank during the export")
                offset += sent
            os.fsync(fd_out)
        except OSError as exc:
            name_written_file(exc, dst)
            raise
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)
    os.replace(tmp, dst)


def _digest(path: Path) -> str | None:
    return sha256_file(path) if is_plain_file(path) else None


def _digests(path: Path) -> tuple[str | None, FileRanges | None]:
    """A copied file's sha256 and, when large, its per-range digests (both passes at once)."""
    return file_digests(path, sha256_file) if is_plain_file(path) else (None, None)


def copy_one(base: Path, artifact: Path, work: Path, rel: str, base_digest: str,
             stamp: FileStamp | None) -> tuple[FileRecord, list[str], bool]:
    """Copy one base file (configs without local-path keys) and prove the copy's bytes; True: an earlier copy was kept."""
    raise_if_stopped()  # Ctrl-C / SIGTERM: no new file is started
    src, dst, tmp = base / rel, artifact / rel, _temp_name(work, rel)
    if not is_plain_file(src):
        raise InputChangedError(f"base file {rel} is no longer a plain file")
    dst.parent.mkdir(parents=True, exist_ok=True)
    removed: list[str] = []
    ranges: FileRanges | None = None
    if is_config_json(rel):
        raw = current_session().known_bytes(src)  # a config this export read when planning: not opened again
        if raw is None:
            with os.fdopen(_open_source(src), "rb") as handle:
                raw = handle.read()
        if hashlib.sha256(raw).hexdigest() != base_digest:
            raise InputChangedError(f"base file {rel} changed during the export; rerun once the base is stable")
        data, removed = strip_local_paths(rel, raw, str(base))
        want = hashlib.sha256(data).hexdigest()
        got = _digest(dst)  # a copy from an earlier attempt is kept when it is right
        kept = got == want
        if not kept:
            write_bytes_durable(dst, data, tmp)
            got = sha256_file(dst)
    else:
        want = base_digest
        got, ranges = _digests(dst)
        kept = got == want
        if not kept:
            _copy_bytes(src, dst, tmp)
            got, ranges = _digests(dst)
    if got != want:
        raise InputChangedError(f"the copy of base file {rel} does not hash to the base's sha256: the base changed during the export")
    if stamp is not None and FileStamp.of(src) != stamp:
        raise InputChangedError(f"base file {rel} changed during the export; rerun once the base is stable")
    size = dst.stat().st_size
    if ranges is not None and ranges.size != size:
        raise InputChangedError(f"the copy of base file {rel} changed size while it was hashed")
    return FileRecord(rel, got, size, "copied", ranges), removed, kept


def copy_base_files(plan: MergePlan, *, workers: int = 2) -> CopyResult:
    """Copy every planned base file into the staged artifact, largest first, a few at a time."""
    base, artifact, work = Path(plan.base.base_dir), Path(plan.output.artifact_dir), Path(plan.output.work_dir)
    artifact.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    ordered = sorted(plan.base.copy_files, key=lambda rel: -plan.input_stamps.get(str(base / rel), FileStamp(0, 0, 0, 0)).size)

    def one(rel: str) -> tuple[FileRecord, list[str], bool]:
        return copy_one(base, artifact, work, rel, plan.base.files[rel], plan.input_stamps.get(str(base / rel)))

    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            results = list(pool.map(carry_session(one), ordered))
    except OSError as exc:
        typed = typed_os_error(exc, "copying the base's files")
        if typed is None:
            raise
        raise typed from None
    files = tuple(sorted((r for r, _, _ in results), key=lambda r: r.rel_path))
    removed = {r.rel_path: keys for r, keys, _ in results if keys}
    if removed != plan.conversion.config_changes:  # what the manifest records, decided at inspect
        raise InputChangedError("the base's configs changed during the export (local-path keys differ from inspection)")
    reused = tuple(sorted(r.rel_path for r, _, kept in results if kept))
    return CopyResult(files=files, removed_keys=dict(sorted(removed.items())), reused=reused)
