"""SPEC section 6: every bad input gets one clear error and nothing is published or lost."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial

from builders import Export, leftovers, make_export, tree_digest
from mergeflow import merge_model
from mergeflow import errors as E
from rank_tools import replace_rank, rewrite_rank, save_custom_ranks


def expect_refusal(ex: Export, error: type[Exception], match: str | None = None, **overrides: object) -> Exception:
    """Run the real flow; it must raise `error`, publish nothing, and leave no lock or stray files."""
    target = Path(str(overrides.pop("target", ex.root / "out")))
    inputs_before = tree_digest(ex.actor_dir.parent), tree_digest(ex.base_dir)
    with pytest.raises(error, match=match) as info:
        merge_model(ex.config(target, **overrides))
    assert not target.exists() or target.is_dir() and overrides.get("_allow_target"), "a target was published"
    staging = getattr(info.value, "staging_dir", None)
    left = leftovers(target.parent, f".{target.name}.")
    assert all(".mergeflow-staging-" in name for name in left), left
    if left:
        assert staging is not None and Path(staging).name in left, "staging kept but not reported"
    assert (tree_digest(ex.actor_dir.parent), tree_digest(ex.base_dir)) == inputs_before, "inputs were modified"
    assert "\n" not in str(info.value)
    return info.value


@pytest.fixture()
def ex(tmp_path: Path) -> Export:
    return make_export(tmp_path, "FluxTransformer2DModel", 4)


@pytest.fixture()
def ex1(tmp_path: Path) -> Export:
    """A W=1 plain checkpoint: easy to edit tensor by tensor."""
    return make_export(tmp_path, "FluxTransformer2DModel", 1, plain=True)


def rank_path(ex: Export, rank: int, world: int = 4) -> Path:
    return ex.actor_dir / f"model_world_size_{world}_rank_{rank}.pt"


# --- rank file set and fsdp_config.json -------------------------------------------------


def test_missing_rank_file(ex: Export, prefect_api: object) -> None:
    rank_path(ex, 2).unlink()
    expect_refusal(ex, E.CheckpointError, "missing")


def test_stale_rank_file_of_another_world_size(ex: Export, prefect_api: object) -> None:
    (ex.actor_dir / "model_world_size_2_rank_0.pt").write_bytes(rank_path(ex, 0).read_bytes())
    expect_refusal(ex, E.CheckpointError, "unexpected rank file")


@pytest.mark.parametrize(
    "content,match",
    [
        (None, "missing"),
        ("{not json", "not valid JSON"),
        ('{"FSDP_version": 2, "world_size": "4"}', "must be an integer"),
        ('{"FSDP_version": 2, "world_size": true}', "must be an integer"),
        ('{"FSDP_version": 2, "world_size": 4, "world_size": 2}', "duplicate key"),
        ('{"world_size": 4}', "FSDP_version"),
        ("[2, 4]", "JSON object"),
    ],
    ids=["missing", "malformed", "string", "bool", "duplicate", "no-version", "array"],
)
def test_bad_fsdp_config(ex: Export, prefect_api: object, content: str | None, match: str) -> None:
    path = ex.actor_dir / "fsdp_config.json"
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    expect_refusal(ex, E.CheckpointError, match)


# --- damaged or hostile rank files ---------------------------------------------------------


def test_truncated_rank_file(ex: Export, prefect_api: object) -> None:
    data = rank_path(ex, 1).read_bytes()
    rank_path(ex, 1).write_bytes(data[: len(data) // 2])
    expect_refusal(ex, E.CheckpointError, "truncated or corrupt")


def test_corrupt_rank_file(ex: Export, prefect_api: object) -> None:
    rank_path(ex, 3).write_bytes(os.urandom(4096))
    expect_refusal(ex, E.CheckpointError, "corrupt")


def test_non_dict_rank_file(ex: Export, prefect_api: object) -> None:
    replace_rank(rank_path(ex, 0), lambda state: list(state.values()))
    expect_refusal(ex, E.CheckpointError, "not a state dict")


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_never_executed(ex: Export, prefect_api: object) -> None:
    marker = ex.root / "pwned"
    rewrite_rank(rank_path(ex, 1), lambda state: state.update({"evil": _Boom(str(marker))}))
    err = expect_refusal(ex, E.UnsafeCheckpointError, "--trust-checkpoint")
    assert not marker.exists(), "the malicious pickle ran"
    assert "arbitrary code" in str(err)


def test_key_sets_differ_between_ranks(ex: Export, prefect_api: object) -> None:
    rewrite_rank(rank_path(ex, 2), lambda state: state.pop(sorted(state)[0]))
    expect_refusal(ex, E.CheckpointError, "different key sets")


def test_mixed_dtensor_and_plain_for_one_key(ex: Export, prefect_api: object) -> None:
    def to_plain(state: dict) -> None:
        key = next(k for k, v in state.items() if isinstance(v, DTensor))
        state[key] = state[key].to_local().clone()

    rewrite_rank(rank_path(ex, 1), to_plain)
    expect_refusal(ex, E.CheckpointError, "DTensor on some ranks and a plain tensor")


def test_swapped_rank_files_break_chunk_arithmetic(ex: Export, prefect_api: object) -> None:
    a, b = rank_path(ex, 0).read_bytes(), rank_path(ex, 3).read_bytes()
    rank_path(ex, 0).write_bytes(b)
    rank_path(ex, 3).write_bytes(a)
    expect_refusal(ex, E.ShardLayoutError, "torch.chunk")


def test_non_finite_weight(ex: Export, prefect_api: object) -> None:
    def poison(state: dict) -> None:
        key = next(k for k, v in state.items() if isinstance(v, DTensor) and v.to_local().numel())
        state[key].to_local().view(-1)[0] = float("nan")

    rewrite_rank(rank_path(ex, 0), poison)
    expect_refusal(ex, E.CheckpointError, "inf or nan")


def test_replicas_that_disagree(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, "FluxTransformer2DModel", 4, mesh_shape=(2, 2))

    def nudge(state: dict) -> None:
        key = next(k for k, v in state.items() if isinstance(v, DTensor) and v.to_local().numel())
        state[key].to_local().view(-1)[0] += 1.0

    rewrite_rank(rank_path(ex, 3), nudge)  # rank 3 = replica row 1 of rank 1's chunk
    expect_refusal(ex, E.CheckpointError, "identical replicas")


def test_plain_shards_that_are_not_full_replicas(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, "FluxTransformer2DModel", 2)
    full = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in torch.load(rank_path(ex, 0, 2), weights_only=True).items()}
    for rank in range(2):
        torch.save({k: v.clone() for k, v in full.items()}, rank_path(ex, rank, 2))  # each rank: its own half, plain
    other = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in torch.load(rank_path(ex, 0, 2), weights_only=True).items()}
    state1 = {k: v.clone() for k, v in other.items()}
    key = next(k for k, v in state1.items() if v.dim() and v.shape[0] > 1)
    state1[key] = state1[key][:-1].clone()
    torch.save(state1, rank_path(ex, 1, 2))
    expect_refusal(ex, E.CheckpointError, "not a full replica")


def test_plain_replicas_that_disagree(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, "FluxTransformer2DModel", 1, plain=True)
    state = torch.load(ex.actor_dir / "model_world_size_1_rank_0.pt", weights_only=True)
    (ex.actor_dir / "model_world_size_1_rank_0.pt").unlink()
    for rank in range(2):
        copy = {k: v.clone() for k, v in state.items()}
        if rank == 1:
            copy[sorted(copy)[0]].view(-1)[0] += 1.0
        torch.save(copy, ex.actor_dir / f"model_world_size_2_rank_{rank}.pt")
    (ex.actor_dir / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2}))
    expect_refusal(ex, E.CheckpointError, "identical replicas")


def _custom(ex: Export, world: int, make: Callable, **mesh: object) -> None:
    for p in ex.actor_dir.glob("model_world_size_*"):
        p.unlink()
    save_custom_ranks(ex.actor_dir, world, make, **mesh)  # type: ignore[arg-type]


def test_partial_placement(ex1: Export, prefect_api: object) -> None:
    def make(rank: int, mesh) -> dict:  # type: ignore[no-untyped-def]
        return {"x": DTensor.from_local(torch.ones(4, 3), mesh, [Partial()], run_check=False)}

    _custom(ex1, 2, make)
    expect_refusal(ex1, E.ShardLayoutError, "only Shard")


def test_tensor_parallel_mesh(ex1: Export, prefect_api: object) -> None:
    def make(rank: int, mesh) -> dict:  # type: ignore[no-untyped-def]
        return {"x": DTensor.from_local(torch.ones(2, 3), mesh, [Replicate(), Shard(0)], run_check=False, shape=(4, 3), stride=(3, 1))}

    _custom(ex1, 4, make, mesh_shape=(2, 2), mesh_dim_names=("fsdp", "tp"))
    expect_refusal(ex1, E.ShardLayoutError, "tensor/context")


def test_dtype_disagreement_across_ranks(ex1: Export, prefect_api: object) -> None:
    def make(rank: int, mesh) -> dict:  # type: ignore[no-untyped-def]
        dtype = torch.float16 if rank == 1 else torch.float32
        return {"x": DTensor.from_local(torch.ones(2, 3, dtype=dtype), mesh, [Shard(0)], run_check=False, shape=(4, 3), stride=(3, 1))}

    _custom(ex1, 2, make)
    expect_refusal(ex1, E.CheckpointError, "different dtypes")


# --- checkpoint vs base --------------------------------------------------------------------


def _edit_plain(ex1: Export, change: Callable[[dict], None]) -> None:
    rewrite_rank(ex1.actor_dir / "model_world_size_1_rank_0.pt", change)


def test_missing_tensor(ex1: Export, prefect_api: object) -> None:
    _edit_plain(ex1, lambda s: s.pop(sorted(s)[-1]))
    expect_refusal(ex1, E.SchemaMismatchError, "lacks 1 tensor")


def test_extra_tensor(ex1: Export, prefect_api: object) -> None:
    _edit_plain(ex1, lambda s: s.update({"surprise.weight": torch.ones(2)}))
    expect_refusal(ex1, E.SchemaMismatchError, "the base model does not")


def test_shape_mismatch(ex1: Export, prefect_api: object) -> None:
    def change(s: dict) -> None:
        key = next(k for k, v in sorted(s.items()) if v.dim() == 2)
        s[key] = torch.zeros(s[key].shape[0], s[key].shape[1] + 1)

    _edit_plain(ex1, change)
    expect_refusal(ex1, E.SchemaMismatchError, "has shape")


def test_config_field_mismatch(ex1: Export, prefect_api: object) -> None:
    path = ex1.actor_dir / "huggingface" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["axes_dims_rope"] = list(reversed(cfg["axes_dims_rope"]))
    path.write_text(json.dumps(cfg))
    expect_refusal(ex1, E.SchemaMismatchError, "axes_dims_rope")


def test_unknown_architecture(ex1: Export, prefect_api: object) -> None:
    for path in (ex1.base_dir / "config.json", ex1.actor_dir / "huggingface" / "config.json"):
        cfg = json.loads(path.read_text())
        cfg["_class_name"] = "MysteryTransformer9000"
        path.write_text(json.dumps(cfg))
    expect_refusal(ex1, E.BaseModelError, "unknown model class")


def test_unknown_pipeline_class(ex1: Export, prefect_api: object) -> None:
    (ex1.base_dir / "model_index.json").write_text(json.dumps({"_class_name": "MysteryPipeline", "transformer": ["diffusers", "X"]}))
    expect_refusal(ex1, E.BaseModelError, "unknown pipeline class")


def test_incomplete_base(ex1: Export, prefect_api: object) -> None:
    (ex1.base_dir / "diffusion_pytorch_model.safetensors").unlink()
    expect_refusal(ex1, E.BaseModelError, "incomplete")


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.safetensors", "sub\\x.safetensors"], ids=["absolute", "dotdot", "backslash"])
def test_unsafe_paths_in_base_index(ex1: Export, prefect_api: object, name: str) -> None:
    single = ex1.base_dir / "diffusion_pytorch_model.safetensors"
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        keys = list(f.keys())
    single.rename(ex1.base_dir / "part.safetensors")
    index = {"metadata": {"total_size": 1}, "weight_map": {k: name for k in keys}}
    (ex1.base_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    expect_refusal(ex1, E.PathSafetyError)


# --- targets, overlap, concurrency-free refusals --------------------------------------------


def test_existing_target_is_never_overwritten(ex1: Export, prefect_api: object) -> None:
    target = ex1.root / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    with pytest.raises(E.TargetExistsError):
        merge_model(ex1.config(target))
    assert (target / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]


def test_target_parent_must_exist(ex1: Export, prefect_api: object) -> None:
    with pytest.raises(E.UsageError, match="parent"):
        merge_model(ex1.config(ex1.root / "no" / "such" / "out"))


@pytest.mark.parametrize("where", ["inside-actor", "inside-base", "actor-inside-base"])
def test_overlapping_directories(ex1: Export, prefect_api: object, where: str) -> None:
    if where == "actor-inside-base":
        import shutil

        moved = ex1.base_dir / "ckpt"
        shutil.copytree(ex1.actor_dir, moved)
        with pytest.raises(E.PathSafetyError, match="overlap"):
            merge_model(ex1.config(ex1.root / "out", local_dir=str(moved)))
        assert not (ex1.root / "out").exists()
        return
    target = {"inside-actor": ex1.actor_dir / "out", "inside-base": ex1.base_dir / "out"}[where]
    expect_refusal(ex1, E.PathSafetyError, "overlap", target=target)


def test_cast_that_overflows(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, "FluxTransformer2DModel", 1, plain=True)

    def big(s: dict) -> None:
        key = next(k for k, v in sorted(s.items()) if v.dim() == 2 and "norm" not in k)
        s[key].view(-1)[0] = 1e6

    rewrite_rank(ex.actor_dir / "model_world_size_1_rank_0.pt", big)
    expect_refusal(ex, E.CastError, "overflows", dtype="float16")


def test_input_modified_during_export(ex: Export, prefect_api: object) -> None:
    from mergeflow.export import shard_writer as write

    victim = rank_path(ex, 0)

    def touch(nbytes: int, ntensors: int) -> None:
        os.utime(victim, ns=(1, 1))

    write.PROGRESS_HOOKS.append(touch)
    try:
        err = expect_refusal(ex, E.InputChangedError, "changed during the export")
    finally:
        write.PROGRESS_HOOKS.remove(touch)
    assert getattr(err, "staging_dir", None)


def test_unsafe_loader_rejects_but_trust_allows_a_harmless_custom_object(ex1: Export, prefect_api: object) -> None:
    """--trust-checkpoint permits full unpickling; the content is still checked strictly."""
    _edit_plain(ex1, lambda s: s.update({"meta": pickle.loads(pickle.dumps(_Harmless()))}))
    expect_refusal(ex1, E.UnsafeCheckpointError)
    expect_refusal(ex1, E.CheckpointError, "not a tensor", trust_checkpoint=True)


def test_a_trusted_load_is_never_reused_without_trust(ex1: Export, prefect_api: object) -> None:
    """Parsed rank files are shared within a process; one that needed --trust-checkpoint is not."""
    from mergeflow.export.reconstruct import RankStates

    _edit_plain(ex1, lambda s: s.update({"meta": pickle.loads(pickle.dumps(_Harmless()))}))
    names = ("model_world_size_1_rank_0.pt",)
    assert "meta" in RankStates(ex1.actor_dir, names, trust_checkpoint=True).state(0)
    with pytest.raises(E.UnsafeCheckpointError):
        RankStates(ex1.actor_dir, names).state(0)
    expect_refusal(ex1, E.CheckpointError, "not a tensor", trust_checkpoint=True)
    expect_refusal(ex1, E.UnsafeCheckpointError)
    RankStates.forget(ex1.actor_dir)


class _Harmless:
    pass
