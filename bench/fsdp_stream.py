"""FSDP2 rank files streamed to disk: `torch.save(fully_shard(model).state_dict())`, byte for byte,
without the model.

The pickle comes from torch's own `torch.serialization._save` over a dict of real DTensors on
a fake process group, whose local tensors are untouched `torch.empty` views (virtual memory
only, padded to the full `torch.chunk` like FSDP2's). Only the storage records are
intercepted: each is generated just before it is written, so at most one local shard
exists in memory.

Values come from one seeded random pool (`WeightSource`): element i of tensor `key` (flat,
global index) is `pool[(offset(key) + i) % len(pool)]`. Generating 12 B random bf16 values
would cost minutes of CPU on two cores; copying pool slices costs about a memcpy. Every
value is a finite N(0, 0.02) sample; different tensors start at different pool offsets.

Tensor data is deterministic (seed, key, rank); data.pkl is not quite: DeviceMesh and
DTensorSpec pickle their cached `hash()`, which depends on per-process hash salts and object
addresses, so two generations differ there (and in sha256), exactly as two real saves do.
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import pickle
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# 2**24 + 1 elements (32 MiB in bf16): larger than any local shard of FLUX at W=8 (7.1 M
# elements), so a shard wraps around the pool at most once; odd, so that tensors of
# power-of-two sizes do not line up on the same pool positions.
POOL_ELEMENTS = (1 << 24) + 1
SCALE = 0.02


@dataclass(frozen=True)
class TensorSpec:
    """One state-dict entry of the model: what every rank file and the base describe."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class RankSlice:
    """Rank `rank`'s piece of a dim-0 `torch.chunk`, as FSDP2 stores it."""

    chunk_rows: int  # ceil(n / W): every rank's storage holds this many rows (padded)
    start_row: int
    rows: int  # 0 .. chunk_rows: trailing ranks may be short or empty
    row_numel: int

    @property
    def storage_numel(self) -> int:
        return self.chunk_rows * self.row_numel


def rank_slice(shape: tuple[int, ...], world_size: int, rank: int) -> RankSlice:
    """torch.chunk arithmetic on dim 0 (chunk = ceil(n / W))."""
    n = shape[0]
    chunk = -(-n // world_size)
    start = min(rank * chunk, n)
    return RankSlice(chunk, start, min(chunk, n - start), math.prod(shape[1:]))


class WeightSource:
    """Deterministic tensor values from one seeded pool: the generator's and the tests' truth."""

    def __init__(self, seed: int, dtype: torch.dtype, pool_elements: int = POOL_ELEMENTS) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"only floating dtypes can be generated, got {dtype}")
        generator = torch.Generator().manual_seed(seed)
        # Drawn in float32 and cast once: bf16 randn is not reproducible across CPU kernels.
        self.pool = (torch.randn(pool_elements, generator=generator) * SCALE).to(dtype)
        self.seed = seed
        self.dtype = dtype

    def offset(self, name: str) -> int:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        return int.from_bytes(digest[:8], "little") % self.pool.numel()

    def fill(self, name: str, start: int, out: torch.Tensor) -> None:
        """Write elements [start, start + out.numel()) of tensor `name` (flat) into `out` (1-D)."""
        size = self.pool.numel()
        pos = (self.offset(name) + start) % size
        done, count = 0, out.numel()
        while done < count:
            n = min(count - done, size - pos)
            out[done:done + n].copy_(self.pool[pos:pos + n])
            done += n
            pos = 0

    def full(self, spec: TensorSpec) -> torch.Tensor:
        """The whole global tensor (for small models: tests and real fully_shard comparisons)."""
        out = torch.empty(spec.numel, dtype=self.dtype)
        self.fill(spec.name, 0, out)
        return out.view(spec.shape)

    def local(self, spec: TensorSpec, world_size: int, rank: int) -> torch.Tensor:
        """Exactly the local shard (`to_local()`) that rank `rank`'s file holds for `spec`."""
        piece = rank_slice(spec.shape, world_size, rank)
        out = torch.empty(piece.rows * piece.row_numel, dtype=self.dtype)
        self.fill(spec.name, piece.start_row * piece.row_numel, out)
        return out.view((piece.rows, *spec.shape[1:]))





class _GeneratingZipWriter:
    """Stands in for the PyTorchFileWriter that torch.serialization._save writes into.

    Records other than our stand-in storages (data.pkl, version markers, the mesh's rank-map
    tensor) go through unchanged; a stand-in storage's record is generated into a reusable
    buffer and written from there, so its own (virtual) pages are never touched.
    """

    def __init__(self, writer: torch._C.PyTorchFileWriter,
                 plan: dict[int, tuple[TensorSpec, RankSlice]], source: WeightSource) -> None:
        self._writer = writer
        self._plan = plan
        self._source = source
        self._buffer = torch.empty(0, dtype=source.dtype)
        self.generated = 0

    def write_record(self, name: str, data: Any, size: int) -> None:
        if isinstance(data, torch.UntypedStorage) and data.data_ptr() in self._plan:
            spec, piece = self._plan[data.data_ptr()]
            if size != piece.storage_numel * spec.dtype.itemsize:
                raise AssertionError(f"{spec.name}: record size {size} != planned storage")
            if self._buffer.numel() < piece.storage_numel:
                self._buffer = torch.empty(piece.storage_numel, dtype=self._source.dtype)
            filled = piece.rows * piece.row_numel
            self._source.fill(spec.name, piece.start_row * piece.row_numel, self._buffer[:filled])
            # FSDP2 pads a short rank's storage with zeros (new_zeros, then copy of its rows).
            self._buffer[filled:piece.storage_numel].zero_()
            self._writer.write_record(name, self._buffer.untyped_storage(), size)
            self.generated += size
        else:
            self._writer.write_record(name, data, size)

    def write_record_metadata(self, name: str, size: int) -> None:  # only under skip_data
        raise AssertionError("skip_data is not used by the generator")


def write_rank_file(path: Path, template: OrderedDict[str, Any], specs: list[TensorSpec],
                    world_size: int, rank: int, source: WeightSource) -> int:
    """Write one rank file as `torch.save(fully_shard(model).state_dict())` would. Needs an
    initialised (fake) process group in which this process is `rank` of `world_size`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.serialization import (
        DEFAULT_PROTOCOL,
        _get_storage_alignment,
        _save,
        get_crc32_options,
    )

    # DTensor's sharding-propagation cache outlives process groups, and DeviceMesh equality
    # ignores the rank: without clearing it, rank R's detached specs would be rank 0's cached
    # ones, carrying rank 0's mesh. Training saves each rank in its own process: a cold cache.
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    state: OrderedDict[str, Any] = OrderedDict()
    # module.state_dict() attaches per-module versions; torch.save pickles them too.
    state._metadata = template._metadata  # type: ignore[attr-defined]
    plan: dict[int, tuple[TensorSpec, RankSlice]] = {}
    for spec in specs:
        piece = rank_slice(spec.shape, world_size, rank)
        # Like FSDP2: a padded storage of chunk rows, the local tensor its first `rows` rows.
        storage = torch.empty(piece.storage_numel, dtype=spec.dtype)
        local = storage[: piece.rows * piece.row_numel].view((piece.rows, *spec.shape[1:]))
        plan[local.untyped_storage().data_ptr()] = (spec, piece)
        param = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False,
            shape=torch.Size(spec.shape), stride=_contiguous_stride(spec.shape),
        )
        # module.state_dict() stores `param.detach()`. DTensor's dispatch returns one cached
        # output spec object per distinct spec, which the pickle then memoises: detach the
        # same way. Specs and meshes cache their hash in `_hash`, which pickles with them;
        # FSDP2 has hashed the output spec too by the time training saves (the values are
        # per process: str hashing is salted).
        value = param.detach()
        hash(value._spec)
        state[spec.name] = value
    name = os.fspath(path)
    name.encode("ascii")  # PyTorchFileWriter (by name) only takes ASCII paths, as in torch.save
    writer = torch._C.PyTorchFileWriter(name, get_crc32_options(), _get_storage_alignment())
    proxy = _GeneratingZipWriter(writer, plan, source)
    _save(state, proxy, pickle, DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    del writer, proxy, state, plan
    return path.stat().st_size


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def write_rank_files(actor_dir: Path, template: OrderedDict[str, Any], specs: list[TensorSpec],
                     world_size: int, source: WeightSource,
                     progress: Callable[[int, Path, float], None] | None = None) -> list[Path]:
    """Every rank's model file, each under its own fake process group (as training has one)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import (
        FakeStore,  # registers "fake"
    )

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; the generator needs its own fake one")
    # Written under a scratch name's directory and renamed: a killed run leaves no rank file
    # that looks complete. The file name itself must stay final: torch's archive prefix is it.
    scratch = actor_dir / ".partial"
    scratch.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    caller_excepthook = sys.excepthook  # init_process_group wraps it and never unwraps
    try:
        for rank in range(world_size):
            t0 = time.perf_counter()
            name = f"model_world_size_{world_size}_rank_{rank}.pt"
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            try:
                write_rank_file(scratch / name, template, specs, world_size, rank, source)
            finally:
                dist.destroy_process_group()
                gc.collect()  # drop this rank's (virtual) stand-ins before the next rank's
                _return_free_heap()
            os.replace(scratch / name, actor_dir / name)
            files.append(actor_dir / name)
            if progress is not None:
                progress(rank, actor_dir / name, time.perf_counter() - t0)
    finally:
        sys.excepthook = caller_excepthook
    scratch.rmdir()
    return files


def _return_free_heap() -> None:
    """Hand freed heap pages back to the kernel (glibc only; elsewhere a no-op).

    A rank's ~1,200 stand-in allocations and its record buffer come and go; glibc keeps the
    freed pages, so private memory would creep up by tens of MiB per rank instead of
    staying flat.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
