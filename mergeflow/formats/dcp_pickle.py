"""A closed reader for a torch Distributed Checkpoint's `.metadata` (a plain pickle of `Metadata`).

torch's own `FileSystemReader.read_metadata` calls `pickle.load` on it: any global, any code.
This unpickler admits only the classes the checkpoint metadata pickles (and torch's plain value
types), each mapped to an inert record built from its pickled state; nothing in the table runs
code beyond building these records, `torch.Size`s and dtypes. Anything else is refused before
it is called, so a malicious `.metadata` runs nothing. The records carry the same attribute names
as torch's classes, so code reading them also reads a `Metadata` that torch unpickled (trusted).
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from pathlib import PurePosixPath
from typing import Any

import torch

from mergeflow.formats.rank_pickle import SAFE_DTYPES, strided_layout


class NotSafeMetadata(Exception):
    """The pickle names something outside the closed table (a payload, or a newer torch's class)."""


class _Record:
    """NEWOBJ + BUILD target: attributes come from the pickled state dict (string keys), nothing runs."""

    _fields: frozenset[str] = frozenset()

    def __init__(self, *args: Any) -> None:
        if args:
            raise NotSafeMetadata(f"{type(self).__name__} built with arguments")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None and isinstance(state[1], dict):
            state = state[1]  # a frozen / slotted dataclass pickles (None, slots)
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state) or set(state) - self._fields:
            raise NotSafeMetadata(f"{type(self).__name__} with an unexpected state")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _record(name: str, *fields: str) -> type[_Record]:
    return type(name, (_Record,), {"_fields": frozenset(fields)})


Metadata = _record("Metadata", "state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
TensorStorageMetadata = _record("TensorStorageMetadata", "properties", "size", "chunks")
BytesStorageMetadata = _record("BytesStorageMetadata")
ChunkStorageMetadata = _record("ChunkStorageMetadata", "offsets", "sizes")
StorageMeta = _record("StorageMeta", "checkpoint_id", "save_id", "load_id", "modules")
StorageInfo = _record("_StorageInfo", "relative_path", "offset", "length", "transform_descriptors")
_StoragePrefix = _record("_StoragePrefix", "prefix")


class MetadataIndex(_Record):
    _fields = frozenset({"fqn", "offset", "index"})

    def __hash__(self) -> int:  # storage_data is a dict keyed by these (built after BUILD: the
        return hash((self.fqn, self.offset))  # dict is filled once the keys are complete)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and (self.fqn, self.offset) == (other.fqn, other.offset)


class TensorProperties(_Record):
    """Pickled through its own __getstate__ as (dtype, layout, requires_grad, memory format code, pin_memory)."""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[0], torch.dtype)):
            raise NotSafeMetadata("TensorProperties with an unexpected state")
        self.dtype, self.layout, self.requires_grad, _memory_format, self.pin_memory = state


def _memory_format_code(value: Any) -> int:  # the _MEM_FORMAT_ENCODING enum, by value
    if not isinstance(value, int) or isinstance(value, bool):
        raise NotSafeMetadata("a memory format code that is not an integer")
    return value


# Some Python 3.11 releases (Debian's 3.11.2) pickle an enum member by name, as getattr(EnumClass, "NAME"):
# getattr is accepted for exactly this member lookup, on the one enum the metadata holds, nothing else.
_MEM_FORMAT_NAMES = {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2}


def _enum_member(owner: Any, name: Any) -> int:
    if owner is not _memory_format_code or not isinstance(name, str) or name not in _MEM_FORMAT_NAMES:
        raise NotSafeMetadata("global builtins.getattr outside the memory-format enum")
    return _MEM_FORMAT_NAMES[name]


def _path(*parts: Any) -> str:  # StorageMeta.checkpoint_id: where it was saved (never used)
    if not all(isinstance(p, str) for p in parts):
        raise NotSafeMetadata("a path built from non-strings")
    return str(PurePosixPath(*parts))


def _layout(name: Any) -> str:
    return strided_layout(name, NotSafeMetadata)


_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_TABLE: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    (_MD, "Metadata"): Metadata,
    (_MD, "TensorStorageMetadata"): TensorStorageMetadata,
    (_MD, "BytesStorageMetadata"): BytesStorageMetadata,
    (_MD, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_MD, "TensorProperties"): TensorProperties,
    (_MD, "StorageMeta"): StorageMeta,
    (_MD, "MetadataIndex"): MetadataIndex,
    (_MD, "_MEM_FORMAT_ENCODING"): _memory_format_code,
    ("builtins", "getattr"): _enum_member,
    (_FS, "_StorageInfo"): StorageInfo,
    (_FS, "_StoragePrefix"): _StoragePrefix,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    **{("torch", name): dtype for name, dtype in SAFE_DTYPES.items()},
}


class _ClosedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _TABLE[(module, name)]
        except (KeyError, TypeError):
            raise NotSafeMetadata(f"global {module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise NotSafeMetadata("a persistent id (not plain checkpoint metadata)")


def load_metadata(data: bytes) -> Any:
    """The `Metadata` record of a `.metadata` pickle; NotSafeMetadata if it names anything outside the table.

    Other failures (truncated or corrupt bytes) propagate as pickle / EOF / value errors.
    """
    value = _ClosedUnpickler(io.BytesIO(data)).load()
    if not isinstance(value, Metadata):
        raise NotSafeMetadata(f"a {type(value).__name__}, not checkpoint Metadata")
    return value
