"""The streaming full-size fixture generator (bench/flux_full_scale.py), checked at tiny size.

Its rank files must be the bytes a real `fully_shard` + `torch.save(state_dict())` writes,
its base headers the bytes `save_pretrained` writes, and mergeflow must export and validate
what it generates through the real command line.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import forked_cli
import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  (registers DTensor for weights_only loads)
from torch.distributed.tensor import DTensor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import flux_full_scale as gen  # noqa: E402
from builders import output_state  # noqa: E402

from mergeflow.demo.checkpoints import save_fsdp_checkpoint  # noqa: E402
from mergeflow.demo.tiny_transformers import TINY_TRANSFORMER_CONFIGS  # noqa: E402

CLASS = "FluxTransformer2DModel"
TINY = TINY_TRANSFORMER_CONFIGS[CLASS]


def tiny_generate(root: Path, world_size: int, **kwargs: object) -> gen.Generated:
    return gen.generate(root, world_size=world_size, config=TINY, **kwargs)  # type: ignore[arg-type]


def model_with_generated_values(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    """The tiny model on CPU holding exactly the global tensors the generator shards."""
    model = gen.meta_model(CLASS, TINY, dtype)
    _, specs = gen.tensor_specs(model)
    source = gen.WeightSource(seed, dtype)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for spec in specs:
            model.get_parameter(spec.name).copy_(source.full(spec))
    return model


def real_fully_shard_save(model: torch.nn.Module, actor_dir: Path, world_size: int) -> None:
    """What each training rank does: fully_shard the blocks and the root, torch.save the state dict.

    Every rank starts from a cold DTensor sharding cache, as it would in its own process.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    actor_dir.mkdir(parents=True)
    blocks = set(model._no_split_modules)  # type: ignore[attr-defined]
    hook = sys.excepthook
    for rank in range(world_size):
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
            replica = copy.deepcopy(model)
            for module in list(replica.modules()):
                if module is not replica and type(module).__name__ in blocks:
                    fully_shard(module, mesh=mesh)
            fully_shard(replica, mesh=mesh)
            torch.save(replica.state_dict(), actor_dir / f"model_world_size_{world_size}_rank_{rank}.pt")
            del replica
        finally:
            dist.destroy_process_group()
            gc.collect()
    sys.excepthook = hook


def load(path: Path) -> dict[str, DTensor]:
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_files_are_the_bytes_of_a_real_fully_shard_save(tmp_path: Path, world_size: int) -> None:
    generated = tiny_generate(tmp_path / "gen", world_size)
    real_fully_shard_save(model_with_generated_values(), tmp_path / "real", world_size)
    for path in generated.rank_files:
        # Whole files: pickle (DTensors, mesh, specs, memo sharing), records, zip headers, CRCs.
        assert path.read_bytes() == (tmp_path / "real" / path.name).read_bytes(), path.name


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_files_load_safely_like_the_repo_builders(tmp_path: Path, world_size: int) -> None:
    generated = tiny_generate(tmp_path / "gen", world_size)
    reference = save_fsdp_checkpoint(model_with_generated_values(), tmp_path / "ref", world_size,
                                     write_extra_state=False)
    _, specs = gen.tensor_specs(gen.meta_model(CLASS, TINY, torch.bfloat16))
    source = gen.WeightSource(0, torch.bfloat16)
    saw_empty = False
    for rank, path in enumerate(generated.rank_files):
        ours, theirs = load(path), load(reference / path.name)
        assert list(ours) == list(theirs) == [s.name for s in specs]
        for spec in specs:
            a, b = ours[spec.name], theirs[spec.name]
            assert isinstance(a, DTensor) and isinstance(b, DTensor)
            assert a.placements == b.placements and a.shape == b.shape and a.dtype == b.dtype
            assert a.device_mesh.mesh_dim_names == b.device_mesh.mesh_dim_names == ("fsdp",)
            la, lb = a.to_local(), b.to_local()
            assert la.shape == lb.shape and la.untyped_storage().nbytes() == lb.untyped_storage().nbytes()
            expected = source.local(spec, world_size, rank)
            assert torch.equal(la.view(torch.uint8), expected.view(torch.uint8)), spec.name
            assert torch.equal(la.view(torch.uint8), lb.view(torch.uint8)), spec.name
            saw_empty |= la.shape[0] == 0
    assert saw_empty == (world_size == 3)  # proj_out.bias has 2 rows: rank 2 of 3 is empty
    assert json.loads((generated.actor_dir / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": world_size}
    assert (generated.actor_dir / "fsdp_config.json").read_text() == (reference / "fsdp_config.json").read_text()
    assert ((generated.actor_dir / "huggingface" / "config.json").read_text()
            == (reference / "huggingface" / "config.json").read_text())


@pytest.mark.parametrize("max_shard_size", ["10GB", 40000])
def test_sparse_base_has_save_pretrained_headers_and_holes(tmp_path: Path, max_shard_size: int | str) -> None:
    generated = tiny_generate(tmp_path / "gen", 2, base_max_shard_size=max_shard_size)
    real = tmp_path / "real"
    model_with_generated_values().save_pretrained(real, max_shard_size=max_shard_size)
    names = sorted(os.listdir(real))
    assert sorted(os.listdir(generated.base_dir)) == names
    assert len(names) == (2 if max_shard_size == "10GB" else 6)
    for name in names:
        ours, theirs = (generated.base_dir / name).read_bytes(), (real / name).read_bytes()
        if not name.endswith(".safetensors"):
            assert ours == theirs, name
            continue
        head = 8 + struct.unpack("<Q", theirs[:8])[0]
        assert len(ours) == len(theirs) and ours[:head] == theirs[:head], name
        assert ours[head:] == bytes(len(ours) - head)  # the data region is a hole: zeros
        blocks = (generated.base_dir / name).stat().st_blocks * 512
        assert blocks <= head + 8192, f"{name}: {blocks} bytes allocated for a {head}-byte header"


def test_safetensors_header_orders_mixed_dtypes_like_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {f"t{i}.{dtype}".replace("torch.", ""): torch.zeros(i + 1, 2, dtype=dtype)
               for i, dtype in enumerate(reversed(list(gen._SAFETENSORS_DTYPES)))}
    tensors["a.same_dtype_sorted_by_name"] = torch.zeros(3, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    raw = (tmp_path / "x.safetensors").read_bytes()
    specs = [gen.TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    head, data = gen.safetensors_header(specs, {"format": "pt"})
    assert raw[: len(head)] == head and len(raw) == len(head) + data


def test_weight_source_shards_tile_the_global_tensor_and_wrap_the_pool() -> None:
    source = gen.WeightSource(5, torch.bfloat16, pool_elements=7)
    spec = gen.TensorSpec("w", (5, 3), torch.bfloat16)  # 15 elements: wraps a 7-element pool twice
    flat = source.full(spec).reshape(-1)
    start = source.offset("w")
    assert torch.equal(flat, source.pool[[(start + i) % 7 for i in range(15)]])
    for world_size in (1, 2, 3, 4, 8):
        pieces = [source.local(spec, world_size, r) for r in range(world_size)]
        assert [p.shape[0] for p in pieces] == [len(c) for c in torch.arange(5).chunk(world_size)] + [0] * (
            world_size - len(torch.arange(5).chunk(world_size)))
        assert torch.equal(torch.cat(pieces), source.full(spec))
    again = gen.WeightSource(5, torch.bfloat16, pool_elements=7)
    assert torch.equal(again.full(spec), source.full(spec))
    assert torch.isfinite(gen.WeightSource(0, torch.bfloat16).pool.float()).all()


def test_completion_record_and_refusals(tmp_path: Path) -> None:
    root = tmp_path / "gen"
    generated = tiny_generate(root, 3)
    assert gen.load_complete(root, world_size=3, config=TINY) == generated
    assert gen.load_complete(root, world_size=2, config=TINY) is None  # other parameters
    assert gen.load_complete(root, world_size=3, config=TINY, seed=1) is None
    with pytest.raises(FileExistsError):
        tiny_generate(root, 3)
    with open(generated.rank_files[1], "r+b") as fh:  # a cut-off file is not complete
        fh.truncate(100)
    assert gen.load_complete(root, world_size=3, config=TINY) is None
    gen.remove(root)
    assert sorted(os.listdir(root)) == []


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return forked_cli.mergeflow(args, env)


def test_mergeflow_exports_and_validates_a_generated_checkpoint(tmp_path: Path, prefect_server) -> None:  # type: ignore[no-untyped-def]
    env = prefect_server.client_env()
    env["HF_HUB_OFFLINE"] = "1"
    generated = tiny_generate(tmp_path / "gen", 3, base_max_shard_size=40000)
    target = tmp_path / "out"
    proc = run_cli(["merge", "--backend", "fsdp", "--local_dir", str(generated.actor_dir),
                    "--base_model", str(generated.base_dir), "--target_dir", str(target),
                    "--output_format", "transformer"], env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["output_dir"] == str(target)
    proc = run_cli(["test", "--backend", "fsdp", "--test_hf_dir", str(target)], env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"integrity": "passed", "architecture": CLASS}
    # The export is the generator's global tensors, bit for bit.
    _, specs = gen.tensor_specs(gen.meta_model(CLASS, TINY, torch.bfloat16))
    source = gen.WeightSource(0, torch.bfloat16)
    exported = output_state(target)
    assert set(exported) == {s.name for s in specs}
    for spec in specs:
        assert torch.equal(exported[spec.name].view(torch.uint8), source.full(spec).view(torch.uint8)), spec.name


def test_the_bench_s_traffic_counts_the_disk_s_bytes_and_the_kernel_s_time(tmp_path: Path) -> None:
    """bench/system_state.traffic: what full_scale_bench prints for the floor and the export (machine-wide counters)."""
    from system_state import traffic

    before = traffic(tmp_path)
    data = os.urandom(16 * 2**20)
    with open(tmp_path / "written.bin", "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())  # on the disk now: its sectors are counted as written
    spent = traffic(tmp_path) - before
    assert spent.disk_written >= len(data), spent
    assert spent.system_s > 0 and spent.user_s >= 0, spent  # urandom and the write run in the kernel
    assert "written" in spent.summary() and "kernel" in spent.summary()
