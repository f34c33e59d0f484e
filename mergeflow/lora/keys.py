"""LoRA key names: normalise wrapper prefixes, classify a checkpoint, group adapters per module.

Everything here works on key names only (never tensors), so the streaming writer can plan a
whole export from the rank files' key lists before it reads a single byte.

Key shapes handled (after normalisation), as PEFT's LoRA layers name them in `state_dict()`:
  <module>.base_layer.<param>                      frozen weight of a LoRA-wrapped layer
  <module>.lora_A.<adapter>.weight                 [r, in] (conv: [r, in, k...])
  <module>.lora_B.<adapter>.weight                 [out, r] (conv: [out, r, 1...])
  <module>.lora_B.<adapter>.bias                   [out] (PEFT `lora_bias=True`)
  <module>.lora_magnitude_vector.<adapter>.weight  DoRA magnitude
  <module>.original_module.<param>                 frozen copy kept by `modules_to_save`
  <module>.modules_to_save.<adapter>.<param>       trained copy kept by `modules_to_save`
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mergeflow.errors import CheckpointError, LoraError

FSDP_WRAPPER = "_fsdp_wrapped_module."
PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer."
ORIGINAL_MODULE = ".original_module."

# The parts of one module's adapter, in the order PEFT lists them.
ADAPTER_KINDS = ("lora_A", "lora_B", "lora_B_bias", "lora_magnitude_vector")

_LORA_AB = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.(?P<adapter>[^.]+)\.(?P<param>weight|bias)$")
# Older PEFT kept the magnitude as a bare parameter (no ".weight"); both spellings exist on disk.
_MAGNITUDE = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector\.(?P<adapter>[^.]+)(?:\.weight)?$")
_EMBEDDING = re.compile(r"^(?P<module>.+)\.lora_embedding_[AB]\.(?P<adapter>[^.]+)$")
_SAVED_MODULE = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<param>.+)$")


class LoraLayout(str, enum.Enum):
    """What a checkpoint's key set holds (SPEC section 4)."""

    NONE = "none"
    LORA_ONLY = "lora_only"
    FULL_STATE = "full_state"


@dataclass(frozen=True)
class LoraKey:
    """One parsed LoRA parameter name."""

    module: str
    adapter: str
    kind: str  # one of ADAPTER_KINDS


@dataclass(frozen=True)
class SavedModuleKey:
    """One parsed `modules_to_save` parameter name."""

    module: str
    adapter: str
    param: str


@dataclass(frozen=True)
class AdapterModuleKeys:
    """The checkpoint keys (as they appear in the files) of one adapter on one module."""

    module: str
    adapter: str
    lora_A: str
    lora_B: str
    lora_B_bias: str | None = None
    lora_magnitude_vector: str | None = None

    def sources(self) -> dict[str, str]:
        """Map each present kind (see ADAPTER_KINDS) to its source key."""
        found = {kind: getattr(self, kind) for kind in ADAPTER_KINDS}
        return {kind: key for kind, key in found.items() if key is not None}


def normalize_key(key: str) -> str:
    """Drop `_fsdp_wrapped_module.` anywhere and a leading `base_model.model.`."""
    return key.replace(FSDP_WRAPPER, "").removeprefix(PEFT_PREFIX)


def normalize_keys(keys: Iterable[str]) -> dict[str, str]:
    """Map normalised name -> original name; two originals for one name is a CheckpointError."""
    mapping: dict[str, str] = {}
    for key in keys:
        name = normalize_key(key)
        if name in mapping and mapping[name] != key:
            raise CheckpointError(
                f"checkpoint keys {mapping[name]!r} and {key!r} both mean {name!r} once wrapper prefixes "
                "are removed; the rank file mixes wrapped and unwrapped state dicts, re-save it from one model"
            )
        mapping[name] = key
    return mapping


def is_lora_key(key: str) -> bool:
    """True for LoRA parameters (`lora_` in the name, as SPEC section 4 defines detection)."""
    return "lora_" in key


def is_adapter_only_key(key: str) -> bool:
    """True for keys verl's `save_lora_only` keeps (`lora_` or `.adapter_` in the name)."""
    return "lora_" in key or ".adapter_" in key


def parse_lora_key(key: str) -> LoraKey:
    """Parse a normalised LoRA key; unknown LoRA spellings are refused, never guessed."""
    match = _LORA_AB.match(key)
    if match:
        part, param = match["part"], match["param"]
        if part == "lora_A" and param == "bias":
            raise LoraError(f"{key!r}: PEFT's lora_A never has a bias; this is not a PEFT LoRA checkpoint")
        kind = "lora_B_bias" if param == "bias" else part
        return LoraKey(module=match["module"], adapter=match["adapter"], kind=kind)
    match = _MAGNITUDE.match(key)
    if match:
        return LoraKey(module=match["module"], adapter=match["adapter"], kind="lora_magnitude_vector")
    if _EMBEDDING.match(key):
        raise LoraError(
            f"{key!r} is a LoRA on an embedding layer, which mergeflow does not support; "
            "retrain without targeting embeddings"
        )
    raise LoraError(
        f"{key!r} has 'lora_' in its name but is not a PEFT LoRA parameter "
        "(<module>.lora_A|lora_B.<adapter>.weight, lora_B bias or lora_magnitude_vector); "
        "mergeflow handles plain PEFT LoRA, rsLoRA, DoRA and lora_bias only"
    )


def parse_saved_module_key(key: str) -> SavedModuleKey | None:
    """Parse `<module>.modules_to_save.<adapter>.<param>`; None for any other key."""
    match = _SAVED_MODULE.match(key)
    if match is None:
        return None
    return SavedModuleKey(module=match["module"], adapter=match["adapter"], param=match["param"])


def base_key_for(key: str) -> str:
    """The plain model name of a frozen weight: collapse `.base_layer.` and `.original_module.`."""
    name = normalize_key(key)
    # Loop: in `.base_layer.base_layer.` the two wrappers share a dot, which one replace() pass misses.
    while BASE_LAYER in name or ORIGINAL_MODULE in name:
        name = name.replace(BASE_LAYER, ".").replace(ORIGINAL_MODULE, ".")
    return name


def classify(keys: Iterable[str]) -> LoraLayout:
    """Tell a checkpoint without LoRA, a LoRA-only save and a full-state LoRA save apart."""
    names = list(normalize_keys(keys))
    lora = [name for name in names if is_lora_key(name)]
    if not lora:
        return LoraLayout.NONE
    if all(is_adapter_only_key(name) for name in names):
        other = sorted(name for name in names if not is_lora_key(name))
        if other:
            raise LoraError(
                f"LoRA-only checkpoint also holds {len(other)} non-LoRA adapter parameter(s) ('.adapter_'), "
                f"e.g. {other[0]!r}; mergeflow only exports PEFT LoRA adapters and will not drop them silently"
            )
        for name in lora:
            parse_lora_key(name)
        return LoraLayout.LORA_ONLY
    if not any(BASE_LAYER in name for name in names):
        plain = sorted(name for name in names if not is_adapter_only_key(name))
        raise LoraError(
            f"checkpoint has {len(lora)} LoRA keys and {len(plain)} plain keys (e.g. {plain[0]!r}) but no "
            "'.base_layer.' weights: it is neither a LoRA-only save nor a PEFT full-state save"
        )
    _check_full_state(names)
    return LoraLayout.FULL_STATE


def _check_full_state(names: list[str]) -> None:
    present = set(names)
    lora_modules = {parse_lora_key(name).module for name in names if is_lora_key(name)}
    missing = sorted(module for module in lora_modules if f"{module}.base_layer.weight" not in present)
    if missing:
        raise LoraError(
            f"full-state LoRA checkpoint lacks the frozen weight of {len(missing)} adapted module(s), "
            f"e.g. {missing[0]}.base_layer.weight; the save is incomplete"
        )
    wrapped = {name.split(BASE_LAYER, 1)[0] for name in names if BASE_LAYER in name}
    bare = sorted(wrapped - lora_modules)
    if bare:
        raise LoraError(
            f"{len(bare)} module(s) are LoRA-wrapped ('.base_layer.') but carry no adapter, e.g. {bare[0]}; "
            "the save is incomplete"
        )


def group_adapters(keys: Iterable[str]) -> dict[str, dict[str, AdapterModuleKeys]]:
    """Group LoRA keys as {adapter: {module: AdapterModuleKeys}}; unpaired A/B are refused."""
    partial: dict[tuple[str, str], dict[str, str]] = {}
    for name, original in normalize_keys(keys).items():
        if not is_lora_key(name):
            continue
        parsed = parse_lora_key(name)
        slot = partial.setdefault((parsed.adapter, parsed.module), {})
        if parsed.kind in slot:
            raise LoraError(f"{slot[parsed.kind]!r} and {original!r} are both the {parsed.kind} of {parsed.module}")
        slot[parsed.kind] = original
    grouped: dict[str, dict[str, AdapterModuleKeys]] = {}
    unpaired: list[str] = []
    for (adapter, module), slot in sorted(partial.items()):
        if "lora_A" not in slot or "lora_B" not in slot:
            unpaired.append(f"{module} (adapter {adapter!r} has only {', '.join(sorted(slot))})")
            continue
        grouped.setdefault(adapter, {})[module] = AdapterModuleKeys(module=module, adapter=adapter, **slot)
    if unpaired:
        raise LoraError(
            f"unpaired LoRA weights on {len(unpaired)} module(s): {'; '.join(unpaired[:3])}; every adapted "
            "module needs both lora_A and lora_B - the checkpoint is incomplete"
        )
    return grouped


def require_adapter(
    grouped: Mapping[str, Mapping[str, AdapterModuleKeys]], name: str
) -> Mapping[str, AdapterModuleKeys]:
    """The modules of adapter `name`, or a LoraError listing the adapters that exist."""
    if name not in grouped:
        available = ", ".join(sorted(grouped)) or "none"
        raise LoraError(f"adapter {name!r} is not in the checkpoint (available: {available}); pass --adapter-name")
    return grouped[name]


def target_modules(module_paths: Iterable[str]) -> list[str]:
    """PEFT `target_modules` names: last name part, or last two when the last is a digit (`to_out.0`)."""
    names = set()
    for path in module_paths:
        parts = path.split(".")
        names.add(".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1])
    return sorted(names)


def saved_modules(keys: Iterable[str]) -> dict[str, dict[str, dict[str, str]]]:
    """`modules_to_save` copies as {adapter: {module: {param: source key}}}."""
    found: dict[str, dict[str, dict[str, str]]] = {}
    for name, original in normalize_keys(keys).items():
        parsed = parse_saved_module_key(name)
        if parsed is not None:
            found.setdefault(parsed.adapter, {}).setdefault(parsed.module, {})[parsed.param] = original
    return found


def base_state_keys(keys: Iterable[str]) -> dict[str, str]:
    """Output name -> source key for the frozen model: adapters and trained copies dropped, wrappers collapsed."""
    mapping: dict[str, str] = {}
    for name, original in normalize_keys(keys).items():
        if is_lora_key(name) or parse_saved_module_key(name) is not None:
            continue
        out = base_key_for(name)
        if out in mapping:
            raise CheckpointError(
                f"checkpoint keys {mapping[out]!r} and {original!r} both give the weight {out!r}; "
                "a LoRA-wrapped module also has an unwrapped copy, the save is inconsistent"
            )
        mapping[out] = original
    return mapping


def saved_module_overrides(keys: Iterable[str], adapter: str) -> dict[str, str]:
    """Output name -> source key of adapter `adapter`'s trained `modules_to_save` copies (used when fusing)."""
    per_module = saved_modules(keys).get(adapter, {})
    return {f"{module}.{param}": key for module, params in per_module.items() for param, key in params.items()}
