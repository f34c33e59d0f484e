"""DCP integrity: every `torch.save` record of a `.distcp` is checked against its CRC-32 in the pass that hashes it.

A `.distcp` holds one `torch.save` zip archive per chunk, back to back at the byte ranges `.metadata`
gives; torch's loader checks none of their CRC-32s, so a flipped bit loads as a plausible weight. Each
damage below, on copies of the real gloo-written DCPs, is refused in one line naming the file and the
record, and an export of such a checkpoint publishes nothing. Also here: the DCP inputs that used to get a
misleading answer (an extra `.distcp`, a FIFO `.metadata`, a Parameter chunk), a full disk's message
naming its file, and a CLI merge whose stderr carries no diffusers log line.

Corrupt-DCP cases (the reliability count): 13 kinds of damage (a bit flip, a zeroed 4 KB block, a flip in
every chunk, four in a record's header area, two read-block sizes, a trusted `.metadata`, the background
pass's verdict, a whole export, the CLI) and 3 defective layouts (an extra `.distcp`, a FIFO `.metadata`,
a FIFO `.distcp`): each refused in one line, nothing published.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import resource
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import forked_cli
import pytest
import torch
from builders import assert_bit_exact, leftovers, output_state, tree_digest

import mergeflow.errors as E
from mergeflow.formats import dcp
from mergeflow.io.fs import FileStamp
from mergeflow.io.session import export_session
from mergeflow.sources import dcp as dcp_source
from mergeflow.sources.registry import file_hasher
from mergeflow.sources.verl_ranks import hash_rank_file
from tests.fixtures.dcp_writers import DcpCheckpoint, rewrite_chunk_record

VICTIM = "__1_0.distcp"


@pytest.fixture()
def copy(accelerate_dcp: DcpCheckpoint, tmp_path: Path) -> Path:
    """A copy of the DCP directory, free to damage (named as accelerate saves it)."""
    target = tmp_path / "pytorch_model_fsdp_0"
    shutil.copytree(accelerate_dcp.dcp_dir, target)
    return target


def _hash(path: Path, block: int | None = None) -> str:
    return dcp._check_records(path, False, block) if block else dcp.sha256_and_check_distcp(path)


def _records(directory: Path, file: str) -> list[tuple[dcp.ChunkSource, str]]:
    return dcp.open_dcp(directory).records(file)


def _entry(directory: Path, chunk: dcp.ChunkSource, name: str) -> tuple[zipfile.ZipInfo, int, int]:
    """One entry of a chunk's archive: its ZipInfo (offsets within the archive) and its data's [start, end) in the file."""
    with open(directory / chunk.file, "rb") as handle:
        handle.seek(chunk.offset)
        archive = handle.read(chunk.length)
    info = next(i for i in zipfile.ZipFile(io.BytesIO(archive)).infolist() if i.filename.endswith(name))
    header = archive[info.header_offset:info.header_offset + 30]
    start = chunk.offset + info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    return info, start, start + info.compress_size


def _largest(directory: Path, file: str = VICTIM) -> tuple[dcp.ChunkSource, str]:
    return max(_records(directory, file), key=lambda record: record[0].length)


def _xor(path: Path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ mask]))


def _write(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def _message(file: str, entry: str, key: str, chunk: dcp.ChunkSource, what: str = "fails its CRC-32 check") -> str:
    return re.escape(f"DCP file {file} is damaged: record archive/{entry} of {key} (chunk at {list(chunk.offsets)}) "
                     f"{what}; copy it again from the training run")


def _flip_tensor_bit(directory: Path, file: str = VICTIM) -> tuple[dcp.ChunkSource, str]:
    """The lowest mantissa bit of a float mid-record: a finite, plausible weight that torch loads silently."""
    chunk, key = _largest(directory, file)
    _, start, end = _entry(directory, chunk, "data/0")
    _xor(directory / file, start + ((end - start) // 2 & ~3))
    return chunk, key


# --- the hash pass on each kind of damage -----------------------------------------------------------------


def test_every_clean_dcp_file_hashes_to_its_sha256(copy: Path) -> None:
    for path in sorted(copy.iterdir()):
        assert dcp.sha256_and_check_distcp(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_flipped_bit_in_tensor_bytes_is_refused_naming_file_and_record(copy: Path) -> None:
    chunk, key = _flip_tensor_bit(copy)
    torch.load(io.BytesIO((copy / VICTIM).read_bytes()[chunk.offset:chunk.offset + chunk.length]), weights_only=True)
    # ^ torch itself loads the damaged record without a word: the CRC check is all that notices
    with pytest.raises(E.CheckpointError, match=_message(VICTIM, "data/0", key, chunk)) as refused:
        _hash(copy / VICTIM)
    assert "\n" not in str(refused.value)


def test_a_zeroed_4k_block_is_refused(copy: Path) -> None:
    chunk, key = _largest(copy)
    _, start, end = _entry(copy, chunk, "data/0")
    block = (start + 4095) // 4096 * 4096  # a filesystem block lost inside the record
    assert block + 4096 <= end, "the fixture's largest chunk must hold an aligned 4 KB block"
    _write(copy / VICTIM, block, bytes(4096))
    with pytest.raises(E.CheckpointError, match=_message(VICTIM, "data/0", key, chunk)):
        _hash(copy / VICTIM)


def test_a_flip_in_every_chunk_is_refused_in_every_file(copy: Path) -> None:
    files = [name for name in dcp.open_dcp(copy).files if name != ".metadata"]
    first: dict[str, tuple[dcp.ChunkSource, str]] = {}
    for file in files:
        records = _records(copy, file)
        for chunk, key in records:
            _, start, end = _entry(copy, chunk, "data/0")
            if end > start:  # an empty trailing shard has no byte to flip
                _xor(copy / file, start + (end - start) // 2, 0x80)
                first.setdefault(file, (chunk, key))
    assert len(first) == 3
    for file, (chunk, key) in first.items():
        with pytest.raises(E.CheckpointError, match=_message(file, "data/0", key, chunk)):
            _hash(copy / file)


@pytest.mark.parametrize("where", ["local_header", "pickle_record", "zip_directory", "central_crc"])
def test_damage_in_a_records_header_area_is_refused(copy: Path, where: str) -> None:
    chunk, key = _largest(copy)
    info, start, _ = _entry(copy, chunk, "data/0")
    pickle_info, pickle_start, _ = _entry(copy, chunk, "data.pkl")
    if where == "local_header":  # the signature of the tensor entry's local header
        _write(copy / VICTIM, chunk.offset + info.header_offset, b"XX")
        match = _message(VICTIM, "data/0", key, chunk, "has a damaged local header")
    elif where == "pickle_record":  # the chunk's pickle: its dtype, shape and storage key live there
        _xor(copy / VICTIM, pickle_start + 2)
        match = _message(VICTIM, "data.pkl", key, chunk)
    elif where == "zip_directory":  # the archive's end record: no directory, no CRCs to check against
        _write(copy / VICTIM, chunk.offset + chunk.length - 22, b"\0\0\0\0")
        match = re.escape(f"DCP file {VICTIM} is damaged: the record of {key} (chunk at {list(chunk.offsets)}) at bytes "
                          f"{chunk.offset:,}-{chunk.offset + chunk.length:,} is not a readable torch.save archive")
    else:  # the CRC the central directory stores for the tensor entry
        with open(copy / VICTIM, "rb") as handle:
            handle.seek(chunk.offset)
            archive = handle.read(chunk.length)
        entries = [m.start() for m in re.finditer(re.escape(b"PK\x01\x02"), archive)]  # central directory entries
        named = next(e for e in entries if archive[e + 46:e + 46 + len(info.filename)] == info.filename.encode())
        _xor(copy / VICTIM, chunk.offset + named + 16)  # its CRC-32 field
        match = _message(VICTIM, "data/0", key, chunk)
    with pytest.raises(E.CheckpointError, match=match) as refused:
        _hash(copy / VICTIM)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("block", [37, 4099])
def test_records_straddling_read_blocks_pass_clean_and_fail_damaged(copy: Path, block: int) -> None:
    path = copy / VICTIM
    assert any(c.offset // block != (c.offset + c.length - 1) // block for c, _ in _records(copy, VICTIM))
    assert _hash(path, block) == hashlib.sha256(path.read_bytes()).hexdigest()
    chunk, key = _flip_tensor_bit(copy)
    with pytest.raises(E.CheckpointError, match=_message(VICTIM, "data/0", key, chunk)):
        _hash(path, block)


def test_a_metadata_only_trust_reads_is_checked_by_the_trusted_hasher(copy: Path) -> None:
    import datetime

    chunk, key = _largest(copy)
    _, start, _ = _entry(copy, chunk, "data/0")
    metadata = pickle.loads((copy / ".metadata").read_bytes())  # our own fixture
    metadata.planner_data = {"saved_at": datetime.datetime(2026, 1, 1)}  # a global the closed reader refuses
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    assert file_hasher("dcp", True) is dcp.sha256_and_check_distcp_trusted
    assert file_hasher("dcp") is dcp.sha256_and_check_distcp
    with pytest.raises(E.UnsafeCheckpointError):
        dcp.sha256_and_check_distcp(copy / VICTIM)
    path = copy / VICTIM
    assert dcp.sha256_and_check_distcp_trusted(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    _xor(path, start + 4)
    with pytest.raises(E.CheckpointError, match=_message(VICTIM, "data/0", key, chunk)):
        dcp.sha256_and_check_distcp_trusted(path)


def test_the_background_pass_keeps_its_verdict_for_the_hash_task(copy: Path) -> None:
    chunk, key = _flip_tensor_bit(copy)
    path, hasher = copy / VICTIM, file_hasher("dcp")
    stamp = FileStamp.of(path)
    with export_session() as session:  # the hash task finds the export's background pass in its session
        session.digests.start([copy / name for name in dcp.open_dcp(copy).files], hasher=hasher)
        assert session.digests.take(path, stamp) is None  # a plain digest is never asked of a checked pass
        with pytest.raises(E.CheckpointError, match=_message(VICTIM, "data/0", key, chunk)):
            session.digests.take(path, stamp, hasher=hasher)
        with pytest.raises(E.CheckpointError, match=_message(VICTIM, "data/0", key, chunk)):
            hash_rank_file(copy, VICTIM, stamp, hasher)
        metadata = copy / ".metadata"
        assert session.digests.take(metadata, FileStamp.of(metadata), hasher=hasher) == hashlib.sha256(
            metadata.read_bytes()).hexdigest()


# --- whole exports ---------------------------------------------------------------------------------------


def _merge(ckpt: DcpCheckpoint, actor: Path, target: Path) -> None:
    from mergeflow import merge_model
    from mergeflow.config import ModelMergerConfig

    merge_model(ModelMergerConfig(operation="merge", local_dir=str(actor), base_model=str(ckpt.base_dir),
                                  target_dir=str(target), output_format="transformer"))


def test_an_export_of_a_dcp_with_one_flipped_bit_is_refused_publishing_nothing(
        tmp_path: Path, prefect_api: object, accelerate_dcp: DcpCheckpoint, copy: Path) -> None:
    chunk, key = _flip_tensor_bit(copy)
    before = tree_digest(copy)
    with pytest.raises(E.CheckpointError, match=_message(VICTIM, "data/0", key, chunk)) as refused:
        _merge(accelerate_dcp, copy, tmp_path / "out")
    assert refused.value.exit_code == 2 and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path, ".out.") == []  # an input refusal: the staging is removed, no lock is left
    assert tree_digest(copy) == before  # the input is not touched


def test_the_cli_refuses_a_dcp_flipped_in_every_chunk_in_one_line(
        tmp_path: Path, prefect_server: object, accelerate_dcp: DcpCheckpoint, copy: Path) -> None:
    for chunk, _ in _records(copy, "__0_0.distcp"):
        _, start, end = _entry(copy, chunk, "data/0")
        if end > start:
            _xor(copy / "__0_0.distcp", start)
    env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}  # type: ignore[attr-defined]
    done = forked_cli.mergeflow(["merge", "--backend", "fsdp", "--local_dir", str(copy), "--base_model",
                                 str(accelerate_dcp.base_dir), "--output_format", "transformer",
                                 "--target_dir", str(tmp_path / "out")], env)
    errors = [line for line in done.stderr.splitlines() if line.startswith("mergeflow: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert re.match(r"mergeflow: error: DCP file __0_0\.distcp is damaged: record archive/data/0 of model\.\S+ "
                    r"\(chunk at \[\d+(, \d+)*\]\) fails its CRC-32 check", errors[0]), errors[0]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path, ".out.") == []


# --- smaller defects: extra files, FIFOs, Parameter chunks, a full disk's path, diffusers' log ---------------


def test_an_extra_distcp_that_metadata_does_not_name_is_refused(
        tmp_path: Path, prefect_api: object, accelerate_dcp: DcpCheckpoint, copy: Path) -> None:
    shutil.copyfile(copy / "__2_0.distcp", copy / "__3_0.distcp")  # left by an earlier save with 4 ranks
    with pytest.raises(E.CheckpointError, match=r"unexpected DCP file\(s\) __3_0\.distcp in pytorch_model_fsdp_0/ "
                                                r"that its \.metadata does not name \(stale files from another save\?\)"):
        dcp.open_dcp(copy)
    with pytest.raises(E.CheckpointError, match="unexpected DCP file"):
        _merge(accelerate_dcp, copy, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path, ".out.") == []


@pytest.mark.parametrize("name", [".metadata", "__1_0.distcp"])
def test_a_fifo_in_a_dcp_is_refused_without_blocking(tmp_path: Path, accelerate_dcp: DcpCheckpoint, copy: Path,
                                                     name: str) -> None:
    (copy / name).unlink()
    os.mkfifo(copy / name)  # nobody writes it: an open() would wait for ever
    match = re.escape(f"{name} in pytorch_model_fsdp_0/ is not a regular file (a FIFO, socket, device or directory)")
    with pytest.raises(E.CheckpointError, match=match):
        dcp.open_dcp(copy)
    # The command line's pre-flight (before any server) answers at once, in one line.
    done = forked_cli.mergeflow(["merge", "--backend", "fsdp", "--local_dir", str(copy), "--base_model",
                                 str(accelerate_dcp.base_dir), "--output_format", "transformer",
                                 "--target_dir", str(tmp_path / "out")], {**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert re.search(match, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()


def _as_parameter_record(directory: Path, key: str) -> None:
    """Rewrite one chunk's record as torch.save(nn.Parameter(chunk)) (what a planner that does not detach saves),
    shifting the records after it and updating `.metadata`'s byte ranges."""
    def as_parameter(record: bytes) -> bytes:
        tensor = torch.load(io.BytesIO(record), weights_only=True)
        buffer = io.BytesIO()
        torch.save(torch.nn.Parameter(tensor, requires_grad=False), buffer)
        return buffer.getvalue()

    rewrite_chunk_record(directory, key, 0, as_parameter)


def test_a_parameter_chunk_reads_as_its_tensor(accelerate_dcp: DcpCheckpoint, copy: Path) -> None:
    parsed = dcp.open_dcp(copy)
    name = max(parsed.tensors, key=lambda n: len(parsed.tensors[n].chunks))
    key = parsed.tensors[name].key
    _as_parameter_record(copy, key)
    parsed = dcp.open_dcp(copy)
    for file in parsed.files:  # the rewritten records carry valid CRCs
        assert dcp.sha256_and_check_distcp(copy / file) == hashlib.sha256((copy / file).read_bytes()).hexdigest()
    got = dcp_source.read_tensor(dcp.DcpChunks(parsed), name)
    assert type(got) is torch.Tensor
    assert_bit_exact({name: accelerate_dcp.trained[key]}, {name: got})


def test_a_full_disk_met_by_a_plain_write_names_the_file(tmp_path: Path) -> None:
    """os.write and fsync report EFBIG / ENOSPC without a file name; the message must still say where."""
    script = f"""
import resource
from pathlib import Path
from mergeflow.io.jsonfiles import write_bytes_durable
from mergeflow.io.os_errors import typed_os_error
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # Python ignores SIGXFSZ: the write fails with EFBIG
try:
    write_bytes_durable(Path({str(tmp_path / 'manifest.json')!r}), b"x" * 100_000)
except OSError as exc:
    print(typed_os_error(exc))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert f"File too large: {tmp_path / 'manifest.json'})" in done.stdout, done.stdout
    assert "a file" not in done.stdout


def test_a_cli_merge_s_full_disk_names_the_shard_file_and_its_stderr_has_no_diffusers_line(
        tmp_path: Path, prefect_server: object, accelerate_dcp: DcpCheckpoint) -> None:
    base = tmp_path / "base"
    shutil.copytree(accelerate_dcp.base_dir, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "a_future_option": True}))  # diffusers would log about it
    env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}  # type: ignore[attr-defined]
    args = ["merge", "--backend", "fsdp", "--local_dir", str(accelerate_dcp.dcp_dir), "--base_model", str(base),
            "--output_format", "transformer", "--target_dir", str(tmp_path / "out")]
    full = forked_cli.mergeflow(args, env, rlimits={resource.RLIMIT_FSIZE: (100_000, 100_000)})
    errors = [line for line in full.stderr.splitlines() if line.startswith("mergeflow: error:")]
    assert full.returncode == 2 and len(errors) == 1, full.stderr
    assert "no space left while writing diffusion_pytorch_model.safetensors (File too large: " in errors[0], errors[0]
    assert "diffusion_pytorch_model.safetensors.partial)" in errors[0] and "a file" not in errors[0], errors[0]
    done = forked_cli.mergeflow(args, env)  # the limit gone: the same command resumes and publishes
    assert done.returncode == 0, done.stderr
    foreign = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("mergeflow: ")]
    assert foreign == [], done.stderr  # e.g. "The config attributes {...} were passed to ..., but are not expected"
    assert not any("config attributes" in line for line in full.stderr.splitlines()), full.stderr
    expected = {dcp.model_name(k): v for k, v in accelerate_dcp.trained.items()}
    assert_bit_exact(expected, output_state(tmp_path / "out"))
