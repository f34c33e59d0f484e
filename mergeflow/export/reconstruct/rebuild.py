"""Reassembling global tensors from rank shards, and proving each one bit-exact."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Iterator

import numpy as np
import torch

from mergeflow.architectures.schema import is_kept_in_fp32
from mergeflow.errors import CastError, CheckpointError, SchemaMismatchError
from mergeflow.formats.safetensors_format import torch_dtype
from mergeflow.records import MergePlan, TensorLayout, TensorWrite
from mergeflow.sources.base import (
    PieceSource,  # the piece reader: verl's RankStates, a DCP's chunks
)

FLOATING = {"float64", "float32", "float16", "bfloat16"}
_CHECK_ELEMENTS = 1 << 24  # finiteness is checked in slices so no full-size temporary exists
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """An integer view with the same element size: equality on it is bit equality."""
    return tensor.view(_BITS[tensor.element_size()])


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_LIBC.memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_LIBC.memcmp.restype = ctypes.c_int


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality of two contiguous CPU tensors.

    memcmp is ~5x faster than torch.equal on uint8 and, called through ctypes, runs without
    the GIL, so the read-back comparison overlaps the other threads of an export.
    """
    if not (a.is_contiguous() and b.is_contiguous()) or a.device.type != "cpu" or b.device.type != "cpu":
        raise ValueError("same_bytes needs contiguous CPU tensors")
    n = a.numel() * a.element_size()
    if n != b.numel() * b.element_size():
        return False
    return n == 0 or _LIBC.memcmp(a.data_ptr(), b.data_ptr(), n) == 0


# Non-finite <=> all exponent bits set. Checking that on an integer view is several times
# faster than torch.isfinite (which widens bf16/fp16 first) and needs one bounded buffer.
# numpy rather than torch for the scan: it runs in the calling thread without the GIL, while
# torch's OpenMP workers spin between the many short calls of a streaming export and take
# the core that the writer's sha256 thread needs (measured: ~30% slower shard writes).
_EXPONENT_MASKS = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
    torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
}


def all_finite(tensor: torch.Tensor) -> bool:
    """True if a floating tensor holds no inf/nan; scans in bounded slices."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    flat = tensor.reshape(-1)
    spec = _EXPONENT_MASKS.get(tensor.dtype)
    if spec is None:
        return all(bool(torch.isfinite(flat[s : s + _CHECK_ELEMENTS]).all()) for s in range(0, flat.numel(), _CHECK_ELEMENTS))
    int_dtype, magnitude, exponent = spec
    ints = flat.detach().view(int_dtype).numpy()
    step = _SCAN_BYTES // ints.itemsize
    buffer = _scan_buffer().view(ints.dtype)
    for start in range(0, ints.size, step):
        piece = ints[start : start + step]
        out = buffer[: piece.size]
        np.bitwise_and(piece, magnitude, out=out)
        if int(out.max()) >= exponent:
            return False
    return True


# The scan's slices: L2-sized, through one buffer per thread that lives as long as the thread. A buffer
# allocated per call (16 MiB per read-back block before) is a fresh mapping above glibc's mmap threshold
# (io/heap.py), faulted in and zeroed each time: perf put 92% of a real-depth single-file export's page
# faults in numpy's bitwise_and, one per 4 KiB of the model; with this buffer its minor faults went from
# 1.28 M to 0.11 M and its system time from ~9 s to ~7 s.
_SCAN_BYTES = 1 << 20
_SCAN = threading.local()


def _scan_buffer() -> np.ndarray:
    buffer: np.ndarray | None = getattr(_SCAN, "buffer", None)
    if buffer is None:
        buffer = _SCAN.buffer = np.empty(_SCAN_BYTES, dtype=np.uint8)
    return buffer


def check_finite(tensor: torch.Tensor, what: str) -> None:
    """Refuse inf/nan in a floating tensor."""
    if not all_finite(tensor):
        raise CheckpointError(f"{what} holds inf or nan values; refusing to export a broken weight")


def output_dtype(key: str, dtype: str, policy: str, keep_fp32: tuple[str, ...]) -> str:
    """The dtype policy: casts touch floating tensors only; _keep_in_fp32_modules stay float32."""
    if policy == "preserve" or dtype not in FLOATING:
        return dtype
    return "float32" if is_kept_in_fp32(key, keep_fp32) else policy


def cast(tensor: torch.Tensor, dtype: str, what: str) -> torch.Tensor:
    """Cast, refusing a cast that turns finite values into inf/nan (overflow)."""
    target = torch_dtype(dtype)
    if tensor.dtype == target:
        return tensor
    out = tensor.to(target)
    if not all_finite(out):
        # A cast keeps inf/nan, so a finite output proves a finite source; only a failure
        # needs the source scanned, to tell a broken weight from an overflow.
        if not all_finite(tensor):
            raise CheckpointError(f"{what} holds inf or nan values; refusing to export a broken weight")
        raise CastError(f"casting {what} to {dtype} overflows (values beyond the {dtype} range); use a wider --dtype")
    return out


def primary_chunks(layout: TensorLayout, states: PieceSource, *, in_place: bool = False) -> list[torch.Tensor]:
    """The local tensor of every chunk as read from its first rank (no checks).

    in_place: for byte-level use only (PieceSource.local_in_place), never read by a torch kernel as its dtype.
    """
    local = states.local_in_place if in_place else states.local
    return [local(ranks[0], layout.key) for ranks in layout.chunk_ranks]


def verified_chunks(layout: TensorLayout, states: PieceSource, *, check_values: bool = True,
                    in_place: bool = False) -> list[torch.Tensor]:
    """The primary local tensor of every chunk, after checking replicas, dtype and finiteness.

    check_values=False leaves the finiteness scan to the caller, which for streamed tensors
    folds it into the read-back pass so the bytes are scanned once. in_place: as `primary_chunks`
    (replicas are then compared byte for byte).
    """
    local = states.local_in_place if in_place else states.local
    chunks = []
    for chunk_index, ranks in enumerate(layout.chunk_ranks):
        primary = local(ranks[0], layout.key)
        if tuple(primary.shape) != layout.chunk_shapes[chunk_index]:
            raise CheckpointError(f"{layout.key}: rank {ranks[0]} shard changed shape since it was indexed")
        if str(primary.dtype).removeprefix("torch.") != layout.dtype:
            raise CheckpointError(f"{layout.key}: rank {ranks[0]} shard has dtype {primary.dtype}, expected {layout.dtype}")
        if check_values:
            check_finite(primary, f"{layout.key} (rank {ranks[0]})")
        for replica in ranks[1:]:
            other = local(replica, layout.key)
            if other.shape != primary.shape or other.dtype != primary.dtype or not _same_values(other, primary, in_place):
                raise CheckpointError(
                    f"{layout.key}: rank {replica} and rank {ranks[0]} should hold identical replicas but differ"
                )
        chunks.append(primary)
    return chunks


def _same_values(a: torch.Tensor, b: torch.Tensor, in_place: bool) -> bool:
    # Pieces read in place may sit at odd addresses: compared as bytes (memcmp), never by a typed kernel.
    # (A piece read in place is contiguous; a strided one came from an aligned source.)
    if in_place and a.is_contiguous() and b.is_contiguous():
        return same_bytes(a, b)
    return torch.equal(bits(a), bits(b))


def in_rank_order(layout: TensorLayout) -> bool:
    """True when the global tensor's bytes are the rank-local tensors' bytes in rank order (no concat)."""
    return layout.shard_dim is None or all(s == 1 for s in layout.shape[: layout.shard_dim])


def is_streamed(layout: TensorLayout, out_dtype: str) -> bool:
    """True when the output bytes are exactly the rank-local bytes in rank order (no cast, no concat)."""
    return out_dtype == layout.dtype and in_rank_order(layout)


def is_cast_in_rank_order(layout: TensorLayout, out_dtype: str) -> bool:
    """True when the output is the rank-local tensors in rank order, each cast on its own."""
    return out_dtype != layout.dtype and in_rank_order(layout)


def global_pieces(layout: TensorLayout, chunks: list[torch.Tensor], out_dtype: str, name: str) -> Iterator[torch.Tensor]:
    """Contiguous tensors whose bytes, concatenated, are the global tensor in `out_dtype`.

    For Shard(0) (and replicated tensors) these are the rank-local tensors themselves, so
    no global copy is ever built; other shard dims are concatenated (bounded by one tensor).
    """
    if layout.shard_dim is None:
        yield cast(chunks[0], out_dtype, name).contiguous()
        return
    if all(s == 1 for s in layout.shape[: layout.shard_dim]):
        for piece in chunks:
            if piece.numel():
                yield cast(piece, out_dtype, name).contiguous()
        return
    yield cast(torch.cat(chunks, dim=layout.shard_dim), out_dtype, name).contiguous()


def verify_round_trip(layout: TensorLayout, written: torch.Tensor, chunks: list[torch.Tensor], out_dtype: str, name: str) -> None:
    """Re-slice the written tensor like torch.chunk did and compare every shard bit for bit."""
    if tuple(written.shape) != layout.shape:
        raise CheckpointError(f"{name}: written shape {list(written.shape)} differs from {list(layout.shape)}")
    if layout.shard_dim is None:
        pieces = [written]
    else:
        sizes = [s[layout.shard_dim] for s in layout.chunk_shapes]
        pieces = list(torch.split(written, sizes, dim=layout.shard_dim))
    for index, (piece, local) in enumerate(zip(pieces, chunks)):
        expected = cast(local, out_dtype, name)
        if piece.shape != expected.shape or not torch.equal(bits(piece), bits(expected)):
            raise CheckpointError(f"{name}: round trip failed, chunk {index} of the written tensor differs from its rank shard")


def strip_wrappers(key: str) -> str:
    """State-dict key without FSDP1 wrapper segments."""
    return key.replace("_fsdp_wrapped_module.", "")


def plan_tensor_writes(plan: MergePlan, layouts: dict[str, TensorLayout]) -> list[TensorWrite]:
    """One write per checkpoint tensor (`layouts`: see mergeflow.export.reconstruct.layout.rank_layouts), checked
    against the base schema: exact coverage and shapes."""
    by_name: dict[str, TensorLayout] = {}
    for key, layout in layouts.items():
        name = strip_wrappers(key)
        if name in by_name:
            raise CheckpointError(f"keys {by_name[name].key} and {key} name the same tensor after removing FSDP wrappers")
        by_name[name] = layout
    check_coverage(plan.output.expected_shapes, {n: l.shape for n, l in by_name.items()})
    policy = plan.options.dtype
    return [
        TensorWrite(name, layout.key, layout, output_dtype(name, layout.dtype, policy, plan.output.keep_fp32))
        for name, layout in sorted(by_name.items())
    ]


def check_coverage(expected: dict[str, tuple[int, ...]], actual: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint must hold exactly the base's tensors, with the same shapes."""
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    if missing:
        raise SchemaMismatchError(
            f"the checkpoint lacks {len(missing)} tensor(s) the base model has (e.g. {', '.join(missing[:3])}); "
            "missing weights are never filled from the base"
        )
    if extra:
        raise SchemaMismatchError(f"the checkpoint has {len(extra)} tensor(s) the base model does not (e.g. {', '.join(extra[:3])})")
    for name in sorted(expected):
        if tuple(expected[name]) != tuple(actual[name]):
            raise SchemaMismatchError(f"{name} has shape {list(actual[name])} in the checkpoint but {list(expected[name])} in the base")
