"""Reading and reassembling rank files without Prefect: the plain functions behind the tasks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from builders import assert_bit_exact, output_state
from torch import nn

from mergeflow.demo.checkpoints import save_fsdp_checkpoint
from mergeflow.export.reconstruct.layout import chunk_sizes, plan_layouts
from mergeflow.export.reconstruct.rebuild import all_finite
from mergeflow.export.write.shard_writer import pack_shards, write_shard_file
from mergeflow.records import TensorWrite
from mergeflow.sources.verl_ranks import RankStates, index_rank_file


class Odd(nn.Module):
    """Odd dimensions (uneven and empty shards), a tied weight, mixed dtypes, a 0-d buffer."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Embedding(7, 5)
        self.proj = nn.Linear(5, 3)
        self.head = nn.Linear(5, 7, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.tiny = nn.Parameter(torch.randn(1, 3, generator=g))  # fewer rows than ranks: empty shards
        self.low = nn.Parameter(torch.randn(5, 2, generator=g).to(torch.bfloat16))
        self.register_buffer("step", torch.tensor(7, dtype=torch.int64))  # persistent 0-d buffer
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("scratch", torch.ones(3), persistent=False)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))


def reconstruct(actor: Path, world: int, out: Path) -> dict[str, torch.Tensor]:
    names = tuple(f"model_world_size_{world}_rank_{r}.pt" for r in range(world))
    indexes = [index_rank_file(actor, n, r) for r, n in enumerate(names)]
    layouts = plan_layouts([ix.entries for ix in indexes])
    writes = [TensorWrite(k, k, layout, layout.dtype) for k, layout in layouts.items()]
    plan = pack_shards(writes, 200, "diffusion_pytorch_model.safetensors", "fp")
    out.mkdir()
    (out / "work").mkdir()
    states = RankStates(actor, names)
    for shard in plan.shards:
        write_shard_file(shard, states, out, out / "work")
    return output_state(out)


@pytest.mark.parametrize("world,mesh", [(1, None), (2, None), (3, None), (4, None), (4, (2, 2))],
                         ids=["w1", "w2", "w3", "w4", "hsdp2x2"])
def test_bit_exact_with_odd_shapes_ties_and_scalars(tmp_path: Path, world: int, mesh) -> None:  # type: ignore[no-untyped-def]
    model = Odd()
    actor = save_fsdp_checkpoint(model, tmp_path / "actor", world, mesh_shape=mesh)
    state = reconstruct(actor, world, tmp_path / "out")
    expected = model.state_dict()
    assert "scratch" not in expected and expected["step"].dim() == 0
    assert_bit_exact(expected, state)


def test_ties_are_recognised_and_written_twice(tmp_path: Path) -> None:
    actor = save_fsdp_checkpoint(Odd(), tmp_path / "actor", 3)
    names = tuple(f"model_world_size_3_rank_{r}.pt" for r in range(3))
    layouts = plan_layouts([index_rank_file(actor, n, r).entries for r, n in enumerate(names)])
    assert layouts["head.weight"].tied_to == "embed.weight"


def test_chunk_arithmetic_matches_torch_chunk_and_fsdp_padding() -> None:
    assert chunk_sizes(3, 4) == [1, 1, 1, 0]
    assert chunk_sizes(7, 4) == [2, 2, 2, 1]
    assert chunk_sizes(1, 3) == [1, 0, 0]
    assert chunk_sizes(0, 2) == [0, 0]
    for n in range(0, 20):
        for parts in range(1, 6):
            pieces = [len(c) for c in torch.arange(n).chunk(parts)] if n else []
            assert chunk_sizes(n, parts)[: len(pieces)] == pieces
            assert sum(chunk_sizes(n, parts)) == n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_sees_every_kind_of_non_finite(dtype: torch.dtype) -> None:
    x = torch.randn(1000).to(dtype)
    assert all_finite(x)
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = x.clone()
        y[537] = bad
        assert not all_finite(y)
    assert all_finite(torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).min, -0.0], dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_scans_every_slice_through_one_reused_buffer(dtype: torch.dtype) -> None:
    """The scan runs in slices of _SCAN_BYTES through one buffer per thread: a non-finite value is seen at
    either edge of any slice and in a short last slice, and a stale slice left in the buffer by a tensor
    scanned before never stands in for the next tensor's."""
    from mergeflow.export.reconstruct import rebuild

    step = rebuild._SCAN_BYTES // torch.tensor([], dtype=dtype).element_size()
    x = torch.zeros(2 * step + 3, dtype=dtype)
    assert all_finite(x)
    buffer = rebuild._scan_buffer()
    for at in (0, step - 1, step, 2 * step - 1, 2 * step, 2 * step + 2):
        y = x.clone()
        y[at] = float("inf")
        assert not all_finite(y), at
        assert all_finite(x), "a slice of the tensor scanned before was taken for this one's"
    assert rebuild._scan_buffer() is buffer  # the same buffer: nothing allocated per call
