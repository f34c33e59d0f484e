"""Every record of a rank file or a `.distcp` checked against its stored CRC-32, in the pass that hashes the file.

A rank file is a torch.save zip archive of stored (uncompressed) records; a `.distcp` is many such
archives back to back (one per chunk, at the byte ranges `.metadata` gives: mergeflow/formats/dcp.py). torch's reader checks
no CRC, and the fast reader checks only the pickle's (rank_pickle._check_pickle_crc): a bit flip
or a zeroed block inside tensor data would export silently. The manifest already needs one full
sequential pass for the file's sha256; the CRC-32s ride along on the same buffers, so integrity
costs CPU (zlib.crc32 runs about twice as fast as sha256 here), never a second read.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from mergeflow.errors import CheckpointError
from mergeflow.io.fs import HASH_BLOCK

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (version .. uncompressed size), name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"


@dataclass(frozen=True)
class StoredRecord:
    """One stored record as the central directory describes it."""

    name: str  # how a refusal names it (a rank file: the entry; a .distcp: the entry and its tensor's chunk)
    header_offset: int  # where its local header starts in the file; the data follows that header
    size: int  # bytes of data on disk
    crc: int


def stored_records(handle: BinaryIO) -> list[StoredRecord] | None:
    """The archive's stored records in file order (its central directory only); None if not a zip archive.

    Compressed records are left out: their CRC is of the inflated bytes, which would mean inflating
    them in the hash pass. torch writes every record stored, so none are expected.
    """
    try:
        # zipfile reads the end records and the central directory (ZIP64 included): milliseconds.
        # Given an open file, it leaves the file open and only moves its position.
        with zipfile.ZipFile(handle) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, struct.error):
        return None  # not an archive, or not one we can read: the loader gives that verdict
    return sorted((StoredRecord(i.filename, i.header_offset, i.compress_size, i.CRC)
                   for i in infos if i.compress_type == zipfile.ZIP_STORED), key=lambda r: r.header_offset)


def embedded_records(handle: BinaryIO, start: int, length: int, label: str) -> list[StoredRecord] | None:
    """The stored records of the archive at bytes [start, start + length) of a file (one `torch.save` record
    of a `.distcp`), with file offsets and named "ENTRY of LABEL"; None if that range is not a zip archive."""
    records = stored_records(ByteRange(handle, start, length))  # type: ignore[arg-type]
    if records is None:
        return None
    return [StoredRecord(f"{r.name} of {label}", start + r.header_offset, r.size, r.crc) for r in records]


class ByteRange(io.RawIOBase):
    """A read-only file over bytes [start, start + length) of an open file: one `torch.save` record of a
    `.distcp`, which torch's and zipfile's zip readers open as if it were the whole file (and cannot read past)."""

    def __init__(self, handle: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._handle, self._start, self._length, self._position = handle, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = min(max(0, base + offset), self._length)
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self._length - self._position)
        if wanted <= 0:
            return 0
        self._handle.seek(self._start + self._position)
        got = self._handle.readinto(view[:wanted]) or 0  # type: ignore[attr-defined]
        self._position += got
        return got


class _RecordChecker:
    """Follows the stream block by block: each record's local header, then a running CRC over its data.

    The local header's length (30 bytes + name + extra field; torch pads the extra field to align
    the data) is read from the blocks themselves as they pass: no seek, no second read. A record
    and its header may straddle any number of blocks.
    """

    def __init__(self, subject: str, records: list[StoredRecord]) -> None:
        self._subject = subject  # how refusals name the file: "rank file NAME", "DCP file NAME"
        self._records = records
        self._next = 0  # index of the record being followed
        self._header = bytearray()  # its local header's bytes, gathered so far
        self._data_start = self._data_end = -1  # its data's range, once the header is complete
        self._crc = 0
        self._consumed = 0  # end of the last record checked

    def feed(self, pos: int, block: memoryview) -> None:
        """The bytes at file offset `pos`; blocks arrive in order, without gaps."""
        end = pos + len(block)
        while self._next < len(self._records):
            record = self._records[self._next]
            if self._data_end < 0:
                if not self._header and record.header_offset < self._consumed:
                    self._next += 1  # overlaps the record before it: no torch layout; the loader judges it
                    continue
                lo = max(record.header_offset + len(self._header), pos)
                hi = min(record.header_offset + _LOCAL_HEADER.size, end)
                if lo >= hi:
                    return  # the header starts in a later block
                self._header += block[lo - pos:hi - pos]
                if len(self._header) < _LOCAL_HEADER.size:
                    return
                signature, name_len, extra_len = _LOCAL_HEADER.unpack(self._header)
                if signature != _LOCAL_SIGNATURE:
                    raise self._damaged(record, "has a damaged local header")
                self._data_start = record.header_offset + _LOCAL_HEADER.size + name_len + extra_len
                self._data_end = self._data_start + record.size
                self._crc = 0
            lo, hi = max(self._data_start, pos), min(self._data_end, end)
            if lo < hi:
                self._crc = zlib.crc32(block[lo - pos:hi - pos], self._crc)
            if self._data_end > end:
                return  # continues in the next block
            if self._crc != record.crc:
                raise self._damaged(record, "fails its CRC-32 check")
            self._consumed, self._data_end = self._data_end, -1
            self._header.clear()
            self._next += 1

    def finish(self) -> None:
        """The file has ended: every record must have been seen whole."""
        if self._next < len(self._records):
            raise self._damaged(self._records[self._next], "runs past the end of the file")

    def _damaged(self, record: StoredRecord, what: str) -> CheckpointError:
        return CheckpointError(f"{self._subject} is damaged: record {record.name} {what}; "
                               "copy it again from the training run")


def sha256_and_check_records(path: Path, block: int = HASH_BLOCK) -> str:
    """sha256 of a rank file, and every stored record checked against its CRC-32, in one sequential read.

    Raises CheckpointError naming the file and the first damaged record. A file that is not a zip
    archive is only hashed: the loader refuses it with its own message.
    """
    return sha256_and_check(path, lambda handle: stored_records(handle) or [], f"rank file {path.name}", block)


def sha256_and_check(path: Path, records_of: Callable[[BinaryIO], list[StoredRecord]], subject: str,
                     block: int = HASH_BLOCK) -> str:
    """sha256 of a file, and every record `records_of(handle)` lists (in file order) checked against its CRC-32
    in the same sequential read; CheckpointError naming `subject` and the first damaged record."""
    digest = hashlib.sha256()
    # One descriptor for the central directories and the pass: both read the same file (inode).
    with open(path, "rb", buffering=0) as handle:
        records = records_of(handle)
        checker = _RecordChecker(subject, records) if records else None
        handle.seek(0)
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger read-ahead when not cached
        # Serial, not a second thread for the CRCs: on 2 busy cores (bench/rank_crc_cost.py) a CRC
        # thread was slower in wall time (1.98 s vs 1.60 s for 1.33 GB) and cost more CPU (1.51 s vs
        # 1.24 s), and this pass already runs in the background beside the export's other work.
        buffer = bytearray(block)
        view = memoryview(buffer)
        pos = 0
        while n := handle.readinto(buffer):
            chunk = view[:n]
            digest.update(chunk)
            if checker is not None:
                checker.feed(pos, chunk)
            pos += n
    if checker is not None:
        checker.finish()
    return digest.hexdigest()
