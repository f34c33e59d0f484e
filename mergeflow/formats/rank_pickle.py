"""A fast, closed reader for verl's rank files (torch.save archives of DTensor state dicts).

`torch.load(weights_only=True)` unpickles with a pure-Python unpickler and builds a real DTensor
(autograd wrapper, DeviceMesh, spec) for each key: for a real transformer (1,100-1,900 keys)
that is 0.3-1.5 s per rank file, times 8+ ranks, before any byte is exported. An export only
needs each key's placements, global shape, mesh and a view of its local shard.

This reader runs the C unpickler with a closed table of globals. Every class a DTensor state
dict pickles is mapped to an inert record here (nothing in the table runs code beyond building
these records, `torch.Size`s, dtypes and tensor views into the mmapped file). Any global not in
the table, any unexpected structure, any error: `NotFastReadable`, and the caller falls back to
torch's own safe loader. The table is a subset of what torch's weights_only loader admits for
DTensor files, so this reader never accepts a file the safe loader refuses, and a file it
cannot read gets exactly the safe loader's verdict and messages.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mergeflow.errors import CheckpointError
from mergeflow.io.fs import FileStamp
from mergeflow.io.session import current_session
from mergeflow.io.stamped_cache import StampedCache

# A rank file's state dict: key -> tensor (a DTensor, a local tensor or a fast-read sharded value),
# or whatever else training saved beside the weights (checked by the caller).
StateDict = dict[str, Any]


class NotFastReadable(Exception):
    """The file holds something outside the closed table: read it with torch's safe loader."""


# --- inert stand-ins for the classes a DTensor state dict pickles -----------------------------

class _Built:
    """NEWOBJ + BUILD target: attributes come from the pickled state dict, nothing runs."""

    _torch_name = ""

    def __init__(self, *args: Any) -> None:
        self._args = args

    def __repr__(self) -> str:  # as torch prints it, for error messages
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{self._torch_name or type(self).__name__}({fields})"


class Shard(_Built):
    """Shard(dim): `dim` set by BUILD."""

    dim: int


class StridedShard(_Built):
    """_StridedShard: refused later (not a torch.chunk layout)."""

    _torch_name = "_StridedShard"
    dim: int


class Replicate(_Built):
    pass


class Partial(_Built):
    pass


class DeviceMesh(_Built):
    """The mesh: its dimension names and layout; no process group is touched."""

    _layout: Any
    _mesh_dim_names: tuple[str, ...] | None

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return getattr(self, "_mesh_dim_names", None)

    @property
    def shape(self) -> tuple[int, ...]:
        axes = self._layout.axes
        return tuple(math.prod(axis.shape) for axis in axes)


class _MeshLayout(_Built):
    axes: tuple[Any, ...]


class _FlatLayout(_Built):
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class DTensorSpec(_Built):
    mesh: DeviceMesh
    placements: tuple[Any, ...]


class _Tuple(tuple):  # type: ignore[type-arg]
    """TensorMeta / ShardOrderEntry are NamedTuples: NEWOBJ calls cls.__new__(cls, *fields)."""

    def __new__(cls, *fields: Any) -> "_Tuple":
        return super().__new__(cls, fields)


class TensorMeta(_Tuple):
    pass


class ShardOrderEntry(_Tuple):
    pass


class _DTensorType:
    """Stands for the DTensor class inside `_rebuild_from_type_v2(func, DTensor, args, state)`."""


@dataclass(frozen=True)
class _Wrapper:
    dtype: torch.dtype
    size: torch.Size


@dataclass
class ShardedValue:
    """One DTensor of a rank file: global shape and dtype, placements, mesh, the local shard."""

    dtype: torch.dtype
    shape: torch.Size
    placements: tuple[Any, ...]
    device_mesh: DeviceMesh
    local: torch.Tensor

    def to_local(self) -> torch.Tensor:
        return self.local


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


@dataclass(frozen=True)
class _Storage:
    untyped: torch.UntypedStorage
    dtype: torch.dtype


# --- the rebuild functions the table admits -----------------------------------------------------

def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, metadata: Any = None) -> torch.Tensor:
    if not isinstance(storage, _Storage) or metadata:
        raise NotFastReadable("tensor metadata outside the closed table")
    offset, size, stride = int(offset), tuple(int(n) for n in size), tuple(int(n) for n in stride)
    _check_in_bounds(storage, offset, size, stride)
    tensor = torch.empty((0,), dtype=storage.dtype)
    return tensor.set_(storage.untyped, offset, size, stride)


def _check_in_bounds(storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
    """A view must lie inside its storage: `set_` does not check, and a view past the end reads
    memory that is not the file's."""
    itemsize = torch.empty((), dtype=storage.dtype).element_size()
    if len(size) != len(stride) or offset < 0 or any(n < 0 for n in size) or any(n < 0 for n in stride):
        raise NotFastReadable("a tensor view with negative or mismatched sizes")
    if math.prod(size) == 0:
        return
    last = offset + sum((n - 1) * st for n, st in zip(size, stride))
    if (last + 1) * itemsize > storage.untyped.nbytes():
        raise NotFastReadable("a tensor view that runs past its storage")


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> torch.Tensor:
    if type(data) is not torch.Tensor:
        raise NotFastReadable("parameter of an unexpected type")
    return data


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, stride: Any, storage_offset: Any,
                              layout: Any, device: Any, requires_grad: Any) -> _Wrapper:
    if cls is not _DTensorType or not isinstance(dtype, torch.dtype) or layout != "torch.strided":
        raise NotFastReadable("a tensor subclass other than DTensor")
    return _Wrapper(dtype=dtype, size=torch.Size(size))


def _object_state(state: Any) -> StateDict:
    """torch's `_set_obj_state` input: a dict, or (dict or None, slot dict) for a class with __slots__."""
    if isinstance(state, dict):
        return state
    if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
        return {**(state[0] or {}), **(state[1] or {})}
    raise NotFastReadable("an object state of unexpected shape")


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> ShardedValue:
    if func is not _rebuild_wrapper_subclass or new_type is not _DTensorType:
        raise NotFastReadable("a rebuilt type other than DTensor")
    wrapper = func(*args)
    state = _object_state(state)
    spec, local = state.get("_spec"), state.get("_local_tensor")
    if not isinstance(spec, DTensorSpec) or type(local) is not torch.Tensor or set(state) - {"_spec", "_local_tensor"}:
        raise NotFastReadable("a DTensor state of unexpected shape")
    mesh = getattr(spec, "mesh", None)
    if not isinstance(mesh, DeviceMesh) or not isinstance(getattr(spec, "placements", None), tuple):
        raise NotFastReadable("a DTensor spec of unexpected shape")
    return ShardedValue(dtype=wrapper.dtype, shape=wrapper.size, placements=spec.placements, device_mesh=mesh, local=local)


def _device(name: Any) -> str:
    if not isinstance(name, str):
        raise NotFastReadable("a device that is not a name")
    return "cpu"  # map_location="cpu": GPU-written files load on the CPU


def strided_layout(name: Any, error: type[Exception]) -> str:
    """`torch.serialization._get_layout`'s argument, admitted only for the one layout a checkpoint holds."""
    if name != "torch.strided":
        raise error(f"layout {name!r}")
    return name


def _layout(name: Any) -> str:
    return strided_layout(name, NotFastReadable)


# torch's dtypes as pickles name them (`torch.float32`): plain values, safe to hand out.
SAFE_DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "complex64", "complex128") if hasattr(torch, name)}
_STORAGES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}

_TENSOR_TYPES = "torch.distributed.tensor._dtensor_spec"
_PLACEMENTS = "torch.distributed.tensor.placement_types"
_TABLE: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch.distributed.tensor", "DTensor"): _DTensorType,
    ("torch.distributed.tensor._api", "DTensor"): _DTensorType,
    (_TENSOR_TYPES, "DTensorSpec"): DTensorSpec,
    (_TENSOR_TYPES, "TensorMeta"): TensorMeta,
    (_TENSOR_TYPES, "ShardOrderEntry"): ShardOrderEntry,
    ("torch.distributed.device_mesh", "DeviceMesh"): DeviceMesh,
    ("torch.distributed._mesh_layout", "_MeshLayout"): _MeshLayout,
    ("torch.distributed._mesh_layout", "_FlatLayout"): _FlatLayout,
    (_PLACEMENTS, "Shard"): Shard,
    (_PLACEMENTS, "_StridedShard"): StridedShard,
    (_PLACEMENTS, "Replicate"): Replicate,
    (_PLACEMENTS, "Partial"): Partial,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): _device,
    ("torch.serialization", "_get_layout"): _layout,
    **{("torch", name): dtype for name, dtype in SAFE_DTYPES.items()},
    **{("torch", name): _StorageType(dtype) for name, dtype in _STORAGES.items()},
}


class _ClosedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storage_of: StorageOf) -> None:
        super().__init__(io.BytesIO(data))
        self._storage_of = storage_of

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _TABLE[(module, name)]
        except (KeyError, TypeError):
            raise NotFastReadable(f"global {module}.{name}") from None

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise NotFastReadable("a persistent id that is not a storage")
        _, storage_type, key, _location, numel = pid
        return _Storage(self._storage_of(str(key), storage_type.dtype, int(numel)), storage_type.dtype)


# (storage key, dtype, element count) -> the storage's bytes; called once per storage reference in the pickle.
StorageOf = Callable[[str, torch.dtype, int], torch.UntypedStorage]


def closed_load(pickled: bytes, storage_of: StorageOf) -> Any:
    """A `torch.save` pickle run through the closed table; `storage_of` supplies each storage's bytes.

    The same storage key asked twice gets `storage_of`'s answer twice: callers that map bytes return
    views of one mapping, so both tensors share them as torch's loader would.
    """
    return _ClosedUnpickler(pickled, storage_of).load()


# --- the file mapping both readers view tensors in (rank files here, `.distcp` chunks in dcp_mapped) -----------

@dataclass(eq=False)
class MappedFile:
    """One file mapped copy-on-write for an export: tensors view its pages (the page cache's), never a copy.

    Copy-on-write (MAP_PRIVATE), as torch's `from_file(shared=False)` maps: a tensor written in place gets
    private pages and the file never changes. Every tensor viewing it holds a buffer export of `buffer`,
    so the mapping lives as long as any of them, whatever happens to the session's cache.
    """

    path: Path
    buffer: mmap.mmap
    size: int
    address: int  # where byte 0 is mapped: torch needs a typed view aligned to its element size

    def aligned(self, offset: int, dtype: torch.dtype) -> bool:
        return (self.address + offset) % storage_nbytes(dtype, 1) == 0


def map_file(path: Path) -> MappedFile:
    """`path` mapped once per export (its session), per file stamp: a rewritten file is mapped anew."""
    cache: StampedCache[MappedFile] = current_session().cache("mapped-files", capacity=_MAPPED_FILES)
    return cache.get_or_load((os.fspath(path), FileStamp.of(path), False), lambda: _map(path))


_MAPPED_FILES = 256  # rank files or .distcp files held mapped per export (an evicted one lives on in its tensors)


def _map(path: Path) -> MappedFile:
    # The mapping keeps its own reference to the file: the descriptor can go.
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            raise NotFastReadable("an empty file")
        buffer = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)
    address = torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()
    return MappedFile(Path(path), buffer, size, address)


def storage_nbytes(dtype: torch.dtype, numel: int) -> int:
    """Bytes of a storage of `numel` elements of `dtype`."""
    return numel * torch.empty((), dtype=dtype).element_size()


def storage_view(mapped: MappedFile, offset: int, nbytes: int) -> torch.UntypedStorage:
    """The storage over bytes [offset, offset + nbytes) of the mapping, without a copy (ValueError outside the file)."""
    if offset < 0 or nbytes < 0 or offset + nbytes > mapped.size:
        raise ValueError(f"bytes {offset:,}-{offset + nbytes:,} lie outside {mapped.path.name} ({mapped.size:,} bytes)")
    if nbytes == 0:  # frombuffer refuses an empty view; an empty storage views nothing
        return torch.UntypedStorage(0)
    return torch.frombuffer(mapped.buffer, dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()


def read_rank_file(path: Path) -> StateDict:
    """The state dict of one rank file, values `ShardedValue` or plain tensors viewing the mmapped file.

    Raises NotFastReadable for anything outside the closed table (the caller then uses torch's loader).
    """
    try:
        return _read(path)
    except (NotFastReadable, CheckpointError):
        raise
    except Exception as exc:  # corrupt or unusual: torch's loader gives the authoritative verdict
        raise NotFastReadable(f"{type(exc).__name__}: {exc}") from None


def _read(path: Path) -> StateDict:
    reader = torch._C.PyTorchFileReader(str(path))
    if reader.has_record("byteorder") and reader.get_record("byteorder") != b"little":
        raise NotFastReadable("a big-endian archive")
    mapped = map_file(path)
    storages: dict[str, tuple[torch.UntypedStorage, torch.dtype]] = {}

    def storage_of(key: str, dtype: torch.dtype, numel: int) -> torch.UntypedStorage:
        found = storages.get(key)
        if found is None:
            nbytes = storage_nbytes(dtype, numel)
            offset = reader.get_record_offset(f"data/{key}")
            if offset + nbytes > mapped.size:
                raise NotFastReadable(f"storage {key} runs past the end of the file")
            if not mapped.aligned(offset, dtype):  # torch.save aligns its records: not its layout
                raise NotFastReadable(f"storage {key} is not aligned for {dtype}")
            found = storages[key] = (storage_view(mapped, offset, nbytes), dtype)
        elif found[1] != dtype:
            raise NotFastReadable(f"storage {key} is read with two dtypes")
        return found[0]

    pickled = reader.get_record("data.pkl")
    _check_pickle_crc(path, pickled)
    state = closed_load(pickled, storage_of)
    if not isinstance(state, dict):
        raise NotFastReadable("not a dict")
    return dict(state)


def _check_pickle_crc(path: Path, pickled: bytes) -> None:
    """The pickle's bytes against the CRC-32 the archive stores for them (torch's reader does not check).

    A flipped byte in the pickle can still unpickle, into another key name or shape; the stored
    CRC tells damage from content. The central directory is read, not the file (milliseconds).
    """
    with zipfile.ZipFile(path) as archive:
        info = next((i for i in archive.infolist() if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")), None)
    if info is None:
        raise NotFastReadable("no data.pkl record in the central directory")
    if zlib.crc32(pickled) != info.CRC:
        raise CheckpointError(f"rank file {path.name} is damaged: record {info.filename} fails its CRC-32 check; "
                              "copy it again from the training run")
