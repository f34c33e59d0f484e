"""The shard writer's own proofs: read-back while writing, header and size, the digest it records,
and the validation that takes that digest instead of hashing the file again."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from mergeflow.demo.checkpoints import save_fsdp_checkpoint
from mergeflow.errors import (
    ArtifactInvalidError,
    CastError,
    CheckpointError,
    InputChangedError,
)
from mergeflow.export.check import artifact_check
from mergeflow.export.reconstruct.layout import plan_layouts
from mergeflow.export.reconstruct.rebuild import same_bytes
from mergeflow.export.write import shard_writer as write
from mergeflow.io import ranges as ranges_module
from mergeflow.io.fs import FileStamp
from mergeflow.io.streamio import BackgroundFlush, HashingWriter
from mergeflow.records import ShardPlan, TensorWrite, VerifiedFile
from mergeflow.sources.verl_ranks import RankStates, hash_rank_file, index_rank_file

WORLD = 3


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = nn.Parameter(torch.randn(7, 5, generator=g))
        self.b = nn.Parameter(torch.randn(4, 3, generator=g).to(torch.bfloat16))
        self.c = nn.Parameter(torch.randn(5, generator=g))


@pytest.fixture()
def shard_setup(tmp_path: Path) -> tuple[ShardPlan, RankStates, Path]:
    actor = save_fsdp_checkpoint(Small(), tmp_path / "actor", WORLD)
    names = tuple(f"model_world_size_{WORLD}_rank_{r}.pt" for r in range(WORLD))
    layouts = plan_layouts([index_rank_file(actor, n, r).entries for r, n in enumerate(names)])
    writes = [TensorWrite(k, k, layout, layout.dtype) for k, layout in layouts.items()]
    shard = write.pack_shards(writes, 1 << 30, "diffusion_pytorch_model.safetensors", "fp").shards[0]
    out = tmp_path / "out"
    (out / "work").mkdir(parents=True)
    return shard, RankStates(actor, names), out


def test_recorded_digest_and_stamp_are_those_of_the_file(shard_setup) -> None:  # type: ignore[no-untyped-def]
    shard, states, out = shard_setup
    record = write.write_shard_file(shard, states, out, out / "work")
    path = out / record.file_name
    assert record.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert record.verified_stamp == FileStamp.of(path)
    assert record.verified() == VerifiedFile(record.sha256, FileStamp.of(path))


def test_ranges_are_those_of_the_file_as_written_and_as_reused(shard_setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Per-range digests come from the write itself, and a resumed shard (its record reused) gets the same."""
    shard, states, out = shard_setup
    monkeypatch.setattr(ranges_module, "RANGE_SIZE", 64)  # this tiny file's ranges: a few dozen bytes each
    record = write.write_shard_file(shard, states, out, out / "work")
    path = out / record.file_name
    raw = path.read_bytes()
    assert record.ranges is not None and record.ranges.size == len(raw) and record.ranges.range_size == 64
    assert list(record.ranges.sha256) == [hashlib.sha256(raw[i : i + 64]).hexdigest() for i in range(0, len(raw), 64)]
    again = write.write_shard_file(shard, states, out, out / "work")  # a rerun finds the verified file and its record
    assert FileStamp.of(path) == record.verified_stamp  # reused, not rewritten
    assert again.ranges == record.ranges and again.sha256 == record.sha256
    monkeypatch.setattr(ranges_module, "RANGE_SIZE", len(raw))  # one range: the file keeps its whole digest alone
    assert write.write_shard_file(shard, states, out, out / "work").ranges is None


def test_a_writer_that_writes_wrong_bytes_is_caught_by_the_read_back(shard_setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    shard, states, out = shard_setup
    real = write._as_bytes

    def flip_one_byte(tensor: torch.Tensor) -> memoryview:
        data = bytearray(real(tensor))
        if tensor.dtype == torch.bfloat16:
            data[-1] ^= 0x01
        return memoryview(data)

    monkeypatch.setattr(write, "_as_bytes", flip_one_byte)
    with pytest.raises(CheckpointError, match="round trip failed"):
        write.write_shard_file(shard, states, out, out / "work")
    assert not (out / shard.file_name).exists()


def test_a_damaged_header_is_caught(shard_setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    shard, states, out = shard_setup
    real = write._stream_shard

    def then_damage_header(fd: int, header: bytes, *args: object, **kwargs: object) -> str:
        digest = real(fd, header, *args, **kwargs)  # type: ignore[arg-type]
        os.pwrite(fd, b"!", len(header) - 1)  # the header's trailing padding: still parses
        return digest

    monkeypatch.setattr(write, "_stream_shard", then_damage_header)
    with pytest.raises(CheckpointError, match="header read back differs"):
        write.write_shard_file(shard, states, out, out / "work")
    assert not (out / shard.file_name).exists()


def test_trailing_bytes_are_caught(shard_setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    shard, states, out = shard_setup
    real = write._stream_shard

    def then_append(fd: int, *args: object, **kwargs: object) -> str:
        digest = real(fd, *args, **kwargs)  # type: ignore[arg-type]
        os.write(fd, b"\0")
        return digest

    monkeypatch.setattr(write, "_stream_shard", then_append)
    with pytest.raises(CheckpointError, match="bytes, expected"):
        write.write_shard_file(shard, states, out, out / "work")


def test_same_bytes() -> None:
    a = torch.arange(1000, dtype=torch.int16)
    b = a.clone()
    assert same_bytes(a.view(torch.uint8), b.view(torch.uint8))
    b[-1] += 1
    assert not same_bytes(a.view(torch.uint8), b.view(torch.uint8))
    assert not same_bytes(a[:10].view(torch.uint8), a[:11].view(torch.uint8))
    assert same_bytes(a[:0].view(torch.uint8), b[:0].view(torch.uint8))
    with pytest.raises(ValueError):
        same_bytes(a.view(10, 100).t(), b.view(10, 100).t())


def test_hashing_writer_with_background_flush(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    flush = BackgroundFlush(fd, step=1024 * 1024)
    try:
        writer = HashingWriter(fd, flush=flush)
        for start in range(0, len(data), 700_000):
            writer.write(memoryview(data)[start : start + 700_000])
        digest = writer.hexdigest()
        flush.fsync()
        flush.check()
    finally:
        flush.join()
        os.close(fd)
    assert path.read_bytes() == data and digest == hashlib.sha256(data).hexdigest()


def test_a_failed_fsync_is_reported() -> None:
    read_end, write_end = os.pipe()
    try:
        flush = BackgroundFlush(write_end)
        flush.fsync()
        with pytest.raises(OSError):  # fsync on a pipe: EINVAL, raised in the writer's thread
            flush.check()
    finally:
        os.close(read_end)
        os.close(write_end)


def _tree(root: Path) -> dict[str, str]:
    (root / "big.bin").write_bytes(os.urandom(1 << 20))
    (root / "small.json").write_text("{}")
    return {n: hashlib.sha256((root / n).read_bytes()).hexdigest() for n in ("big.bin", "small.json")}


def test_validation_takes_a_verified_digest_only_while_the_file_is_unchanged(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    files = _tree(tmp_path)
    verified = {"big.bin": VerifiedFile(files["big.bin"], FileStamp.of(tmp_path / "big.bin"))}
    hashed: list[str] = []
    real = artifact_check.sha256_file
    monkeypatch.setattr(artifact_check, "sha256_file", lambda p: hashed.append(p.name) or real(p))

    artifact_check.check_tree_and_hashes(tmp_path, files, verified=verified)
    assert hashed == ["small.json"]  # the proven file was not read again

    # Same size, same mtime, one byte changed: ctime moves, so the digest is not trusted.
    big = tmp_path / "big.bin"
    st = big.stat()
    with open(big, "r+b") as fh:
        fh.seek(1000)
        byte = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    hashed.clear()
    with pytest.raises(ArtifactInvalidError, match="big.bin does not match"):
        artifact_check.check_tree_and_hashes(tmp_path, files, verified=verified)
    assert "big.bin" in hashed


def test_a_verified_digest_that_disagrees_with_the_manifest_fails(tmp_path: Path) -> None:
    files = _tree(tmp_path)
    verified = {"big.bin": VerifiedFile("0" * 64, FileStamp.of(tmp_path / "big.bin"))}
    with pytest.raises(ArtifactInvalidError, match="big.bin does not match"):
        artifact_check.check_tree_and_hashes(tmp_path, files, verified=verified)


def test_rank_hash_refuses_a_file_that_is_not_the_planned_one(tmp_path: Path) -> None:
    actor = save_fsdp_checkpoint(Small(), tmp_path / "actor", 1)
    name = "model_world_size_1_rank_0.pt"
    planned = FileStamp.of(actor / name)
    assert hash_rank_file(actor, name, planned) == hashlib.sha256((actor / name).read_bytes()).hexdigest()
    os.utime(actor / name, ns=(1, 1))
    with pytest.raises(InputChangedError, match="changed during the export"):
        hash_rank_file(actor, name, planned)


def test_finite_scan_takes_parameters_and_scalars() -> None:
    from mergeflow.export.reconstruct.rebuild import all_finite

    assert all_finite(nn.Parameter(torch.randn(10)))
    assert not all_finite(nn.Parameter(torch.tensor([1.0, float("inf")])))
    assert all_finite(torch.tensor(3.0, dtype=torch.bfloat16))
    assert not all_finite(torch.tensor(float("nan"), dtype=torch.float16))


def _cast_shard(shard: ShardPlan, dtype: str) -> ShardPlan:
    """The same shard with every float32 tensor cast to `dtype` on the way out."""
    tensors = tuple(TensorWrite(t.name, t.source_key, t.layout, dtype if t.layout.dtype == "float32" else t.out_dtype)
                    for t in shard.tensors)
    return write.pack_shards(list(tensors), 1 << 30, "diffusion_pytorch_model.safetensors", "fp-cast").shards[0]


def test_cast_tensors_are_read_back_while_writing(shard_setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    shard, states, out = shard_setup
    cast_shard = _cast_shard(shard, "float16")
    assert all(write.read_back_while_writing(t) for t in cast_shard.tensors)
    record = write.write_shard_file(cast_shard, states, out, out / "work")
    written = write.open_tensors(out / record.file_name)
    for tw in cast_shard.tensors:  # what the follower proved, checked here the slow, independent way
        source = torch.cat([states.local(r[0], tw.source_key) for r in tw.layout.chunk_ranks])
        assert torch.equal(written[tw.name], source.to(written[tw.name].dtype))

    (out / record.file_name).unlink()
    (out / "work" / "shard-00000.json").unlink()
    real = write._as_bytes

    def flip_in_cast_output(tensor: torch.Tensor) -> memoryview:
        data = bytearray(real(tensor))
        if tensor.dtype == torch.float16:
            data[0] ^= 0x01
        return memoryview(data)

    monkeypatch.setattr(write, "_as_bytes", flip_in_cast_output)
    with pytest.raises(CheckpointError, match="round trip failed, cast piece"):
        write.write_shard_file(cast_shard, states, out, out / "work")
    assert not (out / cast_shard.file_name).exists()


@pytest.mark.parametrize("value,message", [(float("nan"), "inf or nan"), (7e4, "overflows")])
def test_a_cast_tells_a_broken_weight_from_an_overflow(tmp_path: Path, value: float, message: str) -> None:
    model = Small()
    with torch.no_grad():
        model.a[3, 2] = value
    actor = save_fsdp_checkpoint(model, tmp_path / "actor", WORLD)
    names = tuple(f"model_world_size_{WORLD}_rank_{r}.pt" for r in range(WORLD))
    layouts = plan_layouts([index_rank_file(actor, n, r).entries for r, n in enumerate(names)])
    writes = [TensorWrite(k, k, layout, "float16" if layout.dtype == "float32" else layout.dtype) for k, layout in layouts.items()]
    shard = write.pack_shards(writes, 1 << 30, "diffusion_pytorch_model.safetensors", "fp").shards[0]
    out = tmp_path / "out"
    (out / "work").mkdir(parents=True)
    with pytest.raises(CheckpointError if message == "inf or nan" else CastError, match=message):
        write.write_shard_file(shard, RankStates(actor, names), out, out / "work")


def _hashed_header_shard(shard: ShardPlan) -> ShardPlan:
    import dataclasses

    from mergeflow.formats.safetensors_format import (
        DATA_HASH_KEY,
        DATA_HASH_PLACEHOLDER,
    )

    return dataclasses.replace(shard, metadata={"format": "pt", DATA_HASH_KEY: DATA_HASH_PLACEHOLDER})


def _data_section(path: Path) -> tuple[bytes, bytes]:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return raw[: 8 + length], raw[8 + length :]


@pytest.mark.parametrize("dtype", [None, "float16"])
def test_a_data_hash_header_is_hashed_ahead_and_the_file_behind_the_writer(shard_setup, monkeypatch, dtype) -> None:  # type: ignore[no-untyped-def]
    """Streamed and cast tensors: the data's hash comes from the sources before the writer ends, and the
    file's from the trailing hasher; no pass over the finished file (sha256_file is never called)."""
    shard, states, out = shard_setup
    shard = _hashed_header_shard(_cast_shard(shard, dtype) if dtype else shard)
    monkeypatch.setattr(write, "sha256_file", lambda path: pytest.fail("the finished file was hashed again"))
    record = write.write_shard_file(shard, states, out, out / "work")
    path = out / record.file_name
    header, data = _data_section(path)
    assert record.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert record.data_sha256 == "0x" + hashlib.sha256(data).hexdigest()
    assert record.data_sha256.encode() in header


def test_a_failure_while_hashing_ahead_fails_the_write_and_publishes_nothing(shard_setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    shard, states, out = shard_setup
    shard = _hashed_header_shard(shard)

    def broken(*args: object) -> str:
        raise CheckpointError("the sources changed under the hash")

    monkeypatch.setattr(write, "data_section_sha256", broken)
    with pytest.raises(CheckpointError, match="changed under the hash"):
        write.write_shard_file(shard, states, out, out / "work")
    assert not (out / shard.file_name).exists()


def test_a_data_hash_that_is_not_the_written_bytes_is_caught(shard_setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The hash taken ahead is only the data's because the read-back proves the file holds the sources'
    bytes: a writer that writes other bytes fails, whatever was hashed ahead."""
    shard, states, out = shard_setup
    shard = _hashed_header_shard(shard)
    real = write._as_bytes
    calls = {"n": 0}

    def corrupt_in_writer(tensor: torch.Tensor) -> memoryview:
        import threading

        view = real(tensor)
        if threading.current_thread() is threading.main_thread() and calls["n"] == 0:
            calls["n"] += 1
            data = bytearray(view)
            data[0] ^= 0xFF
            return memoryview(bytes(data))
        return view

    monkeypatch.setattr(write, "_as_bytes", corrupt_in_writer)
    with pytest.raises(CheckpointError, match="round trip failed|differs"):
        write.write_shard_file(shard, states, out, out / "work")
    assert calls["n"] == 1
    assert not (out / shard.file_name).exists()


def test_a_data_hash_file_is_hashed_behind_the_writer_block_by_block_through_one_buffer(shard_setup, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The trailing hasher reads the file into one reused buffer and feeds the range digests inline from
    it: with blocks of 24 bytes against ranges of 64 (every range spans several blocks, some split
    mid-block), the file's digest and every range's are those of the bytes on disk."""
    from mergeflow.io import streamio

    shard, states, out = shard_setup
    monkeypatch.setattr(ranges_module, "RANGE_SIZE", 64)
    monkeypatch.setattr(streamio, "READ_BLOCK", 24)
    record = write.write_shard_file(_hashed_header_shard(shard), states, out, out / "work")
    raw = (out / record.file_name).read_bytes()
    assert record.sha256 == hashlib.sha256(raw).hexdigest()
    assert record.ranges is not None and record.ranges.size == len(raw)
    assert list(record.ranges.sha256) == [hashlib.sha256(raw[i : i + 64]).hexdigest() for i in range(0, len(raw), 64)]


def test_the_trailing_hasher_takes_only_an_inline_range_hasher(tmp_path: Path) -> None:
    from mergeflow.io.ranges import RangeHasher
    from mergeflow.io.streamio import TrailingHasher

    (tmp_path / "f").write_bytes(b"x" * 16)
    threaded = RangeHasher()
    try:
        with pytest.raises(ValueError, match="inline"):
            TrailingHasher(tmp_path / "f", 8, lambda: b"h" * 8, threaded)
    finally:
        threaded.close()
