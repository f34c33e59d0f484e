"""LoRA hyper-parameters: verl's `lora_train_meta.json`, PEFT's `adapter_config.json`, per-module scaling.

The scaling rules replicate PEFT 0.21 exactly: `LoraLayer.update_layer` sets
`scaling = lora_alpha / r` (rsLoRA: `lora_alpha / math.sqrt(r)`), and `LoraModel._create_and_replace`
picks per-module r / alpha with `peft.utils.other.get_pattern_key`, whose first matching pattern (in
dict order) wins.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergeflow.errors import LoraError
from mergeflow.io.jsonfiles import JsonObject, parse_json_strict
from mergeflow.io.session import current_session
from mergeflow.lora.keys import AdapterModuleKeys

TRAIN_META_NAME = "lora_train_meta.json"
ADAPTER_CONFIG_NAME = "adapter_config.json"
# A PEFT LoraConfig as a dict: adapter_config.json's content as read (settings_from_config_dict checks it)
# or as an exported adapter writes it (peft_adapter_config).
AdapterConfig = Mapping[str, Any]

# init_lora_weights values whose initialisation subtracts the initial adapter from the base weight
# (PEFT: pissa_init, corda_init, olora_init, loftq_init, lora_ga_init rewrite `base_layer.weight`).
_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")

# LoraConfig fields that change what a merge must compute when set; mergeflow replicates none of them.
_UNSUPPORTED_WHEN_SET = {
    "fan_in_fan_out": "weights stored transposed (fan_in_fan_out=True)",
    "megatron_config": "Megatron parallel LoRA layers (megatron_config)",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "velora_config": "the VeLoRA variant (velora_config)",
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens), which cannot be merged",
    "use_qalora": "QALoRA (use_qalora)",
    "monteclora_config": "the MonteCLoRA variant (monteclora_config)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "LoRA on bare parameters (target_parameters)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "the KaSA variant (kasa_config)",
}


@dataclass(frozen=True)
class LoraTrainMeta:
    """verl's `lora_train_meta.json`: `{"r": int, "lora_alpha": int, "task_type": str | null}`."""

    r: int
    lora_alpha: int
    task_type: str | None = None


@dataclass(frozen=True)
class AdapterSettings:
    """The parts of a PEFT LoraConfig that decide how an adapter merges and is exported."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    use_dora: bool = False
    lora_bias: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    init_lora_weights: bool | str = True
    target_modules: tuple[str, ...] | str | None = None
    modules_to_save: tuple[str, ...] | None = None
    bias: str = "none"
    unsupported: tuple[str, ...] = ()  # reasons this adapter cannot be fused (see fusion_blockers)
    from_adapter_config: bool = False

    @classmethod
    def from_meta(cls, meta: LoraTrainMeta) -> AdapterSettings:
        """Plain LoRA settings from verl's metadata (no rsLoRA, DoRA, bias or patterns)."""
        return cls(r=meta.r, lora_alpha=meta.lora_alpha)


def _strict_object(text: str | bytes, what: str) -> JsonObject:
    # finite: a NaN or Infinity is never a hyper-parameter (and PEFT would compute with it).
    data = parse_json_strict(text, LoraError, what, finite=True)
    if not isinstance(data, dict):
        raise LoraError(f"{what} must hold a JSON object, found {type(data).__name__}")
    return data


def _positive_int(value: Any, name: str, what: str) -> int:
    # bool is an int subclass in Python; `true` is never a rank.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LoraError(f"{what}: {name} must be a positive integer, found {value!r}")
    return value


def _positive_number(value: Any, name: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise LoraError(f"{what}: {name} must be a positive finite number, found {value!r}")
    return value


def parse_train_meta(text: str | bytes, what: str = TRAIN_META_NAME) -> LoraTrainMeta:
    """Parse `lora_train_meta.json` strictly: positive int r / lora_alpha, no unknown or duplicate keys."""
    data = _strict_object(text, what)
    unknown = sorted(set(data) - {"r", "lora_alpha", "task_type"})
    if unknown:
        # An unknown field could change the math (e.g. rsLoRA), so it is refused, not ignored.
        raise LoraError(f"{what}: unknown field(s) {unknown}; expected only r, lora_alpha and task_type")
    for required in ("r", "lora_alpha"):
        if required not in data:
            raise LoraError(f"{what}: field {required!r} is missing")
    task_type = data.get("task_type")
    if task_type is not None and not isinstance(task_type, str):
        raise LoraError(f"{what}: task_type must be a string or null, found {task_type!r}")
    return LoraTrainMeta(
        r=_positive_int(data["r"], "r", what),
        lora_alpha=_positive_int(data["lora_alpha"], "lora_alpha", what),
        task_type=task_type,
    )


def load_train_meta(path: Path) -> LoraTrainMeta:
    """Read and parse a `lora_train_meta.json` file."""
    return parse_train_meta(current_session().read_bytes(Path(path)), what=str(path))  # once per export


def _lora_config_defaults() -> AdapterConfig:
    from peft import LoraConfig

    defaults: dict[str, object] = {}
    for item in dataclasses.fields(LoraConfig):
        if item.default is not dataclasses.MISSING:
            defaults[item.name] = item.default
        elif item.default_factory is not dataclasses.MISSING:
            defaults[item.name] = item.default_factory()
    return defaults


def _pattern(value: Any, name: str, what: str, number: Any) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise LoraError(f"{what}: {name} must be an object, found {type(value).__name__}")
    return {str(key): number(item, f"{name}[{key!r}]", what) for key, item in value.items()}


def _names(value: Any, name: str, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise LoraError(f"{what}: {name} must be a list of strings or null")
    return tuple(sorted(set(value)))


def _flag(data: Mapping[str, Any], name: str, what: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise LoraError(f"{what}: {name} must be true or false, found {value!r}")
    return value


def settings_from_config_dict(data: AdapterConfig, what: str = ADAPTER_CONFIG_NAME) -> AdapterSettings:
    """Build AdapterSettings from a PEFT LoraConfig dict; fields PEFT 0.21 does not know are refused."""
    defaults = _lora_config_defaults()
    unknown = sorted(set(data) - set(defaults) - {"runtime_config"})
    if unknown:
        raise LoraError(f"{what}: field(s) {unknown} are not part of PEFT 0.21's LoraConfig; cannot tell their effect")
    peft_type = data.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{what}: peft_type is {peft_type!r}; mergeflow handles LoRA adapters only")
    target = data.get("target_modules")
    if target is not None and not isinstance(target, str):
        target = _names(target, "target_modules", what)
    init = data.get("init_lora_weights", True)
    if not isinstance(init, (bool, str)):
        raise LoraError(f"{what}: init_lora_weights must be a boolean or a string, found {init!r}")
    bias = data.get("bias", "none")
    if bias not in ("none", "all", "lora_only"):
        raise LoraError(f"{what}: bias must be 'none', 'all' or 'lora_only', found {bias!r}")
    unsupported = tuple(
        reason
        for name, reason in _UNSUPPORTED_WHEN_SET.items()
        if data.get(name) not in (None, False, {}, [], defaults[name])
    )
    return AdapterSettings(
        r=_positive_int(data.get("r", defaults["r"]), "r", what),
        lora_alpha=_positive_number(data.get("lora_alpha", defaults["lora_alpha"]), "lora_alpha", what),
        use_rslora=_flag(data, "use_rslora", what),
        use_dora=_flag(data, "use_dora", what),
        lora_bias=_flag(data, "lora_bias", what),
        rank_pattern=_pattern(data.get("rank_pattern"), "rank_pattern", what, _positive_int),
        alpha_pattern=_pattern(data.get("alpha_pattern"), "alpha_pattern", what, _positive_number),
        init_lora_weights=init,
        target_modules=target,
        modules_to_save=_names(data.get("modules_to_save"), "modules_to_save", what),
        bias=bias,
        unsupported=unsupported,
        from_adapter_config=True,
    )


def load_adapter_settings(path: Path) -> AdapterSettings:
    """Read a PEFT `adapter_config.json` (duplicate keys refused) into AdapterSettings."""
    return settings_from_config_dict(_strict_object(current_session().read_bytes(Path(path)), str(path)), what=str(path))


def pattern_key(patterns: Iterable[str], module_path: str) -> str:
    """PEFT's `get_pattern_key`: the first pattern matching the end of `module_path`, else the path."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_path):
            return key
    return module_path


def rank_for(module_path: str, settings: AdapterSettings) -> int:
    """The LoRA rank PEFT gives `module_path` (rank_pattern, else r)."""
    return settings.rank_pattern.get(pattern_key(settings.rank_pattern.keys(), module_path), settings.r)


def alpha_for(module_path: str, settings: AdapterSettings) -> float:
    """The lora_alpha PEFT gives `module_path` (alpha_pattern, else lora_alpha)."""
    return settings.alpha_pattern.get(pattern_key(settings.alpha_pattern.keys(), module_path), settings.lora_alpha)


def scaling_for(module_path: str, settings: AdapterSettings) -> float:
    """PEFT's scaling for one module: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    r, alpha = rank_for(module_path, settings), alpha_for(module_path, settings)
    # Same expressions as LoraLayer.update_layer, so the float is bit-identical to PEFT's.
    return alpha / math.sqrt(r) if settings.use_rslora else alpha / r


def rewrites_base_weights(settings: AdapterSettings) -> str | None:
    """The init_lora_weights value if that initialisation rewrote the base weights (PiSSA, OLoRA, ...)."""
    init = settings.init_lora_weights
    if not isinstance(init, str):
        return None
    lowered = init.lower()
    # PEFT tests `startswith("pissa")`/`startswith("corda")` and equality for the others.
    if lowered.startswith(("pissa", "corda")) or lowered in _REWRITING_INITS:
        return init
    return None


def fusion_blockers(settings: AdapterSettings) -> list[str]:
    """Why this adapter cannot be fused at all (LoRA variants mergeflow does not replicate)."""
    return list(settings.unsupported)


def lora_only_blockers(settings: AdapterSettings) -> list[str]:
    """Why a LoRA-only save of this adapter cannot be fused into the original base weights."""
    reasons = []
    init = rewrites_base_weights(settings)
    if init is not None:
        reasons.append(
            f"init_lora_weights={init!r} rewrote the base weights during training, so the original base "
            "is not the frozen weight the adapter was trained against; fuse a full-state save instead"
        )
    if settings.modules_to_save:
        reasons.append(
            f"modules_to_save {list(settings.modules_to_save)} were trained, but a LoRA-only save does not keep them"
        )
    if settings.bias != "none":
        reasons.append(f"bias={settings.bias!r} trained base biases, but a LoRA-only save does not keep them")
    return reasons


def requires_full_config(modules: Iterable[AdapterModuleKeys], shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Why fusing these AdapterModuleKeys needs adapter_config.json (DoRA, lora_B bias, conv, mixed ranks)."""
    dora: list[str] = []
    bias: list[str] = []
    conv: list[str] = []
    ranks: dict[int, str] = {}
    for item in modules:
        if item.lora_magnitude_vector is not None:
            dora.append(item.module)
        if item.lora_B_bias is not None:
            bias.append(item.module)
        a_shape = tuple(shapes[item.lora_A])
        if len(a_shape) > 2:
            conv.append(item.module)
        ranks.setdefault(a_shape[0], item.module)

    def some(paths: list[str]) -> str:
        return ", ".join(sorted(paths)[:3]) + (" ..." if len(paths) > 3 else "")

    reasons = []
    if dora:
        reasons.append(
            f"DoRA magnitude vectors on {len(dora)} module(s) ({some(dora)}) need use_dora and the exact scaling"
        )
    if bias:
        reasons.append(f"lora_B biases on {len(bias)} module(s) ({some(bias)}) need lora_bias and the exact scaling")
    if conv:
        reasons.append(f"conv LoRA on {len(conv)} module(s) ({some(conv)}) needs the adapter's own config")
    if len(ranks) > 1:
        reasons.append(f"ranks differ between modules ({sorted(ranks)}), which needs rank_pattern / alpha_pattern")
    return reasons


def peft_adapter_config(
    settings: LoraTrainMeta | AdapterSettings,
    target_modules: Iterable[str],
    base_model_name_or_path: str | None,
    modules_to_save: Iterable[str] | None = None,
) -> AdapterConfig:
    """A genuine PEFT LoraConfig dict (JSON-ready, sets sorted, task_type null) for an exported adapter."""
    from peft import LoraConfig

    if isinstance(settings, LoraTrainMeta):
        settings = AdapterSettings.from_meta(settings)
    saved = sorted(set(modules_to_save)) if modules_to_save else None
    try:
        config = LoraConfig(
            r=settings.r,
            lora_alpha=settings.lora_alpha,
            target_modules=sorted(set(target_modules)),
            use_rslora=settings.use_rslora,
            use_dora=settings.use_dora,
            lora_bias=settings.lora_bias,
            rank_pattern=dict(settings.rank_pattern),
            alpha_pattern=dict(settings.alpha_pattern),
            modules_to_save=saved,
            base_model_name_or_path=base_model_name_or_path,
            task_type=None,
            # The exported weights are trained values; re-running PiSSA-like init on load would rewrite the base.
            init_lora_weights=True,
            # PeftModel.save_pretrained writes its config with inference_mode=True.
            inference_mode=True,
        )
    except (TypeError, ValueError) as exc:
        raise LoraError(f"PEFT refuses these LoRA settings: {exc}") from exc
    data = config.to_dict()
    for key, value in data.items():
        if isinstance(value, (set, frozenset)):
            data[key] = sorted(value)
    data["peft_type"] = str(config.peft_type.value)
    return data
