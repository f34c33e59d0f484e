"""Rank files written by REAL FSDP1 (`FullyShardedDataParallel`, gloo, a device mesh), merged bit for bit.

The other "FSDP_version 1" tests relabel FSDP2 files; these come from tests/fixtures/fsdp1_writers.py,
which trains one step under FSDP1 and saves each rank's SHARDED_STATE_DICT as verl does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import forked_cli
import pytest
import torch
from builders import assert_bit_exact, output_state
from torch.distributed.tensor import DTensor, Replicate, Shard

from mergeflow import ModelMergerConfig, merge_model, validate_artifact
from mergeflow.demo.checkpoints import build_transformer, perturb_
from mergeflow.export.describe import describe_checkpoint
from mergeflow.export.reconstruct.layout import chunk_sizes
from mergeflow.formats import rank_pickle
from mergeflow.formats.rank_files import describe_state
from tests.fixtures.fsdp1_writers import Fsdp1Checkpoint, write_fsdp1_checkpoint

# Each variant is written once per module (a few seconds of gloo ranks each).


@pytest.fixture(scope="module")
def full_shard(tmp_path_factory: pytest.TempPathFactory) -> Fsdp1Checkpoint:
    """FULL_SHARD over 3 ranks: Flux's 10-row norms shard 4/4/2 and its 2-row proj_out 1/1/0."""
    return write_fsdp1_checkpoint(tmp_path_factory.mktemp("fsdp1-full3"), strategy="FULL_SHARD", world_size=3)


@pytest.fixture(scope="module")
def hybrid_shard(tmp_path_factory: pytest.TempPathFactory) -> Fsdp1Checkpoint:
    """HYBRID_SHARD on a 2x2 ("ddp", "fsdp") mesh, trained under bf16 mixed precision."""
    return write_fsdp1_checkpoint(tmp_path_factory.mktemp("fsdp1-hsdp2x2"), strategy="HYBRID_SHARD", world_size=4,
                                  bf16_mixed_precision=True)


@pytest.fixture(params=["full_shard", "hybrid_shard"])
def fsdp1(request: pytest.FixtureRequest) -> Fsdp1Checkpoint:
    return request.getfixturevalue(request.param)


def _fsdp_coordinate(ckpt: Fsdp1Checkpoint, rank: int) -> int:
    """The rank's place on the mesh's last ("fsdp") dimension: which torch.chunk piece it holds."""
    return rank % ckpt.mesh_shape[-1]


def test_rank_files_hold_what_real_fsdp1_writes(fsdp1: Fsdp1Checkpoint) -> None:
    want_placements = (Shard(0),) if fsdp1.strategy == "FULL_SHARD" else (Replicate(), Shard(0))
    shards = fsdp1.mesh_shape[-1]
    pieces: dict[str, dict[int, torch.Tensor]] = {key: {} for key in fsdp1.trained}
    for rank in range(fsdp1.world_size):
        state = torch.load(fsdp1.rank_file(rank), map_location="cpu", weights_only=True)
        # Clean names: FSDP1's SHARDED_STATE_DICT strips `_fsdp_wrapped_module.` (every block is wrapped).
        assert set(state) == set(fsdp1.trained) == set(fsdp1.base)
        storages: set[int] = set()
        for key, value in state.items():
            assert isinstance(value, DTensor), key
            assert value.placements == want_placements, key
            assert value.device_mesh.mesh_dim_names == fsdp1.mesh_dim_names, key
            assert tuple(value.device_mesh.shape) == fsdp1.mesh_shape, key
            # Masters stay float32 even when training ran in bf16 mixed precision.
            assert value.dtype == torch.float32 and value.shape == fsdp1.trained[key].shape, key
            local = value.to_local()
            rows = chunk_sizes(value.shape[0], shards)[_fsdp_coordinate(fsdp1, rank)]
            assert tuple(local.shape) == (rows, *value.shape[1:]), key
            # What tells FSDP1 from FSDP2: each local shard is its own compact storage, not a view
            # into a padded flat buffer (FSDP2's uneven shards carry the padding in their storage).
            assert local.is_contiguous() and local.storage_offset() == 0, key
            assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), key
            if local.numel():
                assert local.untyped_storage().data_ptr() not in storages, f"{key} shares a storage"
                storages.add(local.untyped_storage().data_ptr())
            coordinate = _fsdp_coordinate(fsdp1, rank)
            if coordinate in pieces[key]:  # an HSDP replica: the same bytes as its twin
                assert torch.equal(pieces[key][coordinate], local), key
            pieces[key][coordinate] = local
    # The pieces are torch.chunk of the trained (torch-gathered FULL_STATE_DICT) weights.
    for key, by_coordinate in pieces.items():
        whole = torch.cat([by_coordinate[c] for c in range(shards)])
        assert torch.equal(whole, fsdp1.trained[key]), key


def test_the_fixtures_have_uneven_and_empty_shards_and_really_trained(full_shard: Fsdp1Checkpoint,
                                                                    hybrid_shard: Fsdp1Checkpoint) -> None:
    sizes = [chunk_sizes(v.shape[0], 3) for v in full_shard.trained.values()]
    assert any(s[-1] == 0 for s in sizes), "FULL_SHARD W=3 must hold an empty trailing shard"
    assert any(len(set(s)) > 1 and s[-1] > 0 for s in sizes), "FULL_SHARD W=3 must hold uneven shards"
    perturbed = build_transformer(full_shard.class_name, seed=0)
    perturb_(perturbed, seed=1)
    for ckpt in (full_shard, hybrid_shard):
        # The SGD step inside FSDP1 moved (nearly) every weight away from what went in.
        moved = [k for k, v in perturbed.state_dict().items() if not torch.equal(v, ckpt.trained[k])]
        assert len(moved) > 0.9 * len(ckpt.trained)
        assert {v.dtype for v in ckpt.trained.values()} == {torch.float32}
    # bf16 compute and fp32 compute take different steps from the same start.
    assert any(not torch.equal(full_shard.trained[k], hybrid_shard.trained[k]) for k in full_shard.trained)


def test_mergeflow_reads_them_with_its_closed_fast_reader(fsdp1: Fsdp1Checkpoint) -> None:
    code = "S0" if fsdp1.strategy == "FULL_SHARD" else "R S0"
    for rank in range(fsdp1.world_size):
        name = fsdp1.rank_file(rank).name
        fast = rank_pickle.read_rank_file(fsdp1.rank_file(rank))  # NotFastReadable would mean the slow path
        assert all(isinstance(v, rank_pickle.ShardedValue) for v in fast.values())
        slow = torch.load(fsdp1.rank_file(rank), map_location="cpu", weights_only=True)
        for key, entry in describe_state(fast, name).items():
            assert " ".join(entry.placements) == code and entry.mesh_shape == fsdp1.mesh_shape, key
            assert torch.equal(fast[key].local, slow[key].to_local()), key


def test_merge_is_bit_exact_and_passes_validation(fsdp1: Fsdp1Checkpoint, tmp_path: Path,
                                                  prefect_api: object) -> None:
    config = ModelMergerConfig(operation="merge", local_dir=str(fsdp1.actor_dir), base_model=str(fsdp1.base_dir),
                               target_dir=str(tmp_path / "out"), output_format="transformer")
    result = merge_model(config)
    out = Path(result.output_dir)
    assert_bit_exact(fsdp1.trained, output_state(out))
    assert validate_artifact(out) == {"integrity": "passed", "architecture": fsdp1.class_name}
    manifest = json.loads(Path(result.manifest_path).read_text())
    ranks = {fsdp1.rank_file(r).name for r in range(fsdp1.world_size)}
    assert set(manifest["source_files"]) == ranks | {"fsdp_config.json"}
    for name in ranks:
        assert manifest["source_files"][name] == hashlib.sha256((fsdp1.actor_dir / name).read_bytes()).hexdigest()


def test_the_command_line_merges_tests_and_inspects_an_fsdp1_checkpoint(hybrid_shard: Fsdp1Checkpoint,
                                                                         tmp_path: Path, prefect_server) -> None:  # type: ignore[no-untyped-def]
    env = prefect_server.client_env()
    target = tmp_path / "out"
    proc = forked_cli.mergeflow(["merge", "--backend", "fsdp", "--local_dir", str(hybrid_shard.actor_dir),
                                 "--target_dir", str(target), "--base_model", str(hybrid_shard.base_dir),
                                 "--output_format", "transformer"], env)
    assert proc.returncode == 0, proc.stderr
    assert_bit_exact(hybrid_shard.trained, output_state(target))
    proc = forked_cli.mergeflow(["test", "--backend", "fsdp", "--test_hf_dir", str(target)], env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"integrity": "passed",
                                                                "architecture": hybrid_shard.class_name}
    proc = forked_cli.mergeflow(["inspect", "--local_dir", str(hybrid_shard.actor_dir)], env)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (info["layout"], info["fsdp_version"], info["world_size"]) == ("HSDP", 1, 4)


def test_inspect_reports_the_layout(fsdp1: Fsdp1Checkpoint) -> None:
    info = describe_checkpoint(fsdp1.actor_dir)
    assert info["layout"] == ("FSDP1" if fsdp1.strategy == "FULL_SHARD" else "HSDP")
    assert (info["world_size"], info["fsdp_version"]) == (fsdp1.world_size, 1)
    assert info["tensors"] == len(fsdp1.trained) and info["dtypes"] == {"float32": len(fsdp1.trained)}
    assert info["bytes"] == sum(v.numel() * v.element_size() for v in fsdp1.trained.values())
    assert info["class_name"] == fsdp1.class_name and info["lora_adapters"] == []
