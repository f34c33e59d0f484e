"""Writing an fp8 single file: the safetensors writer, plus the proof of every quantized tensor.

The shard writer builds each float8 weight and its scale one tensor at a time (an `ArchitectureOp`,
mergeflow/architectures/quantization.py). A scale is written first, from the min and max of its weight's
rank pieces. The weight is then quantized once, straight from those pieces in row order where they are
its rows (never assembled or cast whole), in the same pass that dequantizes it and checks every element
against the fp8 bound; the read-back that follows the writer then compares the file's bytes with that
tensor, so the file is not re-read and the weight not quantized again. The weight's pass also finds its
largest value, which proves the scale it used; each written scale is compared, after writing, with that.
The numbers measured (scale, errors, the source's sha256) are kept in `work/quantization-<index>.json`
for the manifest, so a resumed export that reuses a verified file still has them; a reused file whose
records were lost is proven again by `verify_quantized`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from mergeflow.architectures.quantization import (
    OP_SCALE,
    OP_WEIGHT,
    SCALE_SUFFIX,
    quantize_measured,
    quantize_pieces,
    scale_of,
    scale_of_amax,
)
from mergeflow.errors import CastError, CheckpointError
from mergeflow.export.reconstruct.rebuild import PieceSource, bits, cast
from mergeflow.formats.safetensors_format import torch_dtype
from mergeflow.io.jsonfiles import write_json_durable
from mergeflow.records import ArchitectureOp, ShardPlan, ShardRecord, TensorWrite

_LOCK = threading.Lock()
# Keyed by the file's piece source (one per file being written: concurrent exports in one process,
# e.g. a served deployment's, never see each other's tensors) and the tensor's key.
_STATS: dict[tuple[int, str], dict[str, Any]] = {}  # weight key -> its record, measured while verifying
_SCALES: dict[tuple[int, str], torch.Tensor] = {}  # scale key -> the scale its weight's verification recomputed
_PLANNED: dict[tuple[int, str], torch.Tensor] = {}  # weight key -> the scale its scale's write computed (written first)


def _source(spec: ArchitectureOp, states: PieceSource, *, checked: bool = True, name: str = "a tensor to quantize") -> torch.Tensor:
    """The verified source of a quantized tensor, cast to its source dtype.

    checked=False skips the two finiteness scans (of the rank pieces, and of the cast for an overflow):
    `scale_of` then proves the tensor finite in its own pass (an inf or nan makes its min or max one).
    """
    from mergeflow.lora.fusion import read_source

    tensor = read_source(spec.inputs[0], states, verify=True, check_values=checked)
    if tensor is None:
        raise CheckpointError("a quantized tensor names no source")
    dtype = str(spec.params["source_dtype"])
    return cast(tensor, dtype, name) if checked else tensor.to(torch_dtype(dtype))


def is_quantized_weight(tw: TensorWrite) -> bool:
    return isinstance(tw.transform, ArchitectureOp) and tw.transform.op == OP_WEIGHT


def quantized_weight(tw: TensorWrite, states: PieceSource) -> torch.Tensor:
    """The float8 weight to write, quantized from its bit-verified source and proven within the fp8 bound
    in the same pass; its record and scale are kept for the manifest and the scale's check."""
    spec = tw.transform
    assert isinstance(spec, ArchitectureOp)
    with _LOCK:
        planned = _PLANNED.pop((id(states), tw.name), None)
    dtype = torch_dtype(str(spec.params["source_dtype"]))
    pieces = _rows_in_order(spec.inputs[0], states, dtype)
    if pieces is not None and any(p.numel() for p in pieces):
        scale = planned if planned is not None else _scale_of_pieces(tw, spec, states)
        q, stats, amax = quantize_pieces(pieces, dtype, tw.layout.shape, scale, tw.name)
        proven = scale_of_amax(amax)
        if not torch.equal(bits(proven), bits(scale.reshape(()))):
            raise CheckpointError(f"{tw.name}: quantized with scale {float(scale)!r}, but its largest value "
                                  f"{amax!r} gives {float(proven)!r}")
        _keep(tw, states, stats, proven)
        return q
    source = _source(spec, states, checked=False)
    try:
        scale = scale_of(source)  # refuses an inf or nan
    except CheckpointError:
        _source(spec, states, name=tw.name)  # names the cause, as an export without quantization does:
        raise  # the rank holding a broken value, or a cast to the source dtype that overflows
    q, stats = quantize_measured(source, scale, tw.name)
    _keep(tw, states, stats, scale)
    return q


# Weights quantized ahead of the writer, each on a thread of its own (one per core here: see WeightsAhead).
AHEAD = 2


class WeightsAhead:
    """Quantizes a file's next AHEAD float8 weights, each on a thread of its own, while the writer writes the
    one before.

    Writing a weight mostly waits on the disk (the kernel throttles a writer to its writeback), and that
    wait releases the GIL: measured with py-spy at real depth, the writer's thread spent 3.5 s in
    `os.write` and 5.3 s quantizing, one after the other. One weight ahead overlapped them (whole exports,
    same machine, interleaved: 16.1-17.2 s against 17.3-18.0 s quantizing on the writer's thread); two
    ahead keep both cores quantizing while the writer waits (3 rounds at real depth, interleaved: 16.16,
    16.21, 16.43 s at one against 14.33, 15.74, 16.21 s at two). Each holds one more float8 tensor (a byte
    per value) at a time. The blocks' size matters here: see MEASURE_BLOCK. The weights are taken in file
    order; the first is submitted when the writer reaches it, after every scale (float32 comes first in the
    file) has planned its weight's scale.
    """

    def __init__(self, ordered: list[TensorWrite], states: PieceSource,
                 quantize: Callable[[TensorWrite, PieceSource], torch.Tensor]) -> None:
        self._weights = [tw for tw in ordered if is_quantized_weight(tw)]
        self._position = {tw.name: i for i, tw in enumerate(self._weights)}
        self._states, self._quantize = states, quantize
        self._futures: dict[int, Future[torch.Tensor]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def take(self, tw: TensorWrite) -> torch.Tensor:
        """`tw`'s float8 weight (its errors raised here), with the next one started."""
        index = self._position.get(tw.name)
        if index is None or self._weights[index] is not tw:
            return self._quantize(tw, self._states)  # not one of the file's planned weights: in this thread
        future = self._futures.pop(index, None) or self._submit(index)
        for following in range(index + 1, min(index + 1 + AHEAD, len(self._weights))):
            if following not in self._futures:
                self._futures[following] = self._submit(following)
        return future.result()

    def _submit(self, index: int) -> Future[torch.Tensor]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=AHEAD, thread_name_prefix="fp8-ahead")
        return self._pool.submit(self._quantize, self._weights[index], self._states)

    def close(self) -> None:
        """Stop: a weight not started is dropped, one being quantized is waited for (its error is the writer's to
        report, or moot after the writer's own)."""
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _rows_in_order(source: object, states: PieceSource, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Rank pieces whose values, one after another and cast to `dtype`, are the source tensor's in row-major
    order (a tensor in rank order, or an original layout's rows of such tensors); None for any other source,
    which is then read whole."""
    from mergeflow.architectures.registry import adapter_for_op
    from mergeflow.export.reconstruct.rebuild import in_rank_order, verified_chunks
    from mergeflow.records import CheckpointSource, ComputedSource

    if isinstance(source, CheckpointSource):
        if not in_rank_order(source.layout):
            return None
        # Finiteness is left to the scale (computed from these pieces' min and max) and the quantizing pass.
        return verified_chunks(source.layout, states, check_values=False)
    if not isinstance(source, ComputedSource):
        return None
    spec = source.write.transform
    if (not isinstance(spec, ArchitectureOp) or not adapter_for_op(spec.op).concatenates(spec)
            or torch_dtype(source.write.out_dtype) != dtype  # cast once more on the way: read it whole
            or not all(isinstance(s, CheckpointSource) for s in spec.inputs)):
        return None
    parts = [_rows_in_order(s, states, dtype) for s in spec.inputs]
    return None if any(p is None for p in parts) else [c for p in parts if p is not None for c in p]


def _scale_of_pieces(tw: TensorWrite, spec: ArchitectureOp, states: PieceSource) -> torch.Tensor:
    """The weight's scale from its pieces' min and max (its scale's write, before it, found it the same way)."""
    found = _value_range(spec.inputs[0], states)
    if found is None:
        raise CheckpointError(f"{tw.name}: its pieces give no value range")
    return _checked_scale(found, spec, states, tw.name)


def _checked_scale(found: tuple[torch.Tensor, torch.Tensor], spec: ArchitectureOp, states: PieceSource,
                   weight: str) -> torch.Tensor:
    """`scale_of` of a source whose min and max are `found`, refusing an inf, a nan or an overflow as the whole
    path does (the casts it makes, on the two values); a refusal names the rank, from the weight read whole."""
    try:
        return scale_of(cast(torch.stack(found), str(spec.params["source_dtype"]), weight))
    except (CheckpointError, CastError):
        _source(spec, states, name=weight)
        raise


def is_quantized_scale(tw: TensorWrite) -> bool:
    return isinstance(tw.transform, ArchitectureOp) and tw.transform.op == OP_SCALE


def quantized_scale(tw: TensorWrite, states: PieceSource) -> torch.Tensor:
    """A weight's scale to write, from the min and max of its source's rank pieces: no whole copy of the source.

    Scales come first in the file (float32 before float8), so each is computed before its weight; a cast is
    monotonic, so the min and max of the cast tensor are the cast min and max, and `scale_of` of those two
    values is `scale_of` of the cast source. The written scale is compared, after writing, with the one its
    weight's pass computed from the verified source. A source that is not rank pieces moved by value-keeping
    ops (a fused LoRA weight) is computed whole, as before.
    """
    from mergeflow.lora.fusion import transformed_tensor

    spec = tw.transform
    assert isinstance(spec, ArchitectureOp)
    found = _value_range(spec.inputs[0], states)
    if found is None:
        return transformed_tensor(tw, states)
    weight = tw.name.removesuffix(SCALE_SUFFIX) + ".weight"
    scale = _checked_scale(found, spec, states, weight)
    with _LOCK:  # its weight, later in the file, is quantized with it (and proves it from its own values)
        _PLANNED[id(states), weight] = scale
    return scale


# Original-layout ops that only move values: the moved tensor's min and max are its sources'.
_VALUE_KEEPING = ("cat", "swap_halves", "rename")


def _value_range(source: object, states: PieceSource) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(min, max) of a source tensor, in the dtype it is read as, from its pieces; None where that is not known."""
    from mergeflow.architectures.original_layout import ORIGINAL_LAYOUT
    from mergeflow.architectures.registry import adapter_for_op
    from mergeflow.export.reconstruct.rebuild import verified_chunks
    from mergeflow.records import CheckpointSource, ComputedSource

    if isinstance(source, CheckpointSource):
        # Finiteness is left to scale_of: an inf or nan piece makes its min or max inf or nan.
        chunks = [c for c in verified_chunks(source.layout, states, check_values=False) if c.numel()]
        if not chunks:
            return None
        ends = [torch.aminmax(c) for c in chunks]
        return torch.stack([lo for lo, _ in ends]).min(), torch.stack([hi for _, hi in ends]).max()
    if not isinstance(source, ComputedSource):
        return None
    spec = source.write.transform
    if (not isinstance(spec, ArchitectureOp) or spec.op not in _VALUE_KEEPING
            or adapter_for_op(spec.op) is not ORIGINAL_LAYOUT):
        return None
    found = [_value_range(s, states) for s in spec.inputs]
    if not found or any(f is None for f in found) or len({f[0].dtype for f in found if f}) != 1:
        return None
    lows, highs = torch.stack([f[0] for f in found if f]), torch.stack([f[1] for f in found if f])
    # The computed write is cast to its dtype (transformed_tensor), refusing an overflow there.
    low, high = cast(torch.stack([lows.min(), highs.max()]), source.write.out_dtype, source.write.name)
    return low, high


def _keep(tw: TensorWrite, states: PieceSource, stats: dict[str, Any], scale: torch.Tensor) -> None:
    with _LOCK:
        _STATS[id(states), tw.name] = stats
        _SCALES[id(states), tw.name.removesuffix(".weight") + ".weight_scale"] = scale


def verify_quantized(tw: TensorWrite, spec: ArchitectureOp, written: torch.Tensor, states: PieceSource) -> None:
    """The written weight (or scale) is what its verified source gives, and the weight is within the fp8 bound."""
    if spec.op == OP_WEIGHT:
        source = _source(spec, states)
        scale = scale_of(source)
        expected, stats = quantize_measured(source, scale, tw.name)
        if written.dtype != expected.dtype or not torch.equal(bits(expected), bits(written)):
            raise CheckpointError(f"{tw.name}: round trip failed, the written float8 weight differs from its quantized source")
        _keep(tw, states, stats, scale)
        return
    if spec.op != OP_SCALE:
        raise CheckpointError(f"{tw.name}: {spec.op!r} is no quantization op")
    with _LOCK:
        scale = _SCALES.pop((id(states), tw.name), None)  # its weight, verified just before (name order), recomputed it
    if scale is None:
        scale = scale_of(_source(spec, states))
    if written.dtype != torch.float32 or not torch.equal(bits(scale.reshape(written.shape)), bits(written)):
        raise CheckpointError(f"{tw.name}: round trip failed, the written scale differs from its source's amax / 448")


def _quantized(shard: ShardPlan) -> list[TensorWrite]:
    return [t for t in shard.tensors if is_quantized_weight(t)]


def stats_path(work_dir: Path, index: int) -> Path:
    return work_dir / f"quantization-{index:05d}.json"


def write_measured_file(shard: ShardPlan, states: PieceSource, tensor_dir: Path, work_dir: Path) -> ShardRecord:
    """Write (or reuse) one safetensors file; with quantized tensors, keep their measured records in work/."""
    from mergeflow.export.write.shard_writer import open_tensors, write_shard_file

    names = [t.name for t in _quantized(shard)]
    key = id(states)
    with _LOCK:
        for name in names:
            _STATS.pop((key, name), None)
    try:
        record = write_shard_file(shard, states, tensor_dir, work_dir)
    finally:
        with _LOCK:  # scales planned for weights a failed (or reused) file never quantized
            for name in names:
                _PLANNED.pop((key, name), None)
    if not names:
        return record
    with _LOCK:
        found = {name: _STATS.pop((key, name)) for name in names if (key, name) in _STATS}
    if len(found) != len(names):
        # The file was reused from an earlier attempt (a resume): its records were kept then, or
        # (killed in between) its tensors are proven and measured again here.
        if load_stats(work_dir, shard) is not None:
            return record
        tensors = open_tensors(tensor_dir / shard.file_name, _written_metadata(shard, record))
        for tw in _quantized(shard):
            verify_quantized(tw, tw.transform, tensors[tw.name], states)  # type: ignore[arg-type]
        with _LOCK:
            found = {name: _STATS.pop((key, name)) for name in names}
            for name in names:
                _SCALES.pop((key, name.removesuffix(".weight") + ".weight_scale"), None)
    write_json_durable(stats_path(work_dir, shard.index),
                       {"fingerprint": shard.fingerprint, "tensors": dict(sorted(found.items()))})
    return record


def load_stats(work_dir: Path, shard: ShardPlan) -> dict[str, Any] | None:
    """The records measured when this shard (this plan's, by fingerprint) was written; None if absent or stale."""
    tensors = read_stats(stats_path(work_dir, shard.index), shard.fingerprint)
    if tensors is None or set(tensors) != {t.name for t in _quantized(shard)}:
        return None
    return tensors


def read_stats(path: Path, fingerprint: str | None = None) -> dict[str, Any] | None:
    """One kept records file's tensors (None: absent, unreadable, or another plan's)."""
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, Mapping) or (fingerprint is not None and data.get("fingerprint") != fingerprint):
        return None
    tensors = data.get("tensors")
    return tensors if isinstance(tensors, dict) else None


def _written_metadata(shard: ShardPlan, record: ShardRecord) -> dict[str, str] | None:
    """The header metadata as the writer finished it: the plan's, with the data hash it filled in."""
    from mergeflow.formats.safetensors_format import DATA_HASH_KEY

    if shard.metadata is None or DATA_HASH_KEY not in shard.metadata or record.data_sha256 is None:
        return shard.metadata
    return {**shard.metadata, DATA_HASH_KEY: record.data_sha256}
