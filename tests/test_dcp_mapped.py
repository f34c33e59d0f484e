"""DCP chunks read in place from their `.distcp` mapping (mergeflow/formats/dcp_mapped.py), on real `dcp.save` output.

The mapped tensors are bit-equal to torch's loader's and to the trained model; they view the file's mapping
(or, where the file puts a storage at an offset torch cannot view as its dtype, one aligned copy); a storage
pointing outside its chunk's bytes is refused in one line; records the mapped reader leaves still read through
torch's loader with its messages; and reading every chunk of a few hundred MB grows private memory only by the
copied (misaligned) storages, against all of it for the loader, and not at all read in place (the bytes a
streamed tensor's writer and read-back use), where no storage is copied.
"""

from __future__ import annotations

import gc
import io
import json
import pickle
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import mergeflow.errors as E
from mergeflow.formats import dcp, dcp_mapped
from mergeflow.formats.rank_pickle import MappedFile, map_file
from mergeflow.io.session import export_session
from mergeflow.sources import dcp as dcp_source
from tests.fixtures.dcp_writers import DcpCheckpoint, rewrite_chunk_record

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def copy(accelerate_dcp: DcpCheckpoint, tmp_path: Path) -> Path:
    target = tmp_path / "pytorch_model_fsdp_0"
    shutil.copytree(accelerate_dcp.dcp_dir, target)
    return target


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _inside(tensor: torch.Tensor, mapped: MappedFile) -> bool:
    return mapped.address <= tensor.data_ptr() < mapped.address + mapped.size


def _no_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> torch.Tensor:
        raise AssertionError("torch's loader read a chunk the mapped reader should have read")

    monkeypatch.setattr(dcp, "_load_chunk", refuse)


@pytest.mark.parametrize("which", ["accelerate_dcp", "bf16_lora_dcp"])
def test_mapped_chunks_equal_the_loader_s_and_the_model_bit_for_bit(which: str, request: pytest.FixtureRequest) -> None:
    ckpt: DcpCheckpoint = request.getfixturevalue(which)
    parsed = dcp.open_dcp(ckpt.dcp_dir)
    chunks = dcp.DcpChunks(parsed)
    for tensor in parsed.tensors.values():
        for index, source in enumerate(tensor.chunks):
            mapped = chunks.local(index, tensor.key)
            loaded = dcp._load_chunk(parsed.directory / source.file, source, tensor.key)
            assert mapped.dtype == loaded.dtype and mapped.shape == loaded.shape, tensor.key
            assert torch.equal(_bits(mapped), _bits(loaded)), tensor.key
        want = ckpt.trained[tensor.key]
        got = dcp_source.read_tensor(chunks, tensor.name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(_bits(got), _bits(want)), tensor.name


@pytest.mark.parametrize("which", ["accelerate_dcp", "bf16_lora_dcp"])
def test_every_chunk_is_read_from_the_mapping_without_torch_s_loader(which: str, request: pytest.FixtureRequest,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt: DcpCheckpoint = request.getfixturevalue(which)
    parsed = dcp.open_dcp(ckpt.dcp_dir)
    _no_loader(monkeypatch)
    chunks = dcp.DcpChunks(parsed)
    viewed = copied = 0
    for tensor in parsed.tensors.values():
        for index, source in enumerate(tensor.chunks):
            got = chunks.local(index, tensor.key)
            if not got.numel():
                continue
            mapped = chunks._mapped[source.file]
            assert mapped is not None
            itemsize = got.element_size()
            if _inside(got, mapped):
                viewed += 1  # the tensor's bytes are the file's mapped bytes, at the record's place
                with open(parsed.directory / source.file, "rb") as handle:
                    handle.seek(got.data_ptr() - mapped.address)
                    assert handle.read(got.numel() * itemsize) == _bits(got).numpy().tobytes()
                assert source.offset <= got.data_ptr() - mapped.address < source.offset + source.length
            else:
                copied += 1  # the file puts this storage where its dtype cannot be viewed: copied aligned
                assert (mapped.address + _data_offset(parsed.directory, source)) % itemsize != 0
            assert got.data_ptr() % itemsize == 0
    assert viewed and copied, (viewed, copied)  # both kinds occur in a real dcp.save: records sit at any byte
    for name in parsed.tensors:
        dcp_source.read_tensor(chunks, name)
    assert set(chunks._mapped) == {f for f in parsed.files if f.endswith(".distcp")}


def _data_offset(directory: Path, source: dcp.ChunkSource) -> int:
    """File offset of a chunk's storage data (its archive's data/0 record), parsed independently with zipfile."""
    with open(directory / source.file, "rb") as handle:
        handle.seek(source.offset)
        archive = handle.read(source.length)
    info = next(i for i in zipfile.ZipFile(io.BytesIO(archive)).infolist() if i.filename.endswith("/data/0"))
    header = archive[info.header_offset:info.header_offset + 30]
    return (source.offset + info.header_offset + 30 + int.from_bytes(header[26:28], "little")
            + int.from_bytes(header[28:30], "little"))


def test_one_mapping_per_file_per_export_and_tensors_outlive_it(accelerate_dcp: DcpCheckpoint) -> None:
    parsed = dcp.open_dcp(accelerate_dcp.dcp_dir)
    name = max(parsed.tensors, key=lambda n: parsed.tensors[n].chunks[0].length)
    key = parsed.tensors[name].key
    file = parsed.tensors[name].chunks[0].file
    with export_session():
        first, second = dcp.DcpChunks(parsed), dcp.DcpChunks(parsed)
        tensor = first.local(0, key)
        second.local(0, key)
        assert first._mapped[file] is second._mapped[file] is map_file(parsed.directory / file)
    want = _bits(dcp._load_chunk(parsed.directory / file, parsed.tensors[name].chunks[0], key)).clone()
    del first, second
    gc.collect()
    assert torch.equal(_bits(tensor), want)  # the tensor holds its mapping alive


# --- a storage outside its chunk's bytes ----------------------------------------------------------------------


def _central_entry(archive: bytes, suffix: str) -> int:
    """Offset, inside a chunk's archive, of the central directory entry whose name ends with `suffix`."""
    at = archive.find(b"PK\x01\x02")
    while at >= 0:
        name_len = int.from_bytes(archive[at + 28:at + 30], "little")
        if archive[at + 46:at + 46 + name_len].decode().endswith(suffix):
            return at
        at = archive.find(b"PK\x01\x02", at + 1)
    raise AssertionError(f"no central entry {suffix}")


@pytest.mark.parametrize("field", ["size", "header_offset"])
def test_a_storage_pointing_outside_its_chunk_is_refused_in_one_line(copy: Path, field: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk's zip directory rewritten so its storage record reaches past the chunk's byte range (into the
    next chunk's bytes or past the file): refused by the mapped reader, never handed to a loader."""
    parsed = dcp.open_dcp(copy)
    tensor = max(parsed.tensors.values(), key=lambda t: (len(t.chunks), t.chunks[0].length))
    source = tensor.chunks[0]
    path = copy / source.file
    data = bytearray(path.read_bytes())
    archive = bytes(data[source.offset:source.offset + source.length])
    entry = source.offset + _central_entry(archive, "/data/0")
    start = _data_offset(copy, source)
    if field == "size":
        size = source.length  # data/0 now claims more bytes than the whole chunk holds
        data[entry + 20:entry + 28] = size.to_bytes(4, "little") * 2  # compressed and uncompressed size
        first, last = start, start + size
    else:
        moved = source.length - 10  # its local header now starts 10 bytes before the chunk's end
        data[entry + 42:entry + 46] = moved.to_bytes(4, "little")
        first, last = source.offset + moved, source.offset + moved + 30
    path.write_bytes(bytes(data))
    _no_loader(monkeypatch)
    label = f"{tensor.key} (chunk at {list(source.offsets)})"
    message = (f"DCP file {source.file} is damaged: the record of {label} puts record archive/data/0 at bytes "
               f"{first:,}-{last:,}, outside its chunk's bytes {source.offset:,}-{source.offset + source.length:,}; "
               "copy it again from the training run")
    with pytest.raises(E.CheckpointError) as refused:
        dcp_source.read_tensor(dcp.DcpChunks(dcp.open_dcp(copy)), tensor.name)
    assert str(refused.value) == message and "\n" not in str(refused.value)


def test_a_storage_larger_than_its_chunk_is_refused(copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pickle's element count rewritten (CRC kept valid) so the storage runs past the chunk's bytes."""
    parsed = dcp.open_dcp(copy)
    tensor = max(parsed.tensors.values(), key=lambda t: t.chunks[-1].length)
    source = tensor.chunks[-1]
    chunk = dcp._load_chunk(copy / source.file, source, tensor.key)
    numel = source.length  # elements: 4 bytes each, so 4x the chunk's whole byte range

    def bigger(record: bytes) -> bytes:
        with zipfile.ZipFile(io.BytesIO(record)) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            pickled = archive.read(name)
        # the persistent id ("storage", FloatStorage, "0", "cpu", numel): the count follows "cpu" and its BINPUT
        at = pickled.index(b"X\x03\x00\x00\x00cpuq") + 10
        count = pickle.dumps(chunk.numel(), protocol=2)[2:-1]
        assert pickled[at:at + len(count)] == count
        return _replace_record(record, name, pickled[:at] + pickle.dumps(numel, protocol=2)[2:-1] + pickled[at + len(count):])

    rewrite_chunk_record(copy, tensor.key, len(tensor.chunks) - 1, bigger)
    source = dcp.open_dcp(copy).tensors[tensor.name].chunks[-1]
    _no_loader(monkeypatch)
    start = _data_offset(copy, source)
    with pytest.raises(E.CheckpointError, match=re.escape(
            f"puts storage archive/data/0 at bytes {start:,}-{start + 4 * numel:,}, outside its chunk's bytes "
            f"{source.offset:,}-{source.offset + source.length:,}; copy it again from the training run")):
        dcp.DcpChunks(dcp.open_dcp(copy)).local(len(tensor.chunks) - 1, tensor.key)


# --- records the mapped reader leaves to torch's loader ------------------------------------------------------


def _replace_record(archive: bytes, name: str, content: bytes, compress: int = zipfile.ZIP_STORED) -> bytes:
    """`archive` with record `name` replaced (fresh CRC), every other record kept as it was."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as old, zipfile.ZipFile(out, "w") as new:
        for info in old.infolist():
            body = content if info.filename == name else old.read(info.filename)
            new.writestr(info.filename, body, compress_type=compress if info.filename == name else zipfile.ZIP_STORED)
    return out.getvalue()


def _counting_loader(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = dcp._load_chunk

    def counted(path: Path, source: dcp.ChunkSource, key: str) -> torch.Tensor:
        calls.append(key)
        return real(path, source, key)

    monkeypatch.setattr(dcp, "_load_chunk", counted)
    return calls


def test_a_compressed_storage_record_is_read_by_torch_s_loader(accelerate_dcp: DcpCheckpoint, copy: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = dcp.open_dcp(copy)
    tensor = max(parsed.tensors.values(), key=lambda t: t.chunks[0].length)

    def deflated(record: bytes) -> bytes:
        with zipfile.ZipFile(io.BytesIO(record)) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data/0"))
            return _replace_record(record, name, archive.read(name), zipfile.ZIP_DEFLATED)

    rewrite_chunk_record(copy, tensor.key, 0, deflated)
    parsed = dcp.open_dcp(copy)
    source = parsed.tensors[tensor.name].chunks[0]
    with pytest.raises(dcp_mapped.NotFastReadable):
        dcp_mapped.read_chunk(map_file(copy / source.file), source.offset, source.length, "x")
    calls = _counting_loader(monkeypatch)
    got = dcp_source.read_tensor(dcp.DcpChunks(parsed), tensor.name)
    assert calls == [tensor.key]  # only the rewritten chunk went to the loader
    assert torch.equal(_bits(got), _bits(accelerate_dcp.trained[tensor.key]))


@pytest.mark.parametrize("damage", ["zeroed_header", "a_dict"])
def test_records_the_mapped_reader_leaves_get_the_loader_s_messages(copy: Path, damage: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = dcp.open_dcp(copy)
    tensor = min(parsed.tensors.values(), key=lambda t: (t.chunks[0].file, t.chunks[0].offset))
    if damage == "zeroed_header":  # the chunk's first local header (data.pkl's) zeroed: no zip record there
        path = copy / tensor.chunks[0].file
        data = bytearray(path.read_bytes())
        data[tensor.chunks[0].offset:tensor.chunks[0].offset + 64] = b"\0" * 64
        path.write_bytes(bytes(data))
        expected = "damaged or not a tensor"
    else:  # torch.save({"w": chunk}): the safe loader reads it; it is not a tensor
        def as_dict(record: bytes) -> bytes:
            buffer = io.BytesIO()
            torch.save({"w": torch.load(io.BytesIO(record), weights_only=True)}, buffer)
            return buffer.getvalue()

        rewrite_chunk_record(copy, tensor.key, 0, as_dict)
        expected = "holds a builtins.dict, not a tensor"
    parsed = dcp.open_dcp(copy)
    source = parsed.tensors[tensor.name].chunks[0]
    with pytest.raises(E.CheckpointError) as direct:
        dcp._load_chunk(copy / source.file, source, tensor.key)  # the loader's own message, as before the mapping
    calls = _counting_loader(monkeypatch)
    with pytest.raises(E.CheckpointError) as refused:
        dcp.DcpChunks(parsed).local(0, tensor.key)
    assert calls == [tensor.key]
    assert str(refused.value) == str(direct.value) and expected in str(refused.value)


# --- private memory -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def large_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """256 MB of bfloat16 weights in 64 tensors, saved by one writer with torch.distributed.checkpoint.save."""
    import torch.distributed.checkpoint as tdcp

    directory = tmp_path_factory.mktemp("large") / "dcp"
    gen = torch.Generator().manual_seed(3)
    state = {f"blocks.{i}.weight": torch.randn(2048, 1024 + i, generator=gen).to(torch.bfloat16) for i in range(64)}
    tdcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return directory


def _private_growth(directory: Path, mode: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-m", "tests.fixtures.dcp_private_memory", str(directory), mode],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_reading_every_chunk_grows_private_memory_only_by_the_copied_storages(large_dcp: Path) -> None:
    mapped, loader = _private_growth(large_dcp, "mapped"), _private_growth(large_dcp, "loader")
    data = mapped["data_bytes"]
    assert data == loader["data_bytes"] > 250e6 and mapped["tensors"] == 64
    slack = 16 * 2**20  # the interpreter, torch's small allocations, the tensors' Python objects
    assert loader["growth_kb"] * 1024 > 0.9 * data, loader  # the control: every chunk copied into private memory
    assert 0 < mapped["copied_bytes"] < data, mapped  # records at any byte: some storages misaligned, some not
    assert mapped["growth_kb"] * 1024 < mapped["copied_bytes"] + slack, mapped  # viewed storages cost nothing
    saved = loader["growth_kb"] * 1024 - mapped["growth_kb"] * 1024
    assert saved > 0.9 * (data - mapped["copied_bytes"]), (mapped, loader)


def test_chunks_read_in_place_are_never_copied_and_hold_the_same_bytes(accelerate_dcp: DcpCheckpoint,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = dcp.open_dcp(accelerate_dcp.dcp_dir)
    _no_loader(monkeypatch)
    chunks = dcp.DcpChunks(parsed)
    odd = 0
    for tensor in parsed.tensors.values():
        for index, source in enumerate(tensor.chunks):
            got, aligned = chunks.local_in_place(index, tensor.key), chunks.local(index, tensor.key)
            if not got.numel():
                continue
            mapped = chunks._mapped[source.file]
            assert mapped is not None and _inside(got, mapped)  # the file's own bytes, whatever their alignment
            assert got.shape == aligned.shape and got.dtype == aligned.dtype and got.is_contiguous()
            assert _bits(got).numpy().tobytes() == _bits(aligned).numpy().tobytes()
            odd += got.data_ptr() % got.element_size() != 0
    assert odd  # some chunks sit where `local` has to copy them: here they are viewed in place


def test_reading_every_chunk_in_place_grows_private_memory_by_nothing(large_dcp: Path) -> None:
    in_place, mapped = _private_growth(large_dcp, "in_place"), _private_growth(large_dcp, "mapped")
    assert in_place["data_bytes"] == mapped["data_bytes"] > 250e6
    assert in_place["copied_bytes"] == 0 and mapped["copied_bytes"] > 16 * 2**20, (in_place, mapped)  # the control
    assert in_place["growth_kb"] * 1024 < 16 * 2**20, in_place  # the interpreter's slack only
