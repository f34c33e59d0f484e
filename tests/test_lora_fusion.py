"""--fuse-lora through the real merge flow: fused weights equal PEFT's own merge, every variant, every refusal."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import diffusers
import pytest
import torch
from builders import assert_bit_exact, leftovers, make_export, output_state
from lora_builders import (
    ATTN_TARGETS,
    LoraCheckpoint,
    build_lora_checkpoint,
    keep_lora_only,
)
from peft import LoraConfig, PeftModel
from rank_tools import rewrite_rank
from ulps import operand_ulps

from mergeflow import merge_model, validate_artifact
from mergeflow.demo.checkpoints import run_tiny_forward
from mergeflow.errors import CheckpointError, LoraError, UsageError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")

EXTRA = {
    "FluxTransformer2DModel": ["proj_mlp"],
    "WanTransformer3DModel": ["patch_embedding"],  # Conv3d LoRA
    "SD3Transformer2DModel": ["proj"],  # pos_embed.proj, a Conv2d
    "QwenImageTransformer2DModel": ["add_q_proj", "img_mlp.net.2"],
}

# class, layout, world size, PeftModel-wrapped keys, fused adapter, adapter_config.json beside the checkpoint
CASES = [
    ("FluxTransformer2DModel", "full_state", 3, True, "default", None),
    ("FluxTransformer2DModel", "lora_only", 1, False, "old", None),
    ("WanTransformer3DModel", "full_state", 3, False, "default", "huggingface"),  # conv fusion needs the config
    ("WanTransformer3DModel", "lora_only", 1, True, "default", "actor"),
    ("SD3Transformer2DModel", "lora_only", 3, True, "old", "huggingface"),
    ("QwenImageTransformer2DModel", "full_state", 1, True, "old", None),
]


def plain(class_name: str):  # noqa: ANN201
    return lambda name: LoraConfig(r=4, lora_alpha=8, target_modules=ATTN_TARGETS + EXTRA[class_name])


def fused(out: Path) -> dict:
    """The published fused model's manifest, after checking nothing else was left or written."""
    assert not leftovers(out.parent, f".{out.name}"), "staging or lock left behind"
    assert not (out / "lora_adapter").exists()
    return json.loads((out / "merge_manifest.json").read_text())


@pytest.mark.parametrize("class_name,layout,world_size,wrapped,adapter,config_at", CASES,
                         ids=[f"{c[0][:5]}-{c[1]}-w{c[2]}-{c[4]}" for c in CASES])
def test_fused_model_equals_peft_merge_and_unload_bit_exactly(
    tmp_path: Path, prefect_api: object, class_name: str, layout: str, world_size: int, wrapped: bool,
    adapter: str, config_at: str | None,
) -> None:
    # PEFT's own merge cannot handle a 1x1x1 Conv3d (its 1x1 branch squeezes the wrong dims): patch (1, 2, 2)
    overrides = {"patch_size": (1, 2, 2)} if class_name == "WanTransformer3DModel" else None
    ck = build_lora_checkpoint(tmp_path, class_name, plain(class_name), world_size=world_size, layout=layout,
                               wrapped=wrapped, adapter_config=config_at, config_overrides=overrides)
    result = merge_model(ck.config(tmp_path / "out", fuse_lora=True, adapter_name=adapter))
    out = Path(result.output_dir)
    manifest = fused(out)
    expected = ck.merged(adapter)
    assert_bit_exact(expected, output_state(out))
    record = manifest["lora_fusion"]
    modules = sorted({k.rsplit(".lora_A.", 1)[0].removeprefix("base_model.model.")
                      for k in ck.peft.state_dict() if f".lora_A.{adapter}." in k})
    assert record == {
        "adapter_name": adapter, "r": 4, "lora_alpha": 8, "scaling": 2.0,
        "base_weights": "checkpoint" if layout == "full_state" else "base_model",
        "fused_modules": modules, "excluded_adapters": sorted({"default", "old"} - {adapter}),
        "settings_source": {None: "lora_train_meta.json", "actor": "adapter_config.json",
                            "huggingface": "huggingface/adapter_config.json"}[config_at],
    }
    assert "lora_train_meta.json" in manifest["source_files"]
    if layout == "lora_only":  # the frozen weights were read from the base's safetensors
        assert "diffusion_pytorch_model.safetensors" in manifest["base_files"]
    assert validate_artifact(out) == {"integrity": "passed", "architecture": class_name}
    # a complete model: plain from_pretrained, no PEFT, and it runs like the trained LoRA model
    loaded = getattr(diffusers, class_name).from_pretrained(out, local_files_only=True)
    for a, b in zip(ck.forward(adapter), run_tiny_forward(loaded.eval()), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_bfloat16_base_is_the_float32_merge_rounded_once(tmp_path: Path, prefect_api: object) -> None:
    make = lambda n: LoraConfig(r=4, lora_alpha=8, target_modules=ATTN_TARGETS)  # noqa: E731
    ck = build_lora_checkpoint(tmp_path, "WanTransformer3DModel", make, world_size=3, dtype=torch.bfloat16)
    out = Path(merge_model(ck.config(tmp_path / "out", fuse_lora=True)).output_dir)
    ours = output_state(out)
    theirs = ck.merged("default")  # PEFT's own merge: rounds the delta to bf16, then adds in bf16
    exact = copy.deepcopy(ck.peft).to(torch.float32).merge_and_unload(adapter_names=["default"]).state_dict()
    assert {v.dtype for v in ours.values()} == {torch.bfloat16, torch.float32}  # _keep_in_fp32_modules stay fp32
    # float32 math, one rounding: bit-identical to PEFT's float32 merge rounded once to each tensor's dtype
    assert_bit_exact({k: v.to(theirs[k].dtype) for k, v in exact.items()}, ours)
    weights = ck.peft.base_model.model.state_dict()
    changed = [k for k in theirs if theirs[k].dtype == torch.bfloat16 and not torch.equal(ours[k], theirs[k])]
    for key in changed:  # within one ulp of the largest operand of PEFT's bf16 sum
        base = weights[key.replace(".weight", ".base_layer.weight")].float()
        scale = torch.stack([base.abs(), (exact[key] - base).abs(), exact[key].abs()]).amax(0)
        assert operand_ulps(ours[key], theirs[key], scale) <= 1.0, key


def _perturb_saved(model: PeftModel) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".modules_to_save." in name:
                param.add_(0.05)


FLUX = "FluxTransformer2DModel"
TARGETS = ["to_q", "to_k", "to_out.0", "proj_mlp"]
VARIANTS = {
    "rslora": ("lora_only", 3, lambda n: LoraConfig(r=4, lora_alpha=6, use_rslora=True, target_modules=TARGETS), None),
    "dora": ("full_state", 3, lambda n: LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=TARGETS), None),
    "lora-bias": ("lora_only", 1, lambda n: LoraConfig(r=4, lora_alpha=8, lora_bias=True, target_modules=["to_q", "to_out.0"]), None),
    "patterns": ("full_state", 3, lambda n: LoraConfig(
        r=4, lora_alpha=8, target_modules=["to_q", "to_k", "proj_mlp"],
        rank_pattern={"^single_transformer_blocks.0.attn.to_q": 6, "attn.to_k": 2},
        alpha_pattern={"to_q": 16, r"single_transformer_blocks\.0\.proj_mlp": 3}), None),
    "modules-to-save": ("full_state", 3, lambda n: LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                              modules_to_save=["proj_out"]), _perturb_saved),
}


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_fusion_equals_peft_merge(tmp_path: Path, prefect_api: object, variant: str) -> None:
    layout, world_size, make, mutate = VARIANTS[variant]
    ck = build_lora_checkpoint(tmp_path, FLUX, make, world_size=world_size, layout=layout,
                               adapter_config=None if variant == "modules-to-save" else "huggingface", mutate=mutate)
    out = Path(merge_model(ck.config(tmp_path / "out", fuse_lora=True)).output_dir)
    manifest = fused(out)
    assert_bit_exact(ck.merged("default"), output_state(out))
    if variant == "patterns":
        assert manifest["lora_fusion"]["module_scaling"]["single_transformer_blocks.0.attn.to_q"] == 16 / 6
    if variant == "modules-to-save":
        assert "proj_out.weight" in manifest["lora_fusion"]["replaced_by_modules_to_save"]


def test_dtype_policy_applies_after_fusion(tmp_path: Path, prefect_api: object) -> None:
    ck = build_lora_checkpoint(tmp_path, FLUX, plain(FLUX), world_size=3)
    out = Path(merge_model(ck.config(tmp_path / "out", fuse_lora=True, dtype="bfloat16")).output_dir)
    assert_bit_exact({k: v.to(torch.bfloat16) for k, v in ck.merged("default").items()}, output_state(out))


PISSA = lambda n: LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k"],  # noqa: E731
                             init_lora_weights="pissa" if n == "default" else True)


def test_pissa_full_state_fuses_and_lora_only_is_refused(tmp_path: Path, prefect_api: object) -> None:
    ck = build_lora_checkpoint(tmp_path, FLUX, PISSA, world_size=3, adapter_config="huggingface")
    out = Path(merge_model(ck.config(tmp_path / "out", fuse_lora=True)).output_dir)
    # PiSSA rewrote the frozen weights: fusing into the checkpoint's own base is exactly PEFT's merge
    assert_bit_exact(ck.merged("default"), output_state(out))
    assert json.loads((out / "merge_manifest.json").read_text())["lora_fusion"]["base_weights"] == "checkpoint"
    lora_only = tmp_path / "lora-only-actor"
    shutil.copytree(ck.actor_dir, lora_only)
    keep_lora_only(lora_only, 3)
    refused = ck.config(tmp_path / "refused", local_dir=str(lora_only), fuse_lora=True)
    with pytest.raises(LoraError, match="init_lora_weights='pissa' rewrote the base weights"):
        merge_model(refused)
    assert not leftovers(tmp_path, "refused")
    # without fusion the LoRA-only adapter exports fine (PEFT loads it onto its own residual base)
    assert Path(merge_model(ck.config(tmp_path / "adapter", local_dir=str(lora_only))).output_dir).is_dir()


# ---------------------------------------------------------------- refusals (SPEC section 6 / issue point 5)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> LoraCheckpoint:
    root = tmp_path_factory.mktemp("small-lora")
    return build_lora_checkpoint(root, FLUX, plain(FLUX), world_size=2, layout="full_state")


def copy_actor(ck: LoraCheckpoint, tmp_path: Path) -> Path:
    actor = tmp_path / "actor"
    shutil.copytree(ck.actor_dir, actor)
    return actor


def refuse(config: object, error: type[Exception], match: str) -> Exception:
    target = Path(config.target_dir)  # type: ignore[attr-defined]
    with pytest.raises(error, match=match) as info:
        merge_model(config)  # type: ignore[arg-type]
    assert not target.exists()
    left = leftovers(target.parent, f".{target.name}.")
    assert all(".mergeflow-staging-" in name for name in left), left
    assert bool(left) == bool(getattr(info.value, "staging_dir", None)), "staging kept but not reported"
    assert "\n" not in str(info.value)
    return info.value


def _edit_ranks(actor: Path, world_size: int, change) -> None:  # noqa: ANN001
    for rank in range(world_size):
        rewrite_rank(actor / f"model_world_size_{world_size}_rank_{rank}.pt", change)


def test_checkpoint_refusals_leave_no_output(tmp_path: Path, prefect_api: object, small: LoraCheckpoint) -> None:
    def case(name: str, edit, error: type[Exception], match: str, **flags: object) -> None:  # noqa: ANN001
        actor = tmp_path / name / "actor"
        shutil.copytree(small.actor_dir, actor)
        edit(actor)
        refuse(small.config(tmp_path / name / "out", local_dir=str(actor), **flags), error, match)

    def meta(text: str):  # noqa: ANN202
        return lambda actor: (actor / "lora_train_meta.json").write_text(text)

    def drop(suffix: str):  # noqa: ANN202
        return lambda actor: _edit_ranks(actor, 2, lambda s: [s.pop(k) for k in list(s) if k.endswith(suffix)])

    def retarget(actor: Path) -> None:  # a LoRA on an RMSNorm (1-D weight): not a linear or conv layer
        def change(state: dict) -> None:
            for key in [k for k in state if "transformer_blocks.0.attn.to_k." in k and not k.startswith("base_model.model.single")]:
                state[key.replace("attn.to_k.", "attn.norm_q.")] = state.pop(key)
        _edit_ranks(actor, 2, change)

    def overflow(actor: Path) -> None:
        def change(state: dict) -> None:
            for key, value in state.items():
                if ".lora_A.default." in key:
                    value.to_local().fill_(1.0)
                elif ".lora_B.default." in key:
                    value.to_local().fill_(1e38)  # finite, but B @ A * s is not
        _edit_ranks(actor, 2, change)

    def collide(actor: Path) -> None:  # one weight under both its wrapped and its plain name
        _edit_ranks(actor, 2, lambda s: s.update({k.removeprefix("base_model.model."): v for k, v in list(s.items())
                                                  if k.endswith("to_q.lora_A.default.weight")}))

    case("collision", collide, CheckpointError, "both mean")
    case("unpaired", drop("to_k.lora_B.old.weight"), LoraError, r"unpaired LoRA weights.*adapter 'old' has only lora_A")
    case("rank", meta('{"r": 8, "lora_alpha": 8, "task_type": null}'), LoraError, "adapter rank is 4 but the LoRA settings say r=8")
    case("r-zero", meta('{"r": 0, "lora_alpha": 8, "task_type": null}'), LoraError, "r must be a positive integer")
    case("r-float", meta('{"r": 4.5, "lora_alpha": 8, "task_type": null}'), LoraError, "r must be a positive integer")
    case("alpha-str", meta('{"r": 4, "lora_alpha": "8", "task_type": null}'), LoraError, "lora_alpha must be a positive integer")
    case("no-meta", lambda actor: (actor / "lora_train_meta.json").unlink(), LoraError, "lora_train_meta.json is missing")
    case("unknown", lambda actor: None, LoraError, r"adapter 'new' is not in the checkpoint \(available: default, old\)",
         adapter_name="new", fuse_lora=True)
    case("non-linear", retarget, LoraError, "norm_q: LoRA targets a tensor of shape .* not a linear or conv weight")
    case("config-missing", lambda actor: None, UsageError, "--adapter-config .* is not a file",
         adapter_config=str(tmp_path / "missing.json"))
    err = refuse(small.config(tmp_path / "overflow" / "out", local_dir=str(_prepared(tmp_path, small, overflow)),
                              fuse_lora=True), LoraError, "non-finite weights")
    assert "to_" in str(err)


def test_fsdp1_wrapper_names_are_normalised(tmp_path: Path, prefect_api: object, small: LoraCheckpoint) -> None:
    actor = copy_actor(small, tmp_path)

    def wrap(state: dict) -> None:  # FSDP1 names: a wrapper around the model and one around each block
        for key in list(state):
            wrapped = "_fsdp_wrapped_module." + key.replace("blocks.0.", "blocks.0._fsdp_wrapped_module.")
            state[wrapped] = state.pop(key)

    _edit_ranks(actor, 2, wrap)
    out = Path(merge_model(small.config(tmp_path / "out", local_dir=str(actor), fuse_lora=True)).output_dir)
    assert_bit_exact(small.merged("default"), output_state(out))


def _prepared(tmp_path: Path, ck: LoraCheckpoint, edit) -> Path:  # noqa: ANN001
    actor = tmp_path / "overflow" / "actor"
    shutil.copytree(ck.actor_dir, actor)
    edit(actor)
    return actor


def test_lora_flags_and_metadata_without_lora_are_refused(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, FLUX, 2)
    # The pre-flight's refusal, now the first stage of the flow's own planning too (one copy of each refusal).
    refuse(ex.config(tmp_path / "fuse", fuse_lora=True), UsageError, "--fuse-lora is for LoRA checkpoints")
    # Every adapter flag, not only --fuse-lora: the flow refuses what the pre-flight refuses.
    refuse(ex.config(tmp_path / "name", adapter_name="mine"), UsageError, "--adapter-name is for LoRA checkpoints")
    refuse(ex.config(tmp_path / "format", adapter_format="diffusers"), UsageError, "--adapter-format is for LoRA checkpoints")
    (ex.actor_dir / "lora_train_meta.json").write_text('{"r": 4, "lora_alpha": 8, "task_type": null}')
    refuse(ex.config(tmp_path / "meta"), LoraError, "lora_train_meta.json says this is a LoRA run, but the rank files hold no LoRA keys")


def test_dora_and_conv_fusion_without_their_config_are_refused(tmp_path: Path, prefect_api: object) -> None:
    make = lambda n: LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["to_q", "patch_embedding"])  # noqa: E731
    ck = build_lora_checkpoint(tmp_path, "WanTransformer3DModel", make, world_size=1, layout="lora_only")
    err = refuse(ck.config(tmp_path / "dora", fuse_lora=True), LoraError, "cannot fuse adapter 'default' from lora_train_meta.json alone")
    assert "DoRA magnitude vectors" in str(err) and "conv LoRA on 1 module(s) (patch_embedding)" in str(err)
    assert "--adapter-config PATH" in str(err)


# ---------------------------------------------------------------- MiniMax H3 native package


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")  # the synthetic native VAE
def test_minimax_h3_native_fuses_before_conversion_and_refuses_adapters(tmp_path: Path, prefect_api: object) -> None:
    from fixtures.minimax_h3 import build_minimax_h3_native, reference_native_state_dict

    h3 = "MiniMaxH3Transformer3DModel"
    make = lambda n: LoraConfig(r=4, lora_alpha=8, target_modules=ATTN_TARGETS + ["net.0.proj"])  # noqa: E731
    ck = build_lora_checkpoint(tmp_path, h3, make, world_size=3)
    native = build_minimax_h3_native(tmp_path / "native", getattr(diffusers, h3).from_pretrained(ck.base_dir))
    result = merge_model(ck.config(tmp_path / "fused", base_model=str(native), output_format="pipeline", fuse_lora=True))
    written = output_state(Path(result.output_dir) / "transformer")
    # LoRA folded into q / k / v / ff first, then fused into qkv_proj and swapped: the reference conversion
    # of PEFT's own merge, bit for bit
    merged = ck.merged("default")
    expected = reference_native_state_dict(merged, dict(ck.peft.base_model.model.config))
    assert_bit_exact(expected, written)
    assert json.loads(Path(result.manifest_path).read_text())["lora_fusion"]["adapter_name"] == "default"
    refuse(ck.config(tmp_path / "adapter", base_model=str(native), output_format="pipeline"), LoraError,
           "would not load there. Use --fuse-lora")
    lora_only = tmp_path / "lora-only-actor"
    shutil.copytree(ck.actor_dir, lora_only)
    keep_lora_only(lora_only, 3)
    for fuse in (False, True):
        refuse(ck.config(tmp_path / f"lora-only-{fuse}", local_dir=str(lora_only), base_model=str(native),
                         output_format="pipeline", fuse_lora=fuse), LoraError, "LoRA-only save cannot go into a native MiniMax H3")
