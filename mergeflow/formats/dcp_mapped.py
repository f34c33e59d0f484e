"""A `.distcp` chunk read in place: its `torch.save` record parsed inside the file mapping, no copy of the chunk.

A `.distcp` holds one `torch.save` zip archive per chunk at the byte range `.metadata` gives
(mergeflow/formats/dcp.py). Here that archive's central directory is read from the mapping
(zip_records), its pickle runs through the closed unpickler verl's rank files use
(rank_pickle.closed_load), and its storage becomes a tensor over the mapped bytes
(rank_pickle.storage_view): the page cache's pages, not a private copy of the chunk.

torch.save aligns a storage to 64 bytes from its archive's start, but a `.distcp` puts archives back to
back at any byte, so a storage often sits at an odd file offset. torch's kernels load typed data as if
aligned (a misaligned float tensor can fault or read shifted bytes, pytorch#190043), so such a storage
is copied once out of the mapping into an aligned tensor (still parsed and bounds-checked here), unless
the caller asks for the chunk in place (`align=False`): a streamed tensor's pieces are only written,
hashed and compared as bytes, which needs no alignment, so they are never copied.

Anything this reader does not know (not a stored zip archive, a big-endian or compressed record, a global
outside the closed table, damage) raises NotFastReadable: the caller then reads the chunk with torch's
loader, whose verdict and messages apply. A storage whose bytes lie outside its chunk's byte range is
refused here, in one line: no loader should read a neighbour's bytes as this tensor.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import torch

from mergeflow.errors import CheckpointError
from mergeflow.formats.rank_pickle import (
    MappedFile,
    NotFastReadable,
    closed_load,
    storage_nbytes,
    storage_view,
)
from mergeflow.formats.zip_records import ByteRange, StoredRecord, stored_records

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (version .. sizes), name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"


class _MappedHandle:
    """Just enough of a file for `ByteRange` (seek, readinto) over a memoryview of the mapping."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._position = view, 0

    def seek(self, position: int) -> int:
        self._position = position
        return position

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        got = max(0, min(len(out), len(self._view) - self._position))
        out[:got] = self._view[self._position : self._position + got]
        self._position += got
        return got


class _Chunk:
    """One chunk's archive inside the mapping: where its records' data lie, checked against its range."""

    def __init__(self, mapped: MappedFile, whole: memoryview, offset: int, length: int, label: str) -> None:
        self.mapped, self.offset, self.length, self.label = mapped, offset, length, label
        self._whole = whole
        records = stored_records(ByteRange(_MappedHandle(whole), offset, length))  # type: ignore[arg-type]
        if records is None:
            raise NotFastReadable("not a zip archive")
        self.records = {r.name: r for r in records}  # stored records only: a compressed one is absent
        pickle_name = next((n for n in self.records if n == "data.pkl" or n.endswith("/data.pkl")), None)
        if pickle_name is None:
            raise NotFastReadable("no stored data.pkl record")
        self.prefix = pickle_name[: -len("data.pkl")]
        self.pickle_record = self.records[pickle_name]

    def data_range(self, record: StoredRecord) -> tuple[int, int]:
        """[start, end) of a record's data, relative to the archive, inside the chunk's range."""
        header_end = record.header_offset + _LOCAL_HEADER.size
        if record.header_offset < 0 or header_end > self.length:
            raise self.outside(f"record {record.name}", record.header_offset, header_end)
        at = self.offset + record.header_offset
        signature, name_len, extra_len = _LOCAL_HEADER.unpack(self._whole[at : at + _LOCAL_HEADER.size])
        if signature != _LOCAL_SIGNATURE:
            raise NotFastReadable(f"record {record.name} has no local header")
        start = header_end + name_len + extra_len
        if start + record.size > self.length:
            raise self.outside(f"record {record.name}", start, start + record.size)
        return start, start + record.size

    def data(self, record: StoredRecord) -> bytes:
        start, end = self.data_range(record)
        return bytes(self._whole[self.offset + start : self.offset + end])

    def outside(self, what: str, start: int, end: int) -> CheckpointError:
        first, last = self.offset + start, self.offset + end
        return CheckpointError(
            f"DCP file {self.mapped.path.name} is damaged: the record of {self.label} puts {what} at bytes "
            f"{first:,}-{last:,}, outside its chunk's bytes {self.offset:,}-{self.offset + self.length:,}; "
            "copy it again from the training run"
        )


def read_chunk(mapped: MappedFile, offset: int, length: int, label: str, *, align: bool = True) -> torch.Tensor:
    """The tensor `torch.save`d at bytes [offset, offset + length) of a mapped `.distcp`, viewing the mapping.

    `label` names the chunk in a refusal ("KEY (chunk at [0, 0])"). Raises CheckpointError for a
    storage outside the chunk's bytes, NotFastReadable for anything to leave to torch's loader.
    align=False views a storage at an odd offset in place instead of copying it: for byte-level use only.
    """
    if offset < 0 or length <= 0 or offset + length > mapped.size:
        raise NotFastReadable("a byte range outside the file")  # the caller's checks name this case
    with memoryview(mapped.buffer) as whole:
        try:
            tensor = _load(mapped, whole, offset, length, label, align)
        except (NotFastReadable, CheckpointError):
            raise
        except Exception as exc:  # noqa: BLE001  (damage or an odd layout: torch's loader gives the verdict)
            raise NotFastReadable(f"{type(exc).__name__}: {exc}") from None
    if type(tensor) is not torch.Tensor:  # a Parameter is rebuilt as its tensor; anything else: torch's verdict
        raise NotFastReadable(f"a {type(tensor).__name__}, not a tensor")
    return tensor


def _load(mapped: MappedFile, whole: memoryview, offset: int, length: int, label: str, align: bool) -> Any:
    chunk = _Chunk(mapped, whole, offset, length, label)
    byteorder = chunk.records.get(f"{chunk.prefix}byteorder")
    if byteorder is not None and chunk.data(byteorder) != b"little":
        raise NotFastReadable("a big-endian archive")
    pickled = chunk.data(chunk.pickle_record)
    if zlib.crc32(pickled) != chunk.pickle_record.crc:
        raise NotFastReadable("data.pkl fails its CRC-32")  # damage: torch's loader gives the verdict
    storages: dict[str, tuple[torch.UntypedStorage, torch.dtype]] = {}

    def storage_of(key: str, dtype: torch.dtype, numel: int) -> torch.UntypedStorage:
        found = storages.get(key)
        if found is None:
            found = storages[key] = (_storage(chunk, key, dtype, numel, align), dtype)
        elif found[1] != dtype:
            raise NotFastReadable(f"storage {key} is read with two dtypes")
        return found[0]

    return closed_load(pickled, storage_of)


def _storage(chunk: _Chunk, key: str, dtype: torch.dtype, numel: int, align: bool) -> torch.UntypedStorage:
    """Storage `key` of the chunk: a view of the mapping, or (align) an aligned copy where torch needs alignment."""
    name = f"{chunk.prefix}data/{key}"
    record = chunk.records.get(name)
    if record is None:
        raise NotFastReadable(f"no stored record {name}")
    start, _ = chunk.data_range(record)
    nbytes = storage_nbytes(dtype, numel)
    if start + nbytes > chunk.length:
        raise chunk.outside(f"storage {name}", start, start + nbytes)
    if nbytes > record.size:
        raise NotFastReadable(f"storage {key} is larger than its record")
    try:
        view = storage_view(chunk.mapped, chunk.offset + start, nbytes)
    except ValueError:  # the range lies in the file (checked above): kept for a file that shrank meanwhile
        raise chunk.outside(f"storage {name}", start, start + nbytes) from None
    if not align or chunk.mapped.aligned(chunk.offset + start, dtype):
        return view
    # One aligned copy of this storage's bytes (its chunk only): a typed view here would be misaligned.
    return torch.empty(0, dtype=torch.uint8).set_(view).clone().untyped_storage()
