"""LoRA domain layer against real PEFT 0.21 on tiny real Diffusers transformers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from diffusers import (
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
)
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import save_file
from ulps import operand_ulps

from mergeflow.errors import CheckpointError, LoraError
from mergeflow.lora.config import (
    AdapterSettings,
    LoraTrainMeta,
    fusion_blockers,
    load_adapter_settings,
    lora_only_blockers,
    parse_train_meta,
    peft_adapter_config,
    rank_for,
    requires_full_config,
    rewrites_base_weights,
    scaling_for,
    settings_from_config_dict,
)
from mergeflow.lora.export import (
    DIFFUSERS_LORA_WEIGHTS_NAME,
    DIFFUSERS_METADATA_KEY,
    adapter_config_json,
    diffusers_lora_keys,
    diffusers_lora_metadata,
    peft_adapter_keys,
)
from mergeflow.lora.keys import (
    LoraLayout,
    base_key_for,
    base_state_keys,
    classify,
    group_adapters,
    is_adapter_only_key,
    normalize_key,
    normalize_keys,
    require_adapter,
    saved_module_overrides,
    saved_modules,
    target_modules,
)
from mergeflow.lora.math import check_adapter_shapes, fuse_bias, fuse_weight

ConfigFactory = Callable[[str], LoraConfig]

# PEFT itself reports the deliberately non-matching patterns of the "patterns" variant.
pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")


def tiny_flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    )


def tiny_wan() -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=16,
        num_layers=1,
        rope_max_seq_len=32,
    )


def tiny_sd3(patch_size: int) -> SD3Transformer2DModel:
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=patch_size,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=8,
        out_channels=4,
        pos_embed_max_size=16,
    )


def with_two_adapters(model: torch.nn.Module, make: ConfigFactory) -> PeftModel:
    """PEFT model with adapters `default` and `old` (DiffusionNFT), all LoRA tensors random and non-zero."""
    peft_model = get_peft_model(model, make("default"))
    peft_model.add_adapter("old", make("old"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                # Move the magnitude off ||W + sBA|| so a wrong DoRA formula cannot pass by accident.
                param.mul_(1 + 0.2 * torch.rand_like(param))
            elif "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    return peft_model


def fsdp_wrapped(key: str) -> str:
    """The key as FSDP1 (one wrapper around the model, one around each block) names it."""
    return "_fsdp_wrapped_module." + key.replace("blocks.0.", "blocks.0._fsdp_wrapped_module.")


def fused_state(state: dict[str, torch.Tensor], adapter: str, settings: AdapterSettings) -> dict[str, torch.Tensor]:
    """What the streaming writer does, tensor by tensor: the fused model for one adapter."""
    base = base_state_keys(state)
    out = {name: state[src] for name, src in base.items()}
    out.update({name: state[src] for name, src in saved_module_overrides(state, adapter).items()})
    for module, item in require_adapter(group_adapters(state), adapter).items():
        weight_key = f"{module}.weight"
        magnitude = state[item.lora_magnitude_vector] if item.lora_magnitude_vector else None
        scaling = scaling_for(module, settings)
        out[weight_key] = fuse_weight(
            state[base[weight_key]],
            state[item.lora_A],
            state[item.lora_B],
            scaling=scaling,
            magnitude=magnitude,
            rank=rank_for(module, settings),
            module=module,
        )
        if item.lora_B_bias:
            bias_key = f"{module}.bias"
            out[bias_key] = fuse_bias(state[base[bias_key]], state[item.lora_B_bias], scaling=scaling, module=module)
    return out


def peft_merged(peft_model: PeftModel, adapter: str) -> dict[str, torch.Tensor]:
    """PEFT's own merge of one adapter."""
    reference = copy.deepcopy(peft_model)
    reference.set_adapter(adapter)
    return reference.merge_and_unload(adapter_names=[adapter]).state_dict()


def assert_bitwise(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype, key
        assert ours[key].shape == value.shape, key
        assert torch.equal(ours[key].view(torch.uint8), value.contiguous().view(torch.uint8)), key


def settings_of(peft_model: PeftModel, adapter: str) -> AdapterSettings:
    return settings_from_config_dict(json.loads(json.dumps(_json_config(peft_model.peft_config[adapter]))))


def _json_config(config: LoraConfig) -> dict:
    data = config.to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in data.items()}


FLUX_TARGETS = ["to_q", "to_k", "to_out.0", "proj_mlp"]

VARIANTS: dict[str, ConfigFactory] = {
    "plain": lambda name: LoraConfig(
        r=4 if name == "default" else 2,
        lora_alpha=8,
        target_modules=FLUX_TARGETS,
        init_lora_weights=False,
        modules_to_save=["proj_out"],
    ),
    "rslora": lambda name: LoraConfig(
        r=4, lora_alpha=6 if name == "default" else 3, use_rslora=True, target_modules=FLUX_TARGETS
    ),
    "dora": lambda name: LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=FLUX_TARGETS),
    "lora_bias": lambda name: LoraConfig(r=4, lora_alpha=8, lora_bias=True, target_modules=["to_q", "to_out.0"]),
    "patterns": lambda name: LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["to_q", "to_k"],
        # PEFT matches a pattern against the END of the module path, at a dot boundary: "blocks.0.attn"
        # and "o_q" match nothing, although re.search would find them in every path.
        rank_pattern={"blocks.0.attn": 5, "to_k": 2, "^single_transformer_blocks.0.attn.to_q": 6, "attn.to_q": 3},
        alpha_pattern={"o_q": 7, "to_q": 16, r"single_transformer_blocks\.0\.attn\.to_k": 3},
    ),
}


@pytest.fixture(scope="module")
def flux_models() -> dict[str, PeftModel]:
    return {name: with_two_adapters(tiny_flux(), make) for name, make in VARIANTS.items()}


# ---------------------------------------------------------------- keys


def test_key_helpers_on_real_peft_keys(flux_models: dict[str, PeftModel]) -> None:
    peft_model = flux_models["plain"]
    inner = peft_model.base_model.model.state_dict().keys()
    base_keys = set(tiny_flux().state_dict())
    for keys in (list(peft_model.state_dict()), [fsdp_wrapped(k) for k in peft_model.state_dict()], list(inner)):
        assert sorted(normalize_keys(keys)) == sorted(inner)
        assert classify(keys) is LoraLayout.FULL_STATE
        grouped = group_adapters(keys)
        assert sorted(grouped) == ["default", "old"]
        for adapter, modules in grouped.items():
            assert target_modules(modules) == sorted(FLUX_TARGETS)
            layer = peft_model.base_model.model.get_submodule("transformer_blocks.0.attn.to_out.0")
            assert set(modules) >= {"transformer_blocks.0.attn.to_out.0", "single_transformer_blocks.0.proj_mlp"}
            assert modules["transformer_blocks.0.attn.to_out.0"].lora_A in keys
            assert layer.lora_A[adapter].weight.shape[0] == (4 if adapter == "default" else 2)
        # adapters stripped, base_layer / original_module collapsed: exactly the plain model's keys
        assert set(base_state_keys(keys)) == base_keys
        assert sorted(saved_modules(keys)) == ["default", "old"]
        assert set(saved_module_overrides(keys, "old")) == {
            "proj_out.weight",
            "proj_out.bias",
            "single_transformer_blocks.0.proj_out.weight",
            "single_transformer_blocks.0.proj_out.bias",
        }
    lora_only = [k for k in peft_model.state_dict() if is_adapter_only_key(k)]
    assert classify(lora_only) is LoraLayout.LORA_ONLY
    assert classify([fsdp_wrapped(k) for k in lora_only]) is LoraLayout.LORA_ONLY
    assert classify(base_keys) is LoraLayout.NONE
    assert normalize_key("_fsdp_wrapped_module.base_model.model.a._fsdp_wrapped_module.b.weight") == "a.b.weight"
    assert base_key_for("base_model.model.x.original_module.weight") == "x.weight"
    assert base_key_for("x.base_layer.bias") == "x.bias"
    assert target_modules(["a.to_out.0", "b.attn.to_q", "c.to_q", "0"]) == ["0", "to_out.0", "to_q"]


def test_key_refusals(flux_models: dict[str, PeftModel]) -> None:
    keys = list(flux_models["plain"].state_dict())
    with pytest.raises(CheckpointError, match="both mean"):
        normalize_keys(["a.weight", "_fsdp_wrapped_module.a.weight"])
    broken = [k for k in keys if not k.endswith("attn.to_k.lora_B.old.weight")]
    with pytest.raises(LoraError, match=r"unpaired LoRA weights on 2 module\(s\).*only lora_A"):
        group_adapters(broken)
    grouped = group_adapters(keys)
    with pytest.raises(LoraError, match=r"'new' is not in the checkpoint \(available: default, old\)"):
        require_adapter(grouped, "new")
    with pytest.raises(LoraError, match="not a PEFT LoRA parameter"):
        group_adapters([*keys, "x.lora_C.default.weight"])
    with pytest.raises(LoraError, match="embedding layer"):
        group_adapters(["emb.lora_embedding_A.default", "emb.lora_embedding_B.default"])
    with pytest.raises(LoraError, match="are both the lora_magnitude_vector of x"):
        group_adapters(["x.lora_magnitude_vector.default", "x.lora_magnitude_vector.default.weight"])
    with pytest.raises(LoraError, match="lora_A never has a bias"):
        group_adapters(["x.lora_A.default.bias"])
    no_base = [k.replace(".base_layer.", ".") for k in keys]
    with pytest.raises(LoraError, match="neither a LoRA-only save nor a PEFT full-state save"):
        classify(no_base)
    missing_base = [k for k in keys if "to_q.base_layer.weight" not in k]
    with pytest.raises(LoraError, match="lacks the frozen weight"):
        classify(missing_base)
    with pytest.raises(LoraError, match="non-LoRA adapter parameter"):
        classify(["x.lora_A.default.weight", "x.lora_B.default.weight", "y.adapter_gate.weight"])
    with pytest.raises(CheckpointError, match="both give the weight"):
        base_state_keys(["x.weight", "x.base_layer.weight"])


# ---------------------------------------------------------------- config


def test_train_meta_strict() -> None:
    assert parse_train_meta('{"r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM"}') == LoraTrainMeta(4, 8, "CAUSAL_LM")
    assert parse_train_meta(b'{"r": 4, "lora_alpha": 8}') == LoraTrainMeta(4, 8, None)
    bad = {
        '{"r": 0, "lora_alpha": 8, "task_type": null}': "r must be a positive integer",
        '{"r": -2, "lora_alpha": 8, "task_type": null}': "r must be a positive integer",
        '{"r": true, "lora_alpha": 8, "task_type": null}': "r must be a positive integer",
        '{"r": 4.0, "lora_alpha": 8, "task_type": null}': "r must be a positive integer",
        '{"r": "4", "lora_alpha": 8, "task_type": null}': "r must be a positive integer",
        '{"r": 4, "lora_alpha": 0, "task_type": null}': "lora_alpha must be a positive integer",
        '{"r": 4, "lora_alpha": NaN, "task_type": null}': "NaN is not a valid JSON number",
        '{"r": 4, "task_type": null}': "'lora_alpha' is missing",
        '{"r": 4, "lora_alpha": 8, "task_type": 3}': "task_type must be a string or null",
        '{"r": 4, "r": 8, "lora_alpha": 8, "task_type": null}': "duplicate key 'r'",
        '{"r": 4, "lora_alpha": 8, "task_type": null, "use_rslora": true}': "unknown field",
        "[4, 8]": "must hold a JSON object",
        '{"r": 4,': "not valid JSON",
    }
    for text, message in bad.items():
        with pytest.raises(LoraError, match=message):
            parse_train_meta(text)


def test_scaling_matches_peft_layers(flux_models: dict[str, PeftModel], tmp_path: Path) -> None:
    for variant in ("plain", "rslora", "patterns", "dora"):
        peft_model = flux_models[variant]
        for adapter in ("default", "old"):
            folder = tmp_path / variant / adapter
            peft_model.peft_config[adapter].save_pretrained(folder)
            settings = load_adapter_settings(folder / "adapter_config.json")
            layers = 0
            for path, layer in peft_model.base_model.model.named_modules():
                if hasattr(layer, "scaling") and adapter in layer.scaling:
                    layers += 1
                    assert scaling_for(path, settings) == layer.scaling[adapter], (variant, path)
                    assert rank_for(path, settings) == layer.r[adapter], (variant, path)
            assert layers >= 4
    patterns = settings_of(flux_models["patterns"], "default")
    # first matching pattern wins, in dict order, exactly as PEFT's get_pattern_key
    assert rank_for("single_transformer_blocks.0.attn.to_q", patterns) == 6
    assert rank_for("transformer_blocks.0.attn.to_q", patterns) == 3
    assert scaling_for("single_transformer_blocks.0.attn.to_k", patterns) == 3 / 2
    assert scaling_for("x.to_k", settings_of(flux_models["rslora"], "old")) == 3 / math.sqrt(4)


def test_adapter_settings_and_blockers(tmp_path: Path) -> None:
    plain = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["to_q"]}
    rewriting = ["pissa", "pissa_niter_16", "olora", "corda", "loftq", "lora_ga"]
    harmless = [True, False, "gaussian", "eva", "orthogonal", "mica"]
    for init in rewriting:
        settings = settings_from_config_dict({**plain, "init_lora_weights": init})
        assert rewrites_base_weights(settings) == init
        assert "rewrote the base weights" in lora_only_blockers(settings)[0]
    for init in harmless:
        settings = settings_from_config_dict({**plain, "init_lora_weights": init})
        assert rewrites_base_weights(settings) is None
        assert lora_only_blockers(settings) == []
    assert fusion_blockers(settings_from_config_dict(plain)) == []
    assert "fan_in_fan_out" in fusion_blockers(settings_from_config_dict({**plain, "fan_in_fan_out": True}))[0]
    saved = settings_from_config_dict({**plain, "modules_to_save": ["proj_out"], "bias": "all"})
    assert len(lora_only_blockers(saved)) == 2
    with pytest.raises(LoraError, match="not part of PEFT 0.21's LoraConfig"):
        settings_from_config_dict({**plain, "use_magic": True})
    with pytest.raises(LoraError, match="LoRA adapters only"):
        settings_from_config_dict({**plain, "peft_type": "LOHA"})
    with pytest.raises(LoraError, match="rank_pattern"):
        settings_from_config_dict({**plain, "rank_pattern": {"to_q": 0}})
    duplicate = tmp_path / "adapter_config.json"
    duplicate.write_text('{"r": 4, "r": 8}')
    with pytest.raises(LoraError, match="duplicate key 'r'"):
        load_adapter_settings(duplicate)


def test_requires_full_config(flux_models: dict[str, PeftModel]) -> None:
    def reasons(peft_model: torch.nn.Module) -> list[str]:
        state = peft_model.state_dict()
        modules = require_adapter(group_adapters(state), "default").values()
        return requires_full_config(modules, {k: tuple(v.shape) for k, v in state.items()})

    assert reasons(flux_models["rslora"]) == []
    assert "DoRA" in reasons(flux_models["dora"])[0]
    assert "lora_B biases" in reasons(flux_models["lora_bias"])[0]
    assert "ranks differ" in reasons(flux_models["patterns"])[0]
    wan = get_peft_model(tiny_wan(), LoraConfig(r=2, lora_alpha=4, target_modules=["patch_embedding", "to_q"]))
    assert "conv LoRA on 1 module(s) (patch_embedding)" in reasons(wan)[0]


# ---------------------------------------------------------------- fusion vs PEFT


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fusion_bitwise_equals_peft_merge(flux_models: dict[str, PeftModel], variant: str) -> None:
    peft_model = flux_models[variant]
    state = {fsdp_wrapped(k): v for k, v in peft_model.state_dict().items()}
    for adapter in ("default", "old"):
        assert_bitwise(fused_state(state, adapter, settings_of(peft_model, adapter)), peft_merged(peft_model, adapter))


def test_lora_only_save_fused_into_base_model(flux_models: dict[str, PeftModel]) -> None:
    peft_model = flux_models["rslora"]
    lora_only = {k: v for k, v in peft_model.state_dict().items() if is_adapter_only_key(k)}
    base = tiny_flux().state_dict()  # the frozen weights come from the local base model
    assert classify(lora_only) is LoraLayout.LORA_ONLY
    settings = settings_of(peft_model, "old")
    expected = peft_merged(peft_model, "old")
    modules = require_adapter(group_adapters(lora_only), "old")
    for module, item in modules.items():
        fused = fuse_weight(
            base[f"{module}.weight"],
            lora_only[item.lora_A],
            lora_only[item.lora_B],
            scaling=scaling_for(module, settings),
            rank=4,
            module=module,
        )
        assert torch.equal(fused, expected[f"{module}.weight"]), module
    assert len(modules) == 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fusion_low_precision_rounds_once(flux_models: dict[str, PeftModel], dtype: torch.dtype) -> None:
    low = copy.deepcopy(flux_models["plain"]).to(dtype)
    state = low.state_dict()
    base = base_state_keys(state)
    upcast = copy.deepcopy(low).to(torch.float32)
    for adapter in ("default", "old"):
        ours = fused_state(state, adapter, settings_of(low, adapter))
        exact = peft_merged(upcast, adapter)
        # float32 math, one rounding: identical to PEFT's float32 merge of the same values, rounded once
        assert_bitwise(ours, {k: v.to(dtype) for k, v in exact.items()})
        # PEFT's own low-precision merge rounds the delta to `dtype` before adding, so where W + dW cancels
        # it can be many result-ulps off; it stays within 1 ulp of the largest of |W|, |dW|, |W'| ...
        theirs = peft_merged(low, adapter)
        fused = [k for k in theirs if not torch.equal(theirs[k], state[base[k]])]
        assert len(fused) == len(FLUX_TARGETS) + 2  # to_q, to_k in both block types
        for key in fused:
            weight = state[base[key]].float()
            scale = torch.stack([weight.abs(), (exact[key] - weight).abs(), exact[key].abs()]).amax(0)
            assert operand_ulps(ours[key], theirs[key], scale) <= 1.0, key
            # ... and ours, being the correctly rounded value, is never further from the exact result
            assert bool(((ours[key].float() - exact[key]).abs() <= (theirs[key].float() - exact[key]).abs()).all())


def test_conv3d_lora_and_dora_equal_peft() -> None:
    for use_dora in (False, True):
        peft_model = with_two_adapters(
            tiny_wan(),
            lambda name: LoraConfig(r=3, lora_alpha=5, use_dora=use_dora, target_modules=["patch_embedding", "to_q"]),
        )
        assert peft_model.state_dict()["base_model.model.patch_embedding.lora_A.old.weight"].shape == (3, 4, 1, 2, 2)
        for adapter in ("default", "old"):
            assert_bitwise(
                fused_state(peft_model.state_dict(), adapter, settings_of(peft_model, adapter)),
                peft_merged(peft_model, adapter),
            )


@pytest.mark.parametrize("patch_size", [1, 2])
def test_conv2d_lora_equals_peft(patch_size: int) -> None:
    # patch_size 1 takes PEFT's 1x1 matmul branch, patch_size 2 its conv branch
    peft_model = with_two_adapters(
        tiny_sd3(patch_size), lambda name: LoraConfig(r=2, lora_alpha=3, target_modules=["proj", "to_k"])
    )
    assert "pos_embed.proj" in require_adapter(group_adapters(peft_model.state_dict()), "default")
    for adapter in ("default", "old"):
        assert_bitwise(
            fused_state(peft_model.state_dict(), adapter, settings_of(peft_model, adapter)),
            peft_merged(peft_model, adapter),
        )


def test_fusion_refusals() -> None:
    weight, a, b = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    with pytest.raises(LoraError, match="adapter rank is 2 but the LoRA settings say r=4"):
        fuse_weight(weight, a, b, scaling=1.0, rank=4, module="m")
    with pytest.raises(LoraError, match="adapter maps 5 -> 6 features but the base weight is"):
        fuse_weight(torch.randn(6, 7), a, b, scaling=1.0, module="m")
    with pytest.raises(LoraError, match="lora_B has rank 3"):
        fuse_weight(weight, a, torch.randn(6, 3), scaling=1.0, module="m")
    with pytest.raises(LoraError, match="not a linear or conv weight"):
        fuse_weight(torch.randn(6), a, b, scaling=1.0, module="m")
    with pytest.raises(LoraError, match="do not fit a linear weight"):
        fuse_weight(weight, torch.randn(2, 5, 1, 1), b, scaling=1.0, module="m")
    with pytest.raises(LoraError, match="conv LoRA needs lora_A kernel"):
        fuse_weight(torch.randn(6, 5, 3, 3), torch.randn(2, 5, 1, 1), torch.randn(6, 2, 1, 1), scaling=1.0)
    with pytest.raises(LoraError, match="DoRA magnitude has shape"):
        fuse_weight(weight, a, b, scaling=1.0, magnitude=torch.ones(5))
    with pytest.raises(LoraError, match="cannot fuse LoRA into a torch.int64"):
        fuse_weight(torch.ones(6, 5, dtype=torch.long), a, b, scaling=1.0)
    with pytest.raises(LoraError, match="non-finite weights in torch.float16"):
        fuse_weight(weight.half(), a, b, scaling=1e6, module="m")
    with pytest.raises(LoraError, match="base layer has no bias"):
        check_adapter_shapes("m", (6, 5), (2, 5), (6, 2), lora_bias_shape=(6,))
    with pytest.raises(LoraError, match="does not match base bias"):
        fuse_bias(torch.zeros(6), torch.zeros(5), scaling=1.0)
    # inputs are never modified in place, even float32 ones that `.to(float32)` returns as-is
    before = weight.clone()
    fuse_weight(weight, a, b, scaling=2.0)
    assert torch.equal(weight, before)


# ---------------------------------------------------------------- export


def flux_inputs() -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    return {
        "hidden_states": torch.randn(1, 4, 4),
        "encoder_hidden_states": torch.randn(1, 3, 16),
        "pooled_projections": torch.randn(1, 8),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(4, 3),
        "txt_ids": torch.zeros(3, 3),
    }


def test_peft_adapter_export_reproduces_trained_forward(flux_models: dict[str, PeftModel], tmp_path: Path) -> None:
    trained = flux_models["plain"]
    state = {fsdp_wrapped(k): v for k, v in trained.state_dict().items()}
    modules = require_adapter(group_adapters(state), "old")
    saved = saved_modules(state)["old"]
    # verl's metadata carries r and alpha only; the modules_to_save are exported by full path
    config = peft_adapter_config(LoraTrainMeta(r=2, lora_alpha=8), target_modules(modules), "tiny-flux", saved)
    assert config["task_type"] is None and config["target_modules"] == sorted(FLUX_TARGETS)
    assert config["peft_type"] == "LORA" and config["r"] == 2 and config["lora_alpha"] == 8
    folder = tmp_path / "lora_adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(adapter_config_json(config))
    mapping = peft_adapter_keys(modules, saved)
    assert "base_model.model.transformer_blocks.0.attn.to_out.0.lora_A.weight" in mapping
    assert "base_model.model.proj_out.weight" in mapping
    save_file({k: state[src].contiguous() for k, src in mapping.items()}, folder / "adapter_model.safetensors")

    loaded = PeftModel.from_pretrained(tiny_flux(), folder)
    reference = copy.deepcopy(trained)
    reference.set_adapter("old")
    # set_adapter makes `old` trainable; torch's CPU linear takes another kernel for weights that require
    # grad (last-bit differences), so freeze it like the loaded inference model before comparing bits.
    reference.requires_grad_(False)
    with torch.no_grad():
        expected = reference(**flux_inputs()).sample
        got = loaded(**flux_inputs()).sample
    assert torch.equal(got, expected)
    assert loaded.peft_config["default"].lora_alpha == 8


def test_dora_adapter_export_loads_in_peft(flux_models: dict[str, PeftModel], tmp_path: Path) -> None:
    trained = flux_models["dora"]
    state = trained.state_dict()
    modules = require_adapter(group_adapters(state), "default")
    settings = settings_of(trained, "default")
    folder = tmp_path / "dora"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        adapter_config_json(peft_adapter_config(settings, target_modules(modules), None))
    )
    mapping = peft_adapter_keys(modules)
    assert "base_model.model.transformer_blocks.0.attn.to_q.lora_magnitude_vector" in mapping
    save_file({k: state[src].contiguous() for k, src in mapping.items()}, folder / "adapter_model.safetensors")
    loaded = PeftModel.from_pretrained(tiny_flux(), folder)
    assert_bitwise(loaded.merge_and_unload().state_dict(), peft_merged(trained, "default"))


def test_diffusers_lora_file_keeps_alpha(flux_models: dict[str, PeftModel], tmp_path: Path) -> None:
    from diffusers.loaders import FluxLoraLoaderMixin

    state = flux_models["rslora"].state_dict()
    modules = require_adapter(group_adapters(state), "default")
    config = peft_adapter_config(settings_of(flux_models["rslora"], "default"), target_modules(modules), None)
    metadata = diffusers_lora_metadata(config)
    mapping = diffusers_lora_keys(modules)
    assert "transformer.transformer_blocks.0.attn.to_out.0.lora_B.weight" in mapping
    path = tmp_path / DIFFUSERS_LORA_WEIGHTS_NAME
    save_file({k: state[src].contiguous() for k, src in mapping.items()}, path, metadata=metadata)
    with safe_open(path, framework="pt") as handle:
        assert json.loads(handle.metadata()[DIFFUSERS_METADATA_KEY])["transformer.lora_alpha"] == 6

    _, read_back = FluxLoraLoaderMixin.lora_state_dict(
        str(tmp_path), weight_name=DIFFUSERS_LORA_WEIGHTS_NAME, return_lora_metadata=True
    )
    assert read_back["transformer.use_rslora"] is True
    model = tiny_flux()
    model.load_lora_adapter(
        str(tmp_path), weight_name=DIFFUSERS_LORA_WEIGHTS_NAME, prefix="transformer", adapter_name="x"
    )
    layer = model.get_submodule("transformer_blocks.0.attn.to_q")
    # alpha 6 with rsLoRA at r=4 is 3.0; without the metadata Diffusers would infer alpha = r (scaling 2.0)
    assert layer.scaling["x"] == 6 / math.sqrt(4)
    trained_b = state["base_model.model.transformer_blocks.0.attn.to_q.lora_B.default.weight"]
    assert torch.equal(layer.lora_B["x"].weight, trained_b)
    with pytest.raises(LoraError, match="modules_to_save"):
        diffusers_lora_metadata({**config, "modules_to_save": ["proj_out"]})
