"""The synthetic checkpoint builders write what FSDP2 training writes, bit for bit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  (lets the safe loader rebuild DTensors)
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from mergeflow.demo.checkpoints import (
    TINY_TRANSFORMER_CONFIGS,
    DemoCheckpoint,
    build_demo_checkpoint,
    build_sized_checkpoint,
    build_transformer,
    perturb_,
    run_tiny_forward,
    save_base_transformer,
    save_fsdp_checkpoint,
)
from mergeflow.demo.sizing import state_dict_bytes
from mergeflow.demo.tiny_transformers import keeps_fp32
from mergeflow.errors import UsageError

CLASS_NAMES = sorted(TINY_TRANSFORMER_CONFIGS)
REQUIRED = {
    "FluxTransformer2DModel",
    "SD3Transformer2DModel",
    "QwenImageTransformer2DModel",
    "WanTransformer3DModel",
    "LTX2VideoTransformer3DModel",
    "MiniMaxH3Transformer3DModel",
}


def load_ranks(actor_dir: Path, world_size: int) -> list[dict[str, torch.Tensor]]:
    """Open every model rank file the way mergeflow does: mmap, safe unpickler, no process group."""
    return [
        torch.load(
            actor_dir / f"model_world_size_{world_size}_rank_{rank}.pt",
            map_location="cpu",
            mmap=True,
            weights_only=True,
        )
        for rank in range(world_size)
    ]


def assert_reconstructs(
    ranks: list[dict[str, torch.Tensor]],
    expected: dict[str, torch.Tensor],
    mesh_shape: tuple[int, int],
) -> set[tuple[int, ...]]:
    """Check that every replica row's rank-ordered local pieces rebuild `expected` exactly."""
    replicas, shards = mesh_shape
    placements = (Shard(0),) if replicas == 1 else (Replicate(), Shard(0))
    piece_rows: set[tuple[int, ...]] = set()
    for rank_sd in ranks:
        assert set(rank_sd) == set(expected)
    for name, full in expected.items():
        for row in range(replicas):
            pieces = [ranks[row * shards + col][name] for col in range(shards)]
            if full.ndim == 0 or not all(isinstance(p, DTensor) for p in pieces):
                # Buffers (including 0-d ones) are plain tensors, identical on every rank.
                for piece in pieces:
                    assert not isinstance(piece, DTensor)
                    assert piece.dtype == full.dtype and torch.equal(piece, full)
                continue
            for piece in pieces:
                assert piece.placements == placements
                assert piece.shape == full.shape
            local = [p.to_local() for p in pieces]
            chunks = torch.chunk(full, shards, dim=0)
            expected_rows = [c.shape[0] for c in chunks] + [0] * (shards - len(chunks))
            assert [t.shape[0] for t in local] == expected_rows, name
            rebuilt = torch.cat(local, dim=0)
            assert rebuilt.dtype == full.dtype and torch.equal(rebuilt, full), name
            piece_rows.add(tuple(expected_rows))
    return piece_rows


@pytest.fixture(autouse=True)
def no_process_group_left() -> None:
    """Every test must leave torch.distributed uninitialised, whatever happened."""
    yield
    assert not dist.is_initialized()


def test_tiny_configs_cover_the_spec_architectures() -> None:
    assert REQUIRED <= set(TINY_TRANSFORMER_CONFIGS)
    assert TINY_TRANSFORMER_CONFIGS["FluxTransformer2DModel"]["guidance_embeds"] is True
    sd3 = TINY_TRANSFORMER_CONFIGS["SD3Transformer2DModel"]
    assert sd3["dual_attention_layers"] and sd3["qk_norm"] == "rms_norm"


@pytest.mark.parametrize("class_name", CLASS_NAMES)
def test_tiny_transformer_builds_deterministically_and_runs(class_name: str) -> None:
    model = build_transformer(class_name, seed=0)
    assert type(model).__name__ == class_name
    state = model.state_dict()
    assert sum(t.numel() * t.element_size() for t in state.values()) < 1_000_000
    for name, param in model.named_parameters():
        assert param.is_floating_point() and param.ne(0).any(), f"{name} is all zero"
    # A parameter with 1, 2 or 4 rows gives torch.chunk an empty piece at 3 and at 4 ranks.
    assert any(p.shape[0] in (1, 2, 4) for p in model.parameters())

    outputs = run_tiny_forward(model)
    assert outputs and all(torch.isfinite(out).all() for out in outputs)

    again = build_transformer(class_name, seed=0).state_dict()
    other = build_transformer(class_name, seed=1).state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state)
    assert any(not torch.equal(state[k], other[k]) for k in state)


def test_a_small_parameter_is_drawn_element_by_element_as_before() -> None:
    """Every tiny fixture's bytes stay what they were: up to the threshold, the fill is randn from the generator."""
    from mergeflow.demo import tiny_transformers

    data = torch.empty(7, 5)
    tiny_transformers._fill_(data, "proj.weight", torch.Generator().manual_seed(3))
    drawn = torch.randn(7, 5, generator=torch.Generator().manual_seed(3)) * 5 ** -0.5
    assert torch.equal(data, drawn)
    assert max(p.numel() for name in CLASS_NAMES for p in build_transformer(name, seed=0).parameters()) \
        <= tiny_transformers._DRAWN_IN_FULL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_parameter_is_noise_with_no_two_rows_alike(dtype: torch.dtype) -> None:
    """Above the threshold the fill copies rotations of a drawn pool: seeded, scaled by fan-in as before, and
    with every row its own, so that a misplaced row or block cannot read back equal."""
    from mergeflow.demo import tiny_transformers

    rows, width = 1_500, 3_072  # 4.6 M elements: over the threshold, over four pools
    assert rows * width > tiny_transformers._DRAWN_IN_FULL

    def filled(seed: int, name: str = "blocks.0.ff.weight", shape: tuple[int, ...] = (rows, width)) -> torch.Tensor:
        data = torch.empty(shape, dtype=dtype)
        tiny_transformers._fill_(data, name, torch.Generator().manual_seed(seed))
        return data

    weight = filled(0)
    assert torch.equal(weight, filled(0)) and not torch.equal(weight, filled(1))
    values = weight.float()
    assert abs(values.std().item() * width ** 0.5 - 1.0) < 0.01 and abs(values.mean().item()) < 0.001
    assert torch.unique(values, dim=0).shape[0] == rows
    # The pool's chunks are rotations of each other, not repeats: no chunk starts like the one before.
    flat, pool = values.view(-1), tiny_transformers._POOL
    assert not torch.equal(flat[:64], flat[pool:pool + 64])
    norm = filled(0, "norm.weight", (rows * width,)).float()  # a norm's scale: near 1, as a small one is
    assert abs(norm.mean().item() - 1.0) < 0.001 and abs(norm.std().item() - 0.1) < 0.001


def test_cast_keeps_fp32_modules_like_from_pretrained(tmp_path: Path) -> None:
    model = build_transformer("WanTransformer3DModel", dtype=torch.bfloat16)
    dtypes = {name: t.dtype for name, t in model.state_dict().items()}
    kept = {name for name in dtypes if keeps_fp32(model, name)}
    assert kept and any("scale_shift_table" in name for name in kept)
    assert all(dtypes[name] == torch.float32 for name in kept)
    assert all(dtype == torch.bfloat16 for name, dtype in dtypes.items() if name not in kept)
    # Diffusers' own loader reproduces the same dtypes from an fp32 save.
    save_base_transformer(build_transformer("WanTransformer3DModel"), tmp_path / "fp32")
    loaded = type(model).from_pretrained(tmp_path / "fp32", torch_dtype=torch.bfloat16)
    assert {name: t.dtype for name, t in loaded.state_dict().items()} == dtypes
    outputs = run_tiny_forward(model)
    assert outputs[0].dtype == torch.bfloat16 and torch.isfinite(outputs[0].float()).all()


def test_perturb_changes_every_parameter_deterministically() -> None:
    base = build_transformer("SD3Transformer2DModel")
    actor = build_transformer("SD3Transformer2DModel")
    twin = build_transformer("SD3Transformer2DModel")
    perturb_(actor, seed=1)
    perturb_(twin, seed=1)
    base_params = dict(base.named_parameters())
    for name, param in actor.named_parameters():
        assert not torch.equal(param, base_params[name]), name
        assert torch.equal(param, dict(twin.named_parameters())[name])
    # Buffers are not trained: SD3's persistent positional table stays as it was.
    assert torch.equal(actor.pos_embed.pos_embed, base.pos_embed.pos_embed)


@pytest.mark.parametrize(
    ("world_size", "mesh_shape"),
    [(1, None), (2, None), (3, None), (4, None), (4, (2, 2))],
)
def test_rank_files_rebuild_the_model_exactly(
    tmp_path: Path, world_size: int, mesh_shape: tuple[int, int] | None
) -> None:
    model = build_transformer("FluxTransformer2DModel")
    perturb_(model, seed=3)
    actor = save_fsdp_checkpoint(model, tmp_path / "actor", world_size, mesh_shape=mesh_shape)
    assert actor == tmp_path / "actor"
    for kind in ("model", "optim", "extra_state"):
        for rank in range(world_size):
            assert (actor / f"{kind}_world_size_{world_size}_rank_{rank}.pt").is_file()
    assert not list(actor.glob(f"model_world_size_{world_size}_rank_{world_size}.pt"))
    fsdp_text = (actor / "fsdp_config.json").read_text()
    assert fsdp_text == json.dumps({"FSDP_version": 2, "world_size": world_size}, indent=4)
    hf_config = json.loads((actor / "huggingface" / "config.json").read_text())
    assert hf_config["_class_name"] == "FluxTransformer2DModel"
    assert hf_config["out_channels"] == 2

    shape = mesh_shape or (1, world_size)
    rows = assert_reconstructs(load_ranks(actor, world_size), model.state_dict(), shape)
    shards = shape[1]
    if shards > 2:
        assert any(0 in r for r in rows), "expected an empty shard"
        assert any(len(set(r) - {0}) > 1 for r in rows), "expected uneven shards"


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("class_name", CLASS_NAMES)
def test_every_architecture_shards_unevenly(tmp_path: Path, class_name: str, world_size: int) -> None:
    model = build_transformer(class_name, dtype=torch.bfloat16)
    actor = save_fsdp_checkpoint(model, tmp_path / "actor", world_size, write_extra_state=False)
    assert not list(actor.glob("optim_*")) and not list(actor.glob("extra_state_*"))
    rows = assert_reconstructs(load_ranks(actor, world_size), model.state_dict(), (1, world_size))
    assert any(0 in r for r in rows), "expected an empty shard"
    assert any(len(set(r) - {0}) > 1 for r in rows), "expected uneven shards"


class HandMade(nn.Module):
    """A module with what Diffusers models lack: a tied weight, a 0-d buffer, mixed dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.half = nn.Linear(3, 2).to(torch.bfloat16)
        self.register_buffer("step", torch.tensor(7.5))
        self.register_buffer("scratch", torch.ones(4), persistent=False)


def test_hand_made_module_keeps_ties_and_buffers(tmp_path: Path) -> None:
    model = HandMade()
    actor = save_fsdp_checkpoint(model, tmp_path / "actor", 3, fsdp_version=1)
    assert json.loads((actor / "fsdp_config.json").read_text()) == {"FSDP_version": 1, "world_size": 3}
    assert not (actor / "huggingface").exists()  # nothing to describe a plain nn.Module
    ranks = load_ranks(actor, 3)
    assert "scratch" not in ranks[0]
    assert ranks[0]["step"].ndim == 0 and ranks[0]["step"].item() == 7.5
    assert_reconstructs(ranks, model.state_dict(), (1, 3))
    for rank_sd in ranks:
        tied = rank_sd["embed.weight"].to_local(), rank_sd["head.weight"].to_local()
        assert tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr()
        assert rank_sd["half.weight"].dtype == torch.bfloat16
    # The caller's model is untouched: still plain parameters, still tied.
    assert not isinstance(model.embed.weight, DTensor) and model.head.weight is model.embed.weight


def test_plain_single_rank_file(tmp_path: Path) -> None:
    model = build_transformer("QwenImageTransformer2DModel")
    actor = save_fsdp_checkpoint(model, tmp_path / "actor", 1, plain=True, write_hf_config=False)
    assert not (actor / "huggingface").exists()
    (loaded,) = load_ranks(actor, 1)
    expected = model.state_dict()
    assert set(loaded) == set(expected)
    assert all(not isinstance(t, DTensor) and torch.equal(t, expected[k]) for k, t in loaded.items())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"world_size": 0},
        {"world_size": 2, "plain": True},
        {"world_size": 4, "mesh_shape": (2, 3)},
        {"world_size": 2, "fsdp_version": 3},
    ],
)
def test_impossible_layouts_are_refused(tmp_path: Path, kwargs: dict) -> None:
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError):
        save_fsdp_checkpoint(HandMade(), tmp_path / "actor", world_size, **kwargs)
    assert not (tmp_path / "actor").exists()


def test_failure_inside_a_rank_leaves_no_process_group(tmp_path: Path) -> None:
    model = HandMade()
    model.scalar = nn.Parameter(torch.tensor(1.0))  # FSDP refuses 0-d parameters
    with pytest.raises(Exception, match="scalar"):
        save_fsdp_checkpoint(model, tmp_path / "actor", 2)
    assert not dist.is_initialized()


def test_an_existing_process_group_is_not_hijacked(tmp_path: Path) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="already initialised"):
            save_fsdp_checkpoint(HandMade(), tmp_path / "actor", 2)
        assert dist.is_initialized() and not (tmp_path / "actor").exists()
    finally:
        dist.destroy_process_group()


def test_builders_leave_global_state_alone(tmp_path: Path) -> None:
    rng, hook, environ = torch.get_rng_state(), sys.excepthook, dict(os.environ)
    model = build_transformer("MiniMaxH3Transformer3DModel", seed=5)
    perturb_(model, seed=6)
    save_fsdp_checkpoint(model, tmp_path / "actor", 2)
    assert torch.equal(rng, torch.get_rng_state())
    assert sys.excepthook is hook  # init_process_group wraps it with a "[rankN]:" prefixer
    assert dict(os.environ) == environ


def test_demo_checkpoint_pairs_a_base_with_its_trained_actor(tmp_path: Path) -> None:
    from diffusers import FluxTransformer2DModel

    demo = build_demo_checkpoint(tmp_path)
    assert demo == DemoCheckpoint(
        tmp_path / "global_step_1" / "actor", tmp_path / "base", "FluxTransformer2DModel", 4
    )
    base = FluxTransformer2DModel.from_pretrained(demo.base_dir)
    expected_base = build_transformer("FluxTransformer2DModel", seed=0).state_dict()
    base_sd = base.state_dict()
    assert all(torch.equal(base_sd[k], expected_base[k]) for k in expected_base)

    ranks = load_ranks(demo.actor_dir, 4)
    rebuilt = {k: torch.cat([r[k].to_local() for r in ranks]) for k in expected_base}
    assert all(not torch.equal(rebuilt[k], expected_base[k]) for k in expected_base)
    actor = build_transformer("FluxTransformer2DModel", seed=0)
    perturb_(actor, seed=1)
    assert_reconstructs(ranks, actor.state_dict(), (1, 4))


def test_save_base_transformer_shards_when_asked(tmp_path: Path) -> None:
    model = build_transformer("LTX2VideoTransformer3DModel")
    base = save_base_transformer(model, tmp_path / "base", max_shard_size=50_000)
    assert (base / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert json.loads((base / "config.json").read_text())["_class_name"] == "LTX2VideoTransformer3DModel"


def test_sized_checkpoint_hits_the_requested_size(tmp_path: Path) -> None:
    size = 12_000_000
    demo = build_sized_checkpoint(tmp_path, size, world_size=3, class_name="WanTransformer3DModel")
    ranks = load_ranks(demo.actor_dir, 3)
    local_bytes = sum(
        t.to_local().numel() * t.element_size() for r in ranks for t in r.values() if isinstance(t, DTensor)
    )
    buffer_bytes = sum(t.numel() * t.element_size() for t in ranks[0].values() if not isinstance(t, DTensor))
    total = local_bytes + buffer_bytes
    assert abs(total - size) / size <= 0.15
    config = json.loads((demo.base_dir / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel"
    dtypes = {t.dtype for t in ranks[0].values()}
    assert dtypes == {torch.bfloat16, torch.float32}  # Wan keeps its fp32 modules


def test_sized_checkpoint_refuses_unreachable_sizes(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot scale"):
        build_sized_checkpoint(tmp_path, 1_000)
    with pytest.raises(UsageError, match="no synthetic transformer"):
        build_sized_checkpoint(tmp_path, 10**8, class_name="UNet2DConditionModel")


def test_state_dict_bytes_counts_kept_fp32_modules_at_four_bytes() -> None:
    overrides: dict = {}
    fp32 = state_dict_bytes("MiniMaxH3Transformer3DModel", overrides, torch.float32)
    bf16 = state_dict_bytes("MiniMaxH3Transformer3DModel", overrides, torch.bfloat16)
    model = build_transformer("MiniMaxH3Transformer3DModel", dtype=torch.bfloat16)
    actual = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert bf16 == actual and fp32 / 2 < bf16 < fp32
