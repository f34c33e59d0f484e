"""Rank-file integrity: every zip record's stored CRC-32 is checked in the pass that hashes the file.

A bit flip or a zeroed block inside a tensor's data record is refused as damage, naming the file and
the record, and an export of such a checkpoint publishes nothing.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import zipfile
from pathlib import Path

import pytest
from builders import Export, clone_export, make_export
from test_refusals import expect_refusal

from mergeflow.errors import CheckpointError
from mergeflow.formats.zip_records import sha256_and_check_records
from mergeflow.io.fs import FileStamp
from mergeflow.io.session import export_session
from mergeflow.sources.verl_ranks import hash_rank_file

RANK = "model_world_size_2_rank_1.pt"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Export:
    return make_export(tmp_path_factory.mktemp("integrity"), "FluxTransformer2DModel", 2)


@pytest.fixture()
def rank_file(pristine: Export, tmp_path: Path) -> Path:
    """A copy of one real rank file, free to damage."""
    path = tmp_path / RANK
    shutil.copyfile(pristine.actor_dir / RANK, path)
    return path


def _data_range(path: Path, info: zipfile.ZipInfo) -> tuple[int, int]:
    """[start, end) of a record's data: after its local header (30 bytes + name + extra field)."""
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)
    start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    return start, start + info.compress_size


def _largest_tensor_record(path: Path) -> tuple[zipfile.ZipInfo, int, int]:
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.compress_size)
    return (info, *_data_range(path, info))


def _damage(path: Path, offset: int, new: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(new)


def _flip_a_bit(path: Path) -> zipfile.ZipInfo:
    """The lowest mantissa bit of a value mid-record (little-endian floats): a finite, plausible weight."""
    info, start, end = _largest_tensor_record(path)
    offset = start + ((end - start) // 2 & ~3)
    with open(path, "rb") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
    _damage(path, offset, bytes([byte ^ 0x01]))
    return info


def _damage_message(path: Path, info: zipfile.ZipInfo) -> str:
    return re.escape(f"rank file {path.name} is damaged: record {info.filename} fails its CRC-32 check; "
                     "copy it again from the training run")


def test_the_digest_is_the_files_sha256(rank_file: Path) -> None:
    assert sha256_and_check_records(rank_file) == hashlib.sha256(rank_file.read_bytes()).hexdigest()


def test_a_flipped_bit_in_tensor_data_is_refused_naming_file_and_record(rank_file: Path) -> None:
    info = _flip_a_bit(rank_file)
    with pytest.raises(CheckpointError, match=_damage_message(rank_file, info)) as refused:
        sha256_and_check_records(rank_file)
    assert "\n" not in str(refused.value)


def test_a_zeroed_4k_block_in_tensor_data_is_refused(rank_file: Path) -> None:
    info, start, end = _largest_tensor_record(rank_file)
    block = (start + 4095) // 4096 * 4096  # a filesystem block lost inside the record
    assert block + 4096 <= end
    _damage(rank_file, block, bytes(4096))
    with pytest.raises(CheckpointError, match=_damage_message(rank_file, info)):
        sha256_and_check_records(rank_file)


@pytest.mark.parametrize("block", [4096, 4099, 37])
def test_records_and_headers_straddling_blocks_pass_when_clean_and_fail_when_damaged(rank_file: Path, block: int) -> None:
    size = rank_file.stat().st_size
    with zipfile.ZipFile(rank_file) as archive:
        ranges = [_data_range(rank_file, i) for i in archive.infolist()]
    assert size > 8 * block
    assert any(start // block != (end - 1) // block for start, end in ranges)  # some record spans blocks
    expected = hashlib.sha256(rank_file.read_bytes()).hexdigest()
    assert sha256_and_check_records(rank_file, block=block) == expected

    info = _flip_a_bit(rank_file)
    with pytest.raises(CheckpointError, match=_damage_message(rank_file, info)):
        sha256_and_check_records(rank_file, block=block)


def test_a_damaged_local_header_is_refused(rank_file: Path) -> None:
    info, _, _ = _largest_tensor_record(rank_file)
    _damage(rank_file, info.header_offset, b"XX")  # its signature
    with pytest.raises(CheckpointError, match=re.escape(f"record {info.filename} has a damaged local header")):
        sha256_and_check_records(rank_file)


def test_a_file_that_is_not_an_archive_is_only_hashed(tmp_path: Path) -> None:
    path = tmp_path / RANK
    path.write_bytes(os.urandom(3 * 4096 + 5))  # the loader, not the hash pass, says what is wrong with it
    assert sha256_and_check_records(path, block=4096) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_background_pass_keeps_its_verdict_for_the_hash_task(rank_file: Path) -> None:
    info = _flip_a_bit(rank_file)
    stamp = FileStamp.of(rank_file)
    with export_session() as session:  # the hash task finds the export's background pass in its session
        session.digests.start([rank_file], hasher=sha256_and_check_records)
        assert session.digests.take(rank_file, stamp) is None  # a plain digest is never asked of a checked pass
        with pytest.raises(CheckpointError, match=_damage_message(rank_file, info)):
            session.digests.take(rank_file, stamp, hasher=sha256_and_check_records)
        with pytest.raises(CheckpointError, match=_damage_message(rank_file, info)):
            hash_rank_file(rank_file.parent, rank_file.name, stamp)


def test_the_hash_task_checks_records_itself_when_only_a_plain_digest_was_prefetched(rank_file: Path) -> None:
    info = _flip_a_bit(rank_file)
    stamp = FileStamp.of(rank_file)
    with export_session() as session:
        session.digests.start([rank_file])  # sha256 only
        assert session.digests.take(rank_file, stamp) == hashlib.sha256(rank_file.read_bytes()).hexdigest()
        with pytest.raises(CheckpointError, match=_damage_message(rank_file, info)):
            hash_rank_file(rank_file.parent, rank_file.name, stamp)


def test_an_export_of_a_checkpoint_with_one_flipped_bit_is_refused_publishing_nothing(pristine: Export, tmp_path: Path) -> None:
    ex = clone_export(pristine, tmp_path)
    info = _flip_a_bit(ex.actor_dir / RANK)
    err = expect_refusal(ex, CheckpointError, _damage_message(ex.actor_dir / RANK, info), stage="hash")
    assert err.exit_code == 2
