"""--extract-lora: a LoRA out of a full checkpoint, through the real flow, loaded by real PEFT and Diffusers."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
from builders import leftovers, make_export
from peft import PeftModel
from safetensors.torch import load_file

from mergeflow import merge_model, validate_artifact
from mergeflow.demo.checkpoints import (
    build_transformer,
    run_tiny_forward,
    save_base_transformer,
    save_fsdp_checkpoint,
)
from mergeflow.errors import (
    ArtifactInvalidError,
    LoraError,
    SchemaMismatchError,
    UsageError,
)
from mergeflow.io.jsonfiles import dumps_canonical
from mergeflow.lora.extract import (
    METHOD_EXACT,
    METHOD_RANDOMIZED,
    ExtractSettings,
    extract_layer,
)
from mergeflow.lora.extract_spec import EXTRACTION_NAME

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")

RANK = 2


def low_rank_finetune_(model: torch.nn.Module, rank: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """W' = W + B @ A (rank `rank`) on every nn.Linear; returns each module's exact dW (float32)."""
    gen = torch.Generator().manual_seed(seed)
    deltas = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                out_f, in_f = module.weight.shape
                b = torch.randn((out_f, rank), generator=gen) * 0.05
                a = torch.randn((rank, in_f), generator=gen) * 0.05
                before = module.weight.detach().clone()
                module.weight.add_((b @ a).to(module.weight.dtype))
                deltas[name] = module.weight.to(torch.float32) - before.to(torch.float32)
    return deltas


def known_rank_checkpoint(root: Path, class_name: str, rank: int = RANK, world_size: int = 2):
    base = build_transformer(class_name, seed=0)
    base_dir = save_base_transformer(base, root / "base")
    actor = copy.deepcopy(base)
    deltas = low_rank_finetune_(actor, rank)
    actor_dir = save_fsdp_checkpoint(actor, root / "ckpt" / "global_step_1" / "actor", world_size)
    return base, actor, base_dir, actor_dir, deltas


def config(actor_dir: Path, base_dir: Path, target: Path, **extra: object):
    from mergeflow.config import ModelMergerConfig

    values: dict[str, object] = {"operation": "merge", "local_dir": str(actor_dir), "base_model": str(base_dir),
                                 "target_dir": str(target), "output_format": "transformer"}
    values.update(extra)
    return ModelMergerConfig(**values)  # type: ignore[arg-type]


# --- the per-layer decomposition ----------------------------------------------------------------------------


@pytest.mark.parametrize("exact_max_dim", [4096, 16], ids=["exact", "randomized"])
def test_a_known_rank_update_is_reconstructed_to_1e5_relative(exact_max_dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn((96, 4), generator=gen) @ torch.randn((4, 80), generator=gen)
    settings = ExtractSettings(rank=4, exact_max_dim=exact_max_dim)
    up, down, record = extract_layer("m", delta, settings, torch.float32)
    assert record.method == (METHOD_EXACT if exact_max_dim == 4096 else METHOD_RANDOMIZED)
    assert (up.shape, down.shape) == ((96, 4), (4, 80))
    assert float(torch.linalg.norm(up @ down - delta) / torch.linalg.norm(delta)) < 1e-5
    assert abs(record.retained - 1.0) < 1e-5 and record.max_abs_error < 1e-4


def test_randomized_extraction_is_deterministic_and_energy_picks_the_smallest_rank() -> None:
    gen = torch.Generator().manual_seed(1)
    # singular values 8, 4, 2, 1, 0.5: norm fractions sqrt(cumsum s^2) / ||dW||
    u, _ = torch.linalg.qr(torch.randn((64, 5), generator=gen))
    v, _ = torch.linalg.qr(torch.randn((48, 5), generator=gen))
    s = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5])
    delta = (u * s) @ v.T
    fractions = torch.sqrt(torch.cumsum(s**2, 0) / torch.sum(s**2))
    settings = ExtractSettings(rank=5, energy=float(fractions[1]) + 1e-4, exact_max_dim=8)
    first = extract_layer("blocks.0.ff", delta, settings, torch.float32)
    again = extract_layer("blocks.0.ff", delta.clone(), settings, torch.float32)
    assert first[2].rank == 3 and first[2].method == METHOD_RANDOMIZED
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert math.isclose(first[2].retained, float(fractions[2]), rel_tol=1e-5)
    capped = extract_layer("m", delta, ExtractSettings(rank=2, energy=1.0), torch.float32)[2]
    assert capped.rank == 2 and math.isclose(capped.retained, float(fractions[1]), rel_tol=1e-5)


def test_bf16_factors_report_what_the_rounded_factors_keep() -> None:
    gen = torch.Generator().manual_seed(4)
    delta = torch.randn((40, 3), generator=gen) @ torch.randn((3, 24), generator=gen)
    up, down, record = extract_layer("m", delta, ExtractSettings(rank=3), torch.bfloat16)
    assert up.dtype == down.dtype == torch.bfloat16
    approx = up.float() @ down.float()
    assert record.kept_norm == float(torch.linalg.norm(approx))
    assert record.max_abs_error == float((delta - approx).abs().max()) > 0  # the rounding, not hidden


def test_a_rank_above_a_layers_smallest_dimension_is_refused_but_caps_an_energy_choice() -> None:
    delta = torch.randn((6, 5), generator=torch.Generator().manual_seed(2))
    with pytest.raises(UsageError, match=r"exceeds m's smallest dimension \(6 x 5\)"):
        extract_layer("m", delta, ExtractSettings(rank=6), torch.float32)
    capped = extract_layer("m", delta, ExtractSettings(rank=6, energy=1.0), torch.float32)[2]
    assert capped.rank == 5 and abs(capped.retained - 1) < 1e-5


@pytest.mark.parametrize("rank,energy,match", [
    (0, None, "rank >= 1"), (-3, None, "rank >= 1"), (4, 0.0, r"\(0, 1\]"), (4, 1.5, r"\(0, 1\]"),
    (4, float("nan"), r"\(0, 1\]"), (None, 0.9, "needs --extract-lora"),
])
def test_flag_values_are_refused_in_one_line(rank: int | None, energy: float | None, match: str, tmp_path: Path) -> None:
    cfg = config(tmp_path / "a", tmp_path / "b", tmp_path / "out", extract_lora=rank, extract_energy=energy)
    with pytest.raises(UsageError, match=match):
        cfg.validate()


# --- through the flow -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux_known_rank(tmp_path_factory: pytest.TempPathFactory):
    return known_rank_checkpoint(tmp_path_factory.mktemp("flux-rank"), "FluxTransformer2DModel")


def test_known_rank_fine_tune_is_recovered_and_peft_reproduces_the_forward(
    tmp_path: Path, prefect_api: object, flux_known_rank
) -> None:
    base, actor, base_dir, actor_dir, deltas = flux_known_rank
    result = merge_model(config(actor_dir, base_dir, tmp_path / "out", extract_lora=RANK))
    out = Path(result.output_dir)
    adapter_dir = out / "lora_adapter"
    assert sorted(p.name for p in out.iterdir()) == ["lora_adapter"] and not leftovers(tmp_path, ".out")
    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", EXTRACTION_NAME, "merge_manifest.json",
        "merge_manifest.sha256"]
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    assert len(weights) == 2 * len(deltas)
    for module, delta in deltas.items():  # (1) every dW to 1e-5 relative, float32
        a = weights[f"base_model.model.{module}.lora_A.weight"]
        b = weights[f"base_model.model.{module}.lora_B.weight"]
        assert a.shape[0] == RANK and a.dtype == torch.float32
        assert float(torch.linalg.norm(b @ a - delta) / torch.linalg.norm(delta)) < 1e-5, module
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == RANK and sorted(cfg["target_modules"]) == sorted(deltas)
    assert cfg["base_model_name_or_path"] == base_dir.name
    record = json.loads((adapter_dir / EXTRACTION_NAME).read_text())
    assert record["summary"]["layers"] == len(deltas) and record["not_extracted"] == []
    assert all(abs(layer["retained"] - 1) < 1e-5 and layer["rank"] == RANK for layer in record["layers"])
    assert record["method"]["seed"] == 0 and record["summary"]["size_ratio"] < 1
    # (2) real PEFT onto the base reproduces the fine-tuned forward (float32; tolerance 1e-4 absolute)
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).base_model.model.eval()
    for want, got in zip(run_tiny_forward(actor.eval()), run_tiny_forward(loaded), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert validate_artifact(out)["integrity"] == "passed"
    # deterministic: a second run gives the same bytes
    again = Path(merge_model(config(actor_dir, base_dir, tmp_path / "again", extract_lora=RANK)).output_dir)
    for name in ("adapter_model.safetensors", "adapter_config.json", EXTRACTION_NAME):
        assert (adapter_dir / name).read_bytes() == (again / "lora_adapter" / name).read_bytes(), name


def test_a_full_rank_update_reports_its_retained_energy_and_test_checks_it(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, "SD3Transformer2DModel", world_size=2)  # perturb_: full-rank noise on every tensor
    out = Path(merge_model(ex.config(tmp_path / "out", extract_lora=2, adapter_format="diffusers")).output_dir)
    adapter_dir = out / "lora_adapter"
    record = json.loads((adapter_dir / EXTRACTION_NAME).read_text())
    weights = load_file(adapter_dir / "pytorch_lora_weights.safetensors")
    base = load_file(next((ex.base_dir).glob("*.safetensors")))
    trained = {k: v for k, v in ex.actor.state_dict().items()}
    for layer in record["layers"]:
        module = layer["module"]
        delta = trained[f"{module}.weight"].float() - base[f"{module}.weight"].float()
        kept = weights[f"transformer.{module}.lora_B.weight"] @ weights[f"transformer.{module}.lora_A.weight"]
        assert math.isclose(layer["retained"], float(torch.linalg.norm(kept) / torch.linalg.norm(delta)), rel_tol=1e-5)
        # the truth: the best rank-2 approximation keeps exactly the top two singular values
        s = torch.linalg.svdvals(delta)
        assert math.isclose(layer["retained"], float(torch.sqrt((s[:2] ** 2).sum()) / torch.linalg.norm(s)), rel_tol=1e-4)
        if min(layer["shape"]) > 2:  # a full-rank update is not kept whole at rank 2 (a [n, 2] layer is)
            assert layer["retained"] < 0.99
        assert math.isclose(layer["max_abs_error"], float((delta - kept).abs().max()), rel_tol=1e-5)
    assert record["summary"]["energy_weighted_retained"] < 0.9
    assert [layer["retained"] for layer in record["layers"]] == sorted(layer["retained"] for layer in record["layers"])
    not_extracted = {item["name"] for item in record["not_extracted"]}
    assert "norm_out.linear.bias" in not_extracted and "norm_out.linear.weight" not in not_extracted
    assert validate_artifact(out)["integrity"] == "passed"
    # the UI: a table of every layer, worst retained first, and the overall figures in its description
    from prefect_runs import latest_flow_run
    from test_ui import _artifact

    table = _artifact("merge-extraction-ckpt-step1", latest_flow_run("merge-ckpt-step1").id)
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert [r["layer"] for r in rows] == [layer["module"] for layer in record["layers"]]
    assert float(rows[0]["retained"]) == round(min(layer["retained"] for layer in record["layers"]), 6)
    assert f"energy-weighted retained {record['summary']['energy_weighted_retained']:.6f}" in table.description
    # `test` recomputes the kept norms from the adapter file: a rescaled factor is caught
    tampered = dict(record)
    tampered["layers"] = [dict(record["layers"][0], kept_norm=record["layers"][0]["kept_norm"] * 1.01)] + record["layers"][1:]
    _rewrite_listed(adapter_dir, EXTRACTION_NAME, (json.dumps(tampered, indent=2, sort_keys=True) + "\n").encode())
    with pytest.raises(ArtifactInvalidError, match="kept norm"):
        validate_artifact(adapter_dir)


def _rewrite_listed(adapter_dir: Path, name: str, raw: bytes) -> None:
    """Rewrite a listed file and its manifest entry (so only the figures, not the digest, are wrong)."""
    import hashlib

    (adapter_dir / name).write_bytes(raw)
    manifest_path = adapter_dir / "merge_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][name] = hashlib.sha256(raw).hexdigest()
    manifest_path.write_text(dumps_canonical(manifest))


def test_refusals_publish_nothing(tmp_path: Path, prefect_api: object, flux_known_rank) -> None:
    _, _, base_dir, actor_dir, _ = flux_known_rank
    with pytest.raises(UsageError, match="smallest dimension"):
        merge_model(config(actor_dir, base_dir, tmp_path / "big", extract_lora=10_000))
    assert not (tmp_path / "big").exists()
    with pytest.raises(UsageError, match="renames; pass --output_format transformer"):
        merge_model(config(actor_dir, base_dir, tmp_path / "single", extract_lora=RANK, output_format="single_file"))
    assert not (tmp_path / "single").exists()
    other = save_base_transformer(build_transformer("FluxTransformer2DModel", seed=0,
                                                    config_overrides={"joint_attention_dim": 8}), tmp_path / "other")
    with pytest.raises(SchemaMismatchError):
        merge_model(config(actor_dir, other, tmp_path / "shapes", extract_lora=RANK))
    assert not (tmp_path / "shapes").exists()


def test_a_lora_checkpoint_is_refused(tmp_path: Path, prefect_api: object) -> None:
    from lora_builders import ATTN_TARGETS, build_lora_checkpoint
    from peft import LoraConfig

    ck = build_lora_checkpoint(tmp_path, "FluxTransformer2DModel",
                               lambda name: LoraConfig(r=2, lora_alpha=2, target_modules=ATTN_TARGETS), world_size=1,
                               layout="full_state")
    with pytest.raises(LoraError, match="LoRA checkpoint already"):
        merge_model(ck.config(tmp_path / "out", extract_lora=2))
    assert not (tmp_path / "out").exists()


# --- every architecture, both layouts -------------------------------------------------------------------------

CLASSES = ["FluxTransformer2DModel", "SD3Transformer2DModel", "QwenImageTransformer2DModel", "WanTransformer3DModel",
           "LTX2VideoTransformer3DModel", "MiniMaxH3Transformer3DModel"]


@pytest.mark.parametrize("class_name", CLASSES)
def test_every_architecture_from_verl_rank_files_recovers_a_known_rank_fine_tune(
    tmp_path: Path, prefect_api: object, class_name: str
) -> None:
    base, actor, base_dir, actor_dir, deltas = known_rank_checkpoint(tmp_path, class_name, world_size=2)
    out = Path(merge_model(config(actor_dir, base_dir, tmp_path / "out", extract_lora=RANK)).output_dir)
    adapter_dir = out / "lora_adapter"
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    assert len(weights) == 2 * len(deltas)
    for module, delta in deltas.items():
        a, b = weights[f"base_model.model.{module}.lora_A.weight"], weights[f"base_model.model.{module}.lora_B.weight"]
        assert float(torch.linalg.norm(b @ a - delta) / torch.linalg.norm(delta)) < 1e-5, module
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).base_model.model.eval()
    for want, got in zip(run_tiny_forward(actor.eval()), run_tiny_forward(loaded), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert validate_artifact(adapter_dir)["integrity"] == "passed"


DCP_CLASSES = ["FluxTransformer2DModel", "WanTransformer3DModel", "MiniMaxH3Transformer3DModel"]


@pytest.mark.parametrize("class_name", DCP_CLASSES)
def test_a_dcp_with_extract_energy_gives_per_layer_ranks_that_peft_loads(
    tmp_path: Path, prefect_api: object, class_name: str
) -> None:
    from fixtures.dcp_writers import write_dcp_checkpoint

    ck = write_dcp_checkpoint(tmp_path / "dcp", class_name=class_name, world_size=2)
    target = tmp_path / "out"
    cfg = config(ck.dcp_dir, ck.base_dir, target, extract_lora=3, extract_energy=0.5)
    adapter_dir = Path(merge_model(cfg).output_dir) / "lora_adapter"
    record = json.loads((adapter_dir / EXTRACTION_NAME).read_text())
    ranks = {layer["module"]: layer["rank"] for layer in record["layers"]}
    assert set(ranks.values()) <= {1, 2, 3} and len(set(ranks.values())) > 1  # the energy picks per layer
    assert all(layer["retained"] >= 0.5 or layer["rank"] == 3 for layer in record["layers"])
    peft_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert peft_config["r"] == max(ranks.values())
    assert peft_config["rank_pattern"] == {"^" + re.escape(m): r for m, r in ranks.items() if r != peft_config["r"]}
    # PEFT's load (rank_pattern, alpha_pattern) equals the base with every B @ A added by hand
    base = getattr(__import__("diffusers"), class_name).from_pretrained(ck.base_dir, local_files_only=True).eval()
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    by_hand = copy.deepcopy(base)
    with torch.no_grad():
        for module in ranks:
            a, b = weights[f"base_model.model.{module}.lora_A.weight"], weights[f"base_model.model.{module}.lora_B.weight"]
            by_hand.get_submodule(module).weight.add_(b @ a)
    loaded = PeftModel.from_pretrained(base, adapter_dir).base_model.model.eval()
    for want, got in zip(run_tiny_forward(by_hand), run_tiny_forward(loaded), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert validate_artifact(adapter_dir)["integrity"] == "passed"


def test_comfyui_flux_fuses_qkv_lists_what_its_naming_cannot_carry_and_passes_test(
    tmp_path: Path, prefect_api: object, flux_known_rank
) -> None:
    _, _, base_dir, actor_dir, _ = flux_known_rank
    out = Path(merge_model(config(actor_dir, base_dir, tmp_path / "out", extract_lora=RANK,
                                  adapter_format="comfyui")).output_dir)
    adapter_dir = out / "lora_adapter"
    assert sorted(p.name for p in adapter_dir.iterdir()) == ["README.md", "lora_comfyui.safetensors", EXTRACTION_NAME,
                                                             "merge_manifest.json", "merge_manifest.sha256"]
    record = json.loads((adapter_dir / EXTRACTION_NAME).read_text())
    # Every Flux linear has a kohya name, outside the blocks too (the embedders: img_in, txt_in, ...):
    # nothing of this all-linear update is left out.
    dropped = {item["name"]: item for item in record["not_extracted"]}
    assert "context_embedder.weight" not in dropped and record["summary"]["not_extracted_delta_norm"] == 0
    weights = load_file(adapter_dir / "lora_comfyui.safetensors")
    assert "lora_unet_txt_in.lora_down.weight" in weights
    qkv = "lora_unet_double_blocks_0_img_attn_qkv"
    assert weights[f"{qkv}.lora_down.weight"].shape[0] == 3 * RANK  # to_q, to_k, to_v: one block-structured LoRA
    assert validate_artifact(adapter_dir)["integrity"] == "passed"  # the fused modules checked through the total


def test_comfyui_format_loads_with_load_lora_weights_and_reproduces_the_fine_tune(tmp_path: Path, prefect_api: object) -> None:
    from test_comfyui_lora import pipeline_with

    base, actor, base_dir, actor_dir, _ = known_rank_checkpoint(tmp_path, "QwenImageTransformer2DModel")
    out = Path(merge_model(config(actor_dir, base_dir, tmp_path / "out", extract_lora=RANK,
                                  adapter_format="comfyui")).output_dir)
    adapter_dir = out / "lora_adapter"
    record = json.loads((adapter_dir / EXTRACTION_NAME).read_text())
    expected = copy.deepcopy(base)  # the base with every extracted layer's dW added (exact: the update is rank 2)
    with torch.no_grad():
        for layer in record["layers"]:
            name = layer["module"]
            expected.get_submodule(name).weight.copy_(actor.get_submodule(name).weight)
    assert len(record["layers"]) > 10
    pipe = pipeline_with("QwenImagePipeline", copy.deepcopy(base))
    pipe.load_lora_weights(str(adapter_dir), weight_name="lora_comfyui.safetensors", adapter_name="x")  # type: ignore[attr-defined]
    for want, got in zip(run_tiny_forward(expected.eval()), run_tiny_forward(pipe.transformer.eval()), strict=True):  # type: ignore[attr-defined]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert validate_artifact(adapter_dir)["integrity"] == "passed"


# --- the entry points ------------------------------------------------------------------------------------------


def test_every_entry_point_carries_extract_lora(tmp_path: Path) -> None:
    from prefect.utilities.callables import parameter_schema

    from mergeflow.deployments.serve import ServeSettings
    from mergeflow.flows.backfill_flow import backfill_flow
    from mergeflow.flows.checkpoint import (
        merge_checkpoint_flow,
        resolve_checkpoint_config,
    )
    from mergeflow.io.confinement import Confinement
    from mergeflow.ops.backfill import BackfillSettings

    for flow in (merge_checkpoint_flow, backfill_flow):  # the deployments' typed forms
        props = parameter_schema(flow.fn).model_dump()["properties"]
        assert {"integer", "null"} == {t["type"] for t in props["extract_lora"]["anyOf"]}
        assert {"number", "null"} == {t["type"] for t in props["extract_energy"]["anyOf"]}
        assert props["extract_lora"]["description"] and props["extract_energy"]["description"]
    for part in ("ckpt/run/global_step_3/actor", "base", "out"):
        (tmp_path / part).mkdir(parents=True)
    confinement = Confinement.of([str(tmp_path / "ckpt")], str(tmp_path / "out"), [str(tmp_path / "base")])
    payload = {"local_dir": str(tmp_path / "ckpt/run/global_step_3/actor")}
    resolved = resolve_checkpoint_config(payload, confinement=confinement, base_model=str(tmp_path / "base"),
                                         target_root=str(tmp_path / "out"), extract_lora=16, extract_energy=0.9)
    assert (resolved.extract_lora, resolved.extract_energy) == (16, 0.9)
    with pytest.raises(UsageError, match="rank >= 1"):
        resolve_checkpoint_config(payload, confinement=confinement, base_model=str(tmp_path / "base"),
                                  target_root=str(tmp_path / "out"), extract_lora=0)
    settings = ServeSettings(base_model="/b", target_root="/t", checkpoint_roots=("/c",), extract_lora=8, extract_energy=0.5)
    assert settings.parameters()["extract_lora"] == 8 and settings.backfill_parameters()["extract_energy"] == 0.5
    assert BackfillSettings(train_dir="/t", base_model="/b", target_root="/o", extract_lora=4).extract_lora == 4


def test_the_command_line_flags(tmp_path: Path) -> None:
    from mergeflow.flows.cli import build_parser

    args = build_parser().parse_args(["merge", "--backend", "fsdp", "--local_dir", "a", "--target_dir", "b", "--base_model", "c",
                                      "--extract-lora", "32", "--extract-energy", "0.95", "--adapter-format", "comfyui"])
    assert (args.extract_lora, args.extract_energy, args.adapter_format) == (32, 0.95, "comfyui")
    from mergeflow.flows.ops_cli import backfill_settings

    parser = build_parser()
    back = parser.parse_args(["backfill", "t", "--base_model", "b", "--target-root", "r", "--extract-lora", "4"])
    assert backfill_settings(back).extract_lora == 4


def test_the_command_line_extracts_a_diffusers_lora_that_load_lora_weights_reproduces(
    tmp_path: Path, prefect_server, flux_known_rank  # type: ignore[no-untyped-def]
) -> None:
    import forked_cli
    from test_comfyui_lora import pipeline_with

    env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}
    base, actor, base_dir, actor_dir, _ = flux_known_rank
    args = ["merge", "--backend", "fsdp", "--local_dir", str(actor_dir), "--target_dir", str(tmp_path / "out"),
            "--base_model", str(base_dir), "--output_format", "transformer"]
    refused = forked_cli.mergeflow([*args, "--extract-lora", "0"], env)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "mergeflow: error: --extract-lora must be a rank >= 1, not 0")
    done = forked_cli.mergeflow([*args, "--extract-lora", str(RANK), "--adapter-format", "diffusers"], env)
    assert done.returncode == 0, done.stderr
    adapter_dir = tmp_path / "out" / "lora_adapter"
    pipe = pipeline_with("FluxPipeline", copy.deepcopy(base))
    pipe.load_lora_weights(str(adapter_dir), weight_name="pytorch_lora_weights.safetensors", adapter_name="x")  # type: ignore[attr-defined]
    for want, got in zip(run_tiny_forward(actor.eval()), run_tiny_forward(pipe.transformer.eval()), strict=True):  # type: ignore[attr-defined]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    checked = forked_cli.mergeflow(["test", "--backend", "fsdp", "--test_hf_dir", str(tmp_path / "out")], env)
    assert checked.returncode == 0 and json.loads(checked.stdout.strip().splitlines()[-1])["integrity"] == "passed"


def test_boogu_remote_code_from_its_pipeline_base(tmp_path: Path, prefect_api: object) -> None:
    from fixtures.boogu import build_boogu_pipeline, load_boogu_transformer
    from test_pipelines import _boogu_forward

    base_dir = build_boogu_pipeline(tmp_path / "base")
    base = load_boogu_transformer(base_dir)
    actor = copy.deepcopy(base)
    deltas = low_rank_finetune_(actor, RANK)
    actor_dir = save_fsdp_checkpoint(actor, tmp_path / "ckpt" / "global_step_1" / "actor", 2)
    out = Path(merge_model(config(actor_dir, base_dir, tmp_path / "out", output_format="pipeline",
                                  trust_remote_code=True, extract_lora=RANK)).output_dir)
    adapter_dir = out / "lora_adapter"
    record = json.loads((adapter_dir / EXTRACTION_NAME).read_text())
    # remote code is never run: which weights are linear comes from their shapes and names, here all of them
    assert {layer["module"] for layer in record["layers"]} == set(deltas)
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).base_model.model
    for want, got in zip(_boogu_forward(actor), _boogu_forward(loaded), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert validate_artifact(adapter_dir)["integrity"] == "passed"
