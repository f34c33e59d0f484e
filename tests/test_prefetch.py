"""Rank-file digests hashed in the background: taken only for the exact stamp they were computed at."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mergeflow.io.fs import FileStamp
from mergeflow.io.prefetch import DigestPrefetch


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_prefetched_digest_is_the_files_and_is_taken_for_its_stamp_only(tmp_path: Path) -> None:
    a = _file(tmp_path / "a.pt", os.urandom(3 << 20))
    b = _file(tmp_path / "b.pt", os.urandom(1 << 20))
    prefetch = DigestPrefetch()  # one export's
    prefetch.start([a, b])
    assert prefetch.take(a, FileStamp.of(a)) == hashlib.sha256(a.read_bytes()).hexdigest()
    assert prefetch.take(b, FileStamp.of(b)) == hashlib.sha256(b.read_bytes()).hexdigest()

    b.write_bytes(os.urandom(1 << 20))  # rewritten after hashing: the digest belongs to the old file
    assert prefetch.take(b, FileStamp.of(b)) is None
    assert prefetch.take(tmp_path / "never-queued.pt", FileStamp.of(a)) is None

    assert DigestPrefetch().take(a, FileStamp.of(a)) is None  # another export's prefetch holds nothing of it
    prefetch.cancel()  # the export is over
    assert prefetch.take(a, FileStamp.of(a)) is None


def test_a_missing_file_leaves_the_hashing_to_the_task(tmp_path: Path) -> None:
    gone = tmp_path / "gone.pt"
    prefetch = DigestPrefetch()
    prefetch.start([gone])
    stamp = FileStamp.of(_file(tmp_path / "other.pt", b"x"))
    assert prefetch.take(gone, stamp) is None
