"""SPEC section 6: every bad input gets one clear error and nothing is published or lost.

Each refusal is tested on the plain domain steps (builders.plain_export: build_plan -> index the
rank files -> plan the writes -> write shards -> hash -> metadata -> validate -> publish, no
Prefect), which also checks at which step it is refused. A few run the real flow end to end
(bottom of the file): one refused at inspect, one during the shard writes (staging kept and
reported), and the trusted-load case that depends on the flow's task cache keys.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from builders import (
    Export,
    PlainRun,
    clone_export,
    expect_refusal,
    leftovers,
    make_export,
    plain_export,
    tree_digest,
)
from builders import assert_nothing_published as _assert_nothing_published
from rank_tools import replace_rank, rewrite_rank, save_custom_ranks
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial, _StridedShard

from mergeflow import errors as E

FLUX = "FluxTransformer2DModel"


def expect_flow_refusal(ex: Export, error: type[Exception], match: str | None = None, **overrides: object) -> Exception:
    """Run the real flow; it must raise `error`, publish nothing, and leave no lock or stray files."""
    from mergeflow import merge_model

    target = Path(str(overrides.pop("target", ex.root / "out")))
    inputs_before = tree_digest(ex.actor_dir.parent), tree_digest(ex.base_dir)
    with pytest.raises(error, match=match) as info:
        merge_model(ex.config(target, **overrides))
    _assert_nothing_published(ex, target, info.value, inputs_before)
    return info.value


# Built once per module with torch; tests edit copies (clone_export), never these.


@pytest.fixture(scope="module")
def pristine4(tmp_path_factory: pytest.TempPathFactory) -> Export:
    return make_export(tmp_path_factory.mktemp("w4"), FLUX, 4)


@pytest.fixture(scope="module")
def pristine1(tmp_path_factory: pytest.TempPathFactory) -> Export:
    """A W=1 plain checkpoint: easy to edit tensor by tensor."""
    return make_export(tmp_path_factory.mktemp("w1"), FLUX, 1, plain=True)


@pytest.fixture()
def ex(pristine4: Export, tmp_path: Path) -> Export:
    return clone_export(pristine4, tmp_path / "ck")


@pytest.fixture()
def ex1(pristine1: Export, tmp_path: Path) -> Export:
    return clone_export(pristine1, tmp_path / "ck")


def rank_path(ex: Export, rank: int, world: int = 4) -> Path:
    return ex.actor_dir / f"model_world_size_{world}_rank_{rank}.pt"


def test_the_plain_steps_publish_a_good_checkpoint(ex: Export) -> None:
    """The baseline of every test below: unedited inputs go through every step."""
    run = PlainRun()
    result = plain_export(ex.config(), run)
    assert run.stage == "done" and Path(result["output_dir"]).is_dir()
    assert leftovers(ex.root, ".out.") == []


# --- rank file set and fsdp_config.json -------------------------------------------------


def test_missing_rank_file(ex: Export) -> None:
    rank_path(ex, 2).unlink()
    expect_refusal(ex, E.CheckpointError, "missing", stage="inspect")


def test_stale_rank_file_of_another_world_size(ex: Export) -> None:
    (ex.actor_dir / "model_world_size_2_rank_0.pt").write_bytes(rank_path(ex, 0).read_bytes())
    expect_refusal(ex, E.CheckpointError, "unexpected rank file", stage="inspect")


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
def test_bad_fsdp_config(ex: Export, content: str | None, match: str) -> None:
    path = ex.actor_dir / "fsdp_config.json"
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    expect_refusal(ex, E.CheckpointError, match, stage="inspect")


# --- damaged or hostile rank files ---------------------------------------------------------


def test_truncated_rank_file(ex: Export) -> None:
    data = rank_path(ex, 1).read_bytes()
    rank_path(ex, 1).write_bytes(data[: len(data) // 2])
    expect_refusal(ex, E.CheckpointError, "truncated or damaged|is damaged", stage="index")


def test_corrupt_rank_file(ex: Export) -> None:
    rank_path(ex, 3).write_bytes(os.urandom(4096))
    expect_refusal(ex, E.CheckpointError, "damaged", stage="index")


def test_non_dict_rank_file(ex: Export) -> None:
    replace_rank(rank_path(ex, 2), lambda state: list(state.values()))
    expect_refusal(ex, E.CheckpointError, "not a state dict", stage="index")


def test_rank_zero_is_opened_at_inspect(ex: Export) -> None:
    """build_plan reads rank 0's keys (LoRA detection), so a broken rank 0 is refused before any task."""
    replace_rank(rank_path(ex, 0), lambda state: list(state.values()))
    expect_refusal(ex, E.CheckpointError, "not a state dict", stage="inspect")


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_never_executed(ex: Export) -> None:
    marker = ex.root / "pwned"
    rewrite_rank(rank_path(ex, 1), lambda state: state.update({"evil": _Boom(str(marker))}))
    err = expect_refusal(ex, E.UnsafeCheckpointError, "--trust-checkpoint", stage="index")
    assert not marker.exists(), "the malicious pickle ran"
    assert "arbitrary code" in str(err)


def test_key_sets_differ_between_ranks(ex: Export) -> None:
    rewrite_rank(rank_path(ex, 2), lambda state: state.pop(min(state)))
    expect_refusal(ex, E.CheckpointError, "different key sets", stage="reconstruct")


def test_mixed_dtensor_and_plain_for_one_key(ex: Export) -> None:
    def to_plain(state: dict) -> None:
        key = next(k for k, v in state.items() if isinstance(v, DTensor))
        state[key] = state[key].to_local().clone()

    rewrite_rank(rank_path(ex, 1), to_plain)
    expect_refusal(ex, E.CheckpointError, "DTensor on some ranks and a plain tensor", stage="reconstruct")


def test_swapped_rank_files_break_chunk_arithmetic(ex: Export) -> None:
    a, b = rank_path(ex, 0).read_bytes(), rank_path(ex, 3).read_bytes()
    rank_path(ex, 0).write_bytes(b)
    rank_path(ex, 3).write_bytes(a)
    expect_refusal(ex, E.ShardLayoutError, "torch.chunk", stage="reconstruct")


def test_non_finite_weight(ex: Export) -> None:
    def poison(state: dict) -> None:
        key = next(k for k, v in state.items() if isinstance(v, DTensor) and v.to_local().numel())
        state[key].to_local().view(-1)[0] = float("nan")

    rewrite_rank(rank_path(ex, 0), poison)
    err = expect_refusal(ex, E.CheckpointError, "inf or nan", stage="write")
    assert "(rank 0)" in str(err), str(err)  # the rank whose file holds it, not a position among shards
    # A rerun cannot succeed on this input: the shards written so far are removed, not kept for a resume.
    assert err.staging_dir is None and leftovers(ex.root, ".out.") == []  # type: ignore[attr-defined]


def test_replicas_that_disagree(tmp_path: Path) -> None:
    ex = make_export(tmp_path, FLUX, 4, mesh_shape=(2, 2))  # the only HSDP checkpoint of this module

    def nudge(state: dict) -> None:
        key = next(k for k, v in state.items() if isinstance(v, DTensor) and v.to_local().numel())
        state[key].to_local().view(-1)[0] += 1.0

    rewrite_rank(rank_path(ex, 3), nudge)  # rank 3 = replica row 1 of rank 1's chunk
    expect_refusal(ex, E.CheckpointError, "identical replicas", stage="write")


def _plain_ranks(ex1: Export, states: list[dict]) -> None:
    """Replace ex1's single rank file with len(states) plain rank files."""
    (ex1.actor_dir / "model_world_size_1_rank_0.pt").unlink()
    for rank, state in enumerate(states):
        torch.save(state, ex1.actor_dir / f"model_world_size_{len(states)}_rank_{rank}.pt")
    (ex1.actor_dir / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": len(states)}))


def test_plain_shards_that_are_not_full_replicas(ex1: Export) -> None:
    """Each rank saved its own torch.chunk piece as a plain tensor (no DTensor): not replicas."""
    full = torch.load(ex1.actor_dir / "model_world_size_1_rank_0.pt", weights_only=True)
    halves = [{k: (v.chunk(2)[rank].clone() if v.dim() and v.shape[0] > 1 else v.clone()) for k, v in full.items()}
              for rank in range(2)]
    key = next(k for k, v in sorted(halves[1].items()) if v.dim() and v.shape[0] > 1)
    halves[1][key] = halves[1][key][:-1].clone()  # the short last piece of an odd-sized dim
    _plain_ranks(ex1, halves)
    expect_refusal(ex1, E.CheckpointError, "not a full replica", stage="reconstruct")


def test_plain_replicas_that_disagree(ex1: Export) -> None:
    state = torch.load(ex1.actor_dir / "model_world_size_1_rank_0.pt", weights_only=True)
    copies = [{k: v.clone() for k, v in state.items()} for _ in range(2)]
    copies[1][min(copies[1])].view(-1)[0] += 1.0
    _plain_ranks(ex1, copies)
    expect_refusal(ex1, E.CheckpointError, "identical replicas", stage="write")


def _custom(ex: Export, world: int, make: Callable, **mesh: object) -> None:
    for p in ex.actor_dir.glob("model_world_size_*"):
        p.unlink()
    save_custom_ranks(ex.actor_dir, world, make, **mesh)  # type: ignore[arg-type]


def test_partial_placement(ex1: Export) -> None:
    def make(rank: int, mesh) -> dict:  # type: ignore[no-untyped-def]
        return {"x": DTensor.from_local(torch.ones(4, 3), mesh, [Partial()], run_check=False)}

    _custom(ex1, 2, make)
    expect_refusal(ex1, E.ShardLayoutError, "only Shard", stage="index")


def test_strided_placement(ex1: Export) -> None:
    """_StridedShard subclasses Shard (FSDP2 + TP saves it); its pieces are not torch.chunk pieces."""
    def make(rank: int, mesh) -> dict:  # type: ignore[no-untyped-def]
        return {"x": DTensor.from_local(torch.ones(2, 3), mesh, [_StridedShard(0, split_factor=2)], run_check=False,
                                        shape=(4, 3), stride=(3, 1))}

    _custom(ex1, 2, make)
    err = expect_refusal(ex1, E.ShardLayoutError, "only Shard", stage="index")
    assert "_S(" in str(err) or "Strided" in str(err), err


def test_tensor_parallel_mesh(ex1: Export) -> None:
    def make(rank: int, mesh) -> dict:  # type: ignore[no-untyped-def]
        return {"x": DTensor.from_local(torch.ones(2, 3), mesh, [Replicate(), Shard(0)], run_check=False, shape=(4, 3), stride=(3, 1))}

    _custom(ex1, 4, make, mesh_shape=(2, 2), mesh_dim_names=("fsdp", "tp"))
    expect_refusal(ex1, E.ShardLayoutError, "tensor/context", stage="index")


def test_dtype_disagreement_across_ranks(ex1: Export) -> None:
    def make(rank: int, mesh) -> dict:  # type: ignore[no-untyped-def]
        dtype = torch.float16 if rank == 1 else torch.float32
        return {"x": DTensor.from_local(torch.ones(2, 3, dtype=dtype), mesh, [Shard(0)], run_check=False, shape=(4, 3), stride=(3, 1))}

    _custom(ex1, 2, make)
    expect_refusal(ex1, E.CheckpointError, "different dtypes", stage="reconstruct")


# --- checkpoint vs base --------------------------------------------------------------------


def _edit_plain(ex1: Export, change: Callable[[dict], None]) -> None:
    rewrite_rank(ex1.actor_dir / "model_world_size_1_rank_0.pt", change)


def test_missing_tensor(ex1: Export) -> None:
    _edit_plain(ex1, lambda s: s.pop(max(s)))
    expect_refusal(ex1, E.SchemaMismatchError, "lacks 1 tensor", stage="reconstruct")


def test_extra_tensor(ex1: Export) -> None:
    _edit_plain(ex1, lambda s: s.update({"surprise.weight": torch.ones(2)}))
    expect_refusal(ex1, E.SchemaMismatchError, "the base model does not", stage="reconstruct")


def test_shape_mismatch(ex1: Export) -> None:
    def change(s: dict) -> None:
        key = next(k for k, v in sorted(s.items()) if v.dim() == 2)
        s[key] = torch.zeros(s[key].shape[0], s[key].shape[1] + 1)

    _edit_plain(ex1, change)
    expect_refusal(ex1, E.SchemaMismatchError, "has shape", stage="reconstruct")


def test_config_field_mismatch(ex1: Export) -> None:
    path = ex1.actor_dir / "huggingface" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["axes_dims_rope"] = list(reversed(cfg["axes_dims_rope"]))
    path.write_text(json.dumps(cfg))
    expect_refusal(ex1, E.SchemaMismatchError, "axes_dims_rope", stage="inspect")


def test_unknown_architecture(ex1: Export) -> None:
    for path in (ex1.base_dir / "config.json", ex1.actor_dir / "huggingface" / "config.json"):
        cfg = json.loads(path.read_text())
        cfg["_class_name"] = "MysteryTransformer9000"
        path.write_text(json.dumps(cfg))
    expect_refusal(ex1, E.BaseModelError, "unknown model class", stage="inspect")


def test_unknown_pipeline_class(ex1: Export) -> None:
    (ex1.base_dir / "model_index.json").write_text(json.dumps({"_class_name": "MysteryPipeline", "transformer": ["diffusers", "X"]}))
    expect_refusal(ex1, E.BaseModelError, "unknown pipeline class", stage="inspect")


def test_incomplete_base(ex1: Export) -> None:
    (ex1.base_dir / "diffusion_pytorch_model.safetensors").unlink()
    expect_refusal(ex1, E.BaseModelError, "incomplete", stage="inspect")


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.safetensors", "sub\\x.safetensors"], ids=["absolute", "dotdot", "backslash"])
def test_unsafe_paths_in_base_index(ex1: Export, name: str) -> None:
    single = ex1.base_dir / "diffusion_pytorch_model.safetensors"
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        keys = list(f.keys())
    single.rename(ex1.base_dir / "part.safetensors")
    index = {"metadata": {"total_size": 1}, "weight_map": {k: name for k in keys}}
    (ex1.base_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    expect_refusal(ex1, E.PathSafetyError, stage="inspect")


# --- targets, overlap, concurrency-free refusals --------------------------------------------


def test_existing_target_is_never_overwritten(pristine1: Export, tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    run = PlainRun()
    with pytest.raises(E.TargetExistsError):
        plain_export(pristine1.config(target), run)
    assert run.stage == "inspect"
    assert (target / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]


def test_target_parent_must_exist(pristine1: Export, tmp_path: Path) -> None:
    run = PlainRun()
    with pytest.raises(E.UsageError, match="parent"):
        plain_export(pristine1.config(tmp_path / "no" / "such" / "out"), run)
    assert run.stage == "inspect" and not (tmp_path / "no").exists()


@pytest.mark.parametrize("where", ["inside-actor", "inside-base", "actor-inside-base"])
def test_overlapping_directories(ex1: Export, where: str) -> None:
    if where == "actor-inside-base":
        moved = ex1.base_dir / "ckpt"
        shutil.copytree(ex1.actor_dir, moved)
        run = PlainRun()
        with pytest.raises(E.PathSafetyError, match="overlap"):
            plain_export(ex1.config(ex1.root / "out", local_dir=str(moved)), run)
        assert run.stage == "inspect" and not (ex1.root / "out").exists()
        return
    target = {"inside-actor": ex1.actor_dir / "out", "inside-base": ex1.base_dir / "out"}[where]
    expect_refusal(ex1, E.PathSafetyError, "overlap", target=target, stage="inspect")


def test_cast_that_overflows(ex1: Export) -> None:
    def big(s: dict) -> None:
        key = next(k for k, v in sorted(s.items()) if v.dim() == 2 and "norm" not in k)
        s[key].view(-1)[0] = 1e6

    _edit_plain(ex1, big)
    expect_refusal(ex1, E.CastError, "overflows", dtype="float16", stage="write")


@contextmanager
def _touch_during_writes(victim: Path) -> Iterator[None]:
    """Listen to the export's shard writes and change `victim`'s mtime at each: an input changed mid-export."""
    from mergeflow.io.session import export_session

    with export_session() as session, session.writes.listening(lambda nbytes, ntensors: os.utime(victim, ns=(1, 1))):
        yield  # the export run in this block is this session's (plain_export finds it set)


def test_input_modified_during_export(ex: Export) -> None:
    with _touch_during_writes(rank_path(ex, 0)):
        err = expect_refusal(ex, E.InputChangedError, "changed during the export", stage="hash")
    # Work built from the old bytes is no use to the rerun (it starts afresh once the input is stable).
    assert err.staging_dir is None and leftovers(ex.root, ".out.") == []


def test_disk_full_while_writing_a_shard(ex1: Export, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from the write path becomes one DiskFullError line that keeps the staging (the CLI case: test_cli)."""
    from mergeflow.export.write import shard_writer as write

    def full(self, data) -> int:  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(write.HashingWriter, "write", full)
    err = expect_refusal(ex1, E.DiskFullError, "no space left", stage="write")
    assert isinstance(err, OSError) and err.staging_dir and "resume" in str(err)  # type: ignore[attr-defined]


class _Harmless:
    pass


def test_unsafe_loader_rejects_but_trust_allows_a_harmless_custom_object(ex1: Export) -> None:
    """--trust-checkpoint permits full unpickling; the content is still checked strictly."""
    _edit_plain(ex1, lambda s: s.update({"meta": pickle.loads(pickle.dumps(_Harmless()))}))
    expect_refusal(ex1, E.UnsafeCheckpointError, "--trust-checkpoint", stage="inspect")  # rank 0: read at inspect
    expect_refusal(ex1, E.CheckpointError, "not a tensor", trust_checkpoint=True, stage="index")


def test_a_trusted_parse_is_never_reused_without_trust(ex1: Export) -> None:
    """Parsed rank files are shared within an export (RankStates); one that needed --trust-checkpoint is not."""
    from mergeflow.io.session import export_session
    from mergeflow.sources.verl_ranks import RankStates

    _edit_plain(ex1, lambda s: s.update({"meta": pickle.loads(pickle.dumps(_Harmless()))}))
    names = ("model_world_size_1_rank_0.pt",)
    with export_session():  # one export: its RankStates share one cache
        assert "meta" in RankStates(ex1.actor_dir, names, trust_checkpoint=True).state(0)
        with pytest.raises(E.UnsafeCheckpointError):
            RankStates(ex1.actor_dir, names).state(0)


# --- the real flow end to end (Prefect server, task runner, task caches) -------------------


def test_flow_refuses_at_inspect(ex: Export, prefect_api: object) -> None:
    rank_path(ex, 2).unlink()
    expect_flow_refusal(ex, E.CheckpointError, "missing")


def test_flow_removes_the_staging_of_an_input_refusal_during_the_writes(ex: Export, prefect_api: object) -> None:
    """The real flow: an input refused mid-export leaves no staging (resumable failures keep it: test_disk_full)."""
    with _touch_during_writes(rank_path(ex, 0)):
        err = expect_flow_refusal(ex, E.InputChangedError, "changed during the export")
    assert err.staging_dir is None and leftovers(ex.root, ".out.") == []


def test_flow_never_reuses_a_trusted_load_without_trust(ex1: Export, prefect_api: object) -> None:
    """The load-rank task's cached results and the shared parsed states both key on --trust-checkpoint."""
    _edit_plain(ex1, lambda s: s.update({"meta": pickle.loads(pickle.dumps(_Harmless()))}))
    expect_flow_refusal(ex1, E.CheckpointError, "not a tensor", trust_checkpoint=True)
    expect_flow_refusal(ex1, E.UnsafeCheckpointError)
