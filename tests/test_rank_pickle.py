"""The closed fast reader of rank files agrees with torch's safe loader, and refuses what it does not know."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (torch's loader needs DTensor registered)
from test_reconstruct import Odd

from mergeflow.demo.checkpoints import build_transformer, save_fsdp_checkpoint
from mergeflow.errors import CheckpointError, UnsafeCheckpointError
from mergeflow.formats.rank_files import describe_state, load_rank_state, local_tensor
from mergeflow.formats.rank_pickle import NotFastReadable, ShardedValue, read_rank_file


def _torch_state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


@pytest.mark.parametrize("model_name,world,mesh,plain", [
    ("odd", 1, None, False), ("odd", 3, None, False), ("odd", 4, (2, 2), False), ("odd", 1, None, True),
    ("flux", 4, None, False),
], ids=["odd-w1", "odd-w3", "odd-hsdp2x2", "odd-plain", "flux-w4"])
def test_fast_reader_matches_torch_safe_loader(tmp_path: Path, model_name: str, world: int, mesh, plain: bool) -> None:  # type: ignore[no-untyped-def]
    model = Odd() if model_name == "odd" else build_transformer("FluxTransformer2DModel", seed=0)
    actor = save_fsdp_checkpoint(model, tmp_path / "actor", world, mesh_shape=mesh, plain=plain, write_hf_config=False)
    for rank in range(world):
        path = actor / f"model_world_size_{world}_rank_{rank}.pt"
        fast, reference = read_rank_file(path), _torch_state(path)  # read_rank_file raises if it fell short
        assert list(fast) == list(reference)
        assert describe_state(fast, path.name).keys() == describe_state(reference, path.name).keys()
        fast_entries, ref_entries = describe_state(fast, path.name), describe_state(reference, path.name)
        for key, ref in ref_entries.items():
            got = fast_entries[key]
            assert (got.kind, got.dtype, got.global_shape, got.local_shape, got.placements, got.mesh_shape) == \
                   (ref.kind, ref.dtype, ref.global_shape, ref.local_shape, ref.placements, ref.mesh_shape), key
            a, b = local_tensor(fast[key]), local_tensor(reference[key])
            assert a.dtype == b.dtype and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), key
        # Ties (two keys, one storage) are seen the same way by both readers.
        ties = lambda entries: sorted(sorted(k for k, e in entries.items() if e.storage_id == sid)  # noqa: E731
                                      for sid in {e.storage_id for e in entries.values() if e.storage_id[0]})
        assert ties(fast_entries) == ties(ref_entries)
        assert any(isinstance(v, ShardedValue) for v in fast.values()) != plain


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_unknown_global_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "model_world_size_1_rank_0.pt"
    torch.save({"w": torch.zeros(2), "evil": _Payload(marker)}, path)
    with pytest.raises(NotFastReadable, match="posix.system|os.system"):
        read_rank_file(path)
    with pytest.raises(UnsafeCheckpointError):
        load_rank_state(path)
    assert not marker.exists()


def test_a_damaged_pickle_fails_its_crc_in_the_fast_reader(tmp_path: Path) -> None:
    path = tmp_path / "model_world_size_1_rank_0.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    with zipfile.ZipFile(path) as archive:
        pickle_name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
    raw = bytearray(path.read_bytes())
    start = raw.find(b"\x80\x02")  # the pickle's PROTO opcode
    raw[start + 2 : start + 6] = b"\xff\xff\xff\xff"
    path.write_bytes(bytes(raw))
    assert pickle_name
    with pytest.raises(CheckpointError, match="damaged"):  # not a fallback to torch, which reads it unchecked
        read_rank_file(path)
    with pytest.raises(CheckpointError, match="is damaged: record .*data.pkl fails its CRC-32 check") as info:
        load_rank_state(path)
    assert not isinstance(info.value, UnsafeCheckpointError) and "--trust-checkpoint" not in str(info.value)


def test_a_damaged_rank_file_is_called_damaged_never_a_reason_to_trust_it(tmp_path: Path) -> None:
    """Bytes flipped anywhere in the pickle of a real rank file: refused as damaged, naming the record."""
    model = build_transformer("FluxTransformer2DModel", seed=0)
    actor = save_fsdp_checkpoint(model, tmp_path / "actor", 2, write_extra_state=False)
    path = actor / "model_world_size_2_rank_1.pt"
    pristine = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    # The record's bytes start after its local header (30 bytes + name + extra field).
    name_len, extra_len = (int.from_bytes(pristine[info.header_offset + k:info.header_offset + k + 2], "little")
                           for k in (26, 28))
    start = info.header_offset + 30 + name_len + extra_len
    tried = 0
    for offset in range(start + 3, start + info.file_size - 1, max(1, info.file_size // 25)):
        raw = bytearray(pristine)
        raw[offset] ^= 0x5A
        path.write_bytes(bytes(raw))
        with pytest.raises(CheckpointError) as refused:
            load_rank_state(path)
        message = str(refused.value)
        assert "damaged" in message and "data.pkl" in message, message
        assert not isinstance(refused.value, UnsafeCheckpointError) and "--trust-checkpoint" not in message
        tried += 1
    assert tried >= 20


def test_a_view_past_its_storage_is_not_read() -> None:
    """`Tensor.set_` does not bound-check: the reader must, or a crafted file reads foreign memory."""
    from collections import OrderedDict

    from mergeflow.formats.rank_pickle import _rebuild_tensor_v2, _Storage

    storage = _Storage(torch.UntypedStorage(16), torch.float32)  # room for 4 floats
    assert _rebuild_tensor_v2(storage, 2, (2,), (1,), False, OrderedDict()).shape == (2,)
    assert _rebuild_tensor_v2(storage, 0, (2, 2), (2, 1), False, OrderedDict()).shape == (2, 2)
    for offset, size, stride in [(0, (5,), (1,)), (3, (2,), (1,)), (0, (2, 2), (3, 1)), (-1, (1,), (1,)), (0, (2,), (-1,))]:
        with pytest.raises(NotFastReadable):
            _rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())
