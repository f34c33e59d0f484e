"""The LoRA decisions of one export: what inspect found (LoraSpec) and what plan_lora fixed (LoraPlan).

Both are small, JSON-friendly records: the flow passes them between tasks, never tensors. The
validation here works on key names and shapes only, so every adapter of a checkpoint is checked
before a single weight byte is read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mergeflow.errors import LoraError, UsageError
from mergeflow.formats.manifest import LoraFusion
from mergeflow.lora.config import (
    AdapterConfig,
    AdapterSettings,
    LoraTrainMeta,
    fusion_blockers,
    lora_only_blockers,
    rank_for,
    requires_full_config,
    scaling_for,
)
from mergeflow.lora.keys import AdapterModuleKeys
from mergeflow.lora.math import check_adapter_shapes

LORA_ONLY = "lora_only"
FULL_STATE = "full_state"

# A Hub repository id as `--base_model ORG/NAME` spells it (huggingface_hub's repo-id characters).
_HUB_ID = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")


def is_hub_id(name: object) -> bool:
    """True for `ORG/NAME` strings that can only be a Hub repository id, never a local path."""
    return isinstance(name, str) and bool(_HUB_ID.match(name)) and ".." not in name and "--" not in name


def base_model_reference(base_model: str, local_name: str | None, recorded_name: object) -> str:
    """`base_model_name_or_path` for an exported adapter: a Hub id or a directory name, never a local path.

    A non-local `--base_model` must be a Hub id. For a local base, the `_name_or_path` its own config
    recorded is used when that is a Hub id (it names where the base came from); otherwise the base
    directory's name, the only part of a local path that says which model it is.
    """
    if local_name is None:
        if not is_hub_id(base_model):
            raise UsageError(
                f"--base_model {base_model!r} is neither a local directory nor a Hub id like ORG/NAME; "
                "pass the base the adapter was trained on"
            )
        return base_model
    return recorded_name if is_hub_id(recorded_name) else local_name  # type: ignore[return-value]


@dataclass(frozen=True)
class LoraSpec:
    """What inspect learnt about a LoRA checkpoint (`MergePlan.lora`)."""

    layout: str  # LORA_ONLY | FULL_STATE
    fuse: bool
    adapter_name: str
    adapter_format: str  # "peft" | "diffusers"
    adapters: tuple[str, ...]
    meta: LoraTrainMeta | None  # lora_train_meta.json: r, lora_alpha, task_type (None: a DCP's LoRA, set by its adapter config)
    settings: AdapterSettings
    settings_origin: str  # where r / alpha / variants came from (a file name, never a path)
    base_model_name_or_path: str = ""
    source_files: dict[str, str] = field(default_factory=dict)  # actor-relative path -> sha256
    adapter_config_sha256: str | None = None
    base_weight_map: dict[str, str] = field(default_factory=dict)  # LoRA-only fusion: tensor -> base file

    @property
    def adapter_only(self) -> bool:
        """A LoRA-only save exported as an adapter: no model weights, no local base needed."""
        return self.layout == LORA_ONLY and not self.fuse

    @property
    def base_weights(self) -> str | None:
        """Where fusion takes the frozen weights from (the manifest's `base_weights`)."""
        if not self.fuse:
            return None
        return "checkpoint" if self.layout == FULL_STATE else "base_model"

    @classmethod
    def create(cls, *, layout: str, fuse: bool, adapter_name: str, adapter_format: str, adapters: list[str],
               meta: LoraTrainMeta | None, settings: AdapterSettings, settings_origin: str, **extra: Any) -> LoraSpec:
        """Build a spec from the parsed metadata and settings."""
        return cls(layout=layout, fuse=fuse, adapter_name=adapter_name, adapter_format=adapter_format,
                   adapters=tuple(sorted(adapters)), meta=meta, settings=settings,
                   settings_origin=settings_origin, **extra)


@dataclass(frozen=True)
class ModuleLora:
    """One module of the selected adapter: its layer kind, rank, scaling and checkpoint keys."""

    module: str
    layer: str  # linear | conv1d | conv2d | conv3d
    rank: int
    scaling: float
    sources: dict[str, str]  # ADAPTER_KINDS entry -> checkpoint key


@dataclass(frozen=True)
class LoraPlan:
    """What plan_lora decided after validating every adapter of the checkpoint."""

    adapter_name: str
    excluded_adapters: tuple[str, ...]
    layout: str
    fuse: bool
    adapter_format: str
    base_weights: str | None
    r: int
    lora_alpha: float
    scaling: float
    settings_origin: str
    modules: tuple[ModuleLora, ...]
    saved_overrides: dict[str, str] = field(default_factory=dict)  # fused output tensor -> checkpoint key
    adapter_keys: dict[str, str] = field(default_factory=dict)  # exported adapter key -> checkpoint key
    adapter_config: AdapterConfig | None = None  # the exported PEFT LoraConfig dict
    # --extract-lora into a ComfyUI file: `.diff` / `.diff_b` file key -> its layout key (mergeflow.lora.diffs)
    diff_keys: dict[str, str] = field(default_factory=dict)

    @property
    def writes_model(self) -> bool:
        """False only for a LoRA-only adapter export, whose artifact is the adapter alone."""
        return self.fuse or self.layout == FULL_STATE

    @property
    def exports_adapter(self) -> bool:
        return not self.fuse

    @property
    def fused_weights(self) -> frozenset[str]:
        """The output weights a fusion changes (empty without --fuse-lora)."""
        return frozenset(f"{m.module}.weight" for m in self.modules) if self.fuse else frozenset()

    def fusion_record(self) -> LoraFusion | None:
        """The manifest's `lora_fusion` record (None when nothing was fused)."""
        if not self.fuse:
            return None
        per_module = {m.module: m.scaling for m in self.modules if m.scaling != self.scaling}
        return LoraFusion(
            adapter_name=self.adapter_name,
            r=self.r,
            lora_alpha=self.lora_alpha,
            scaling=self.scaling,
            base_weights=self.base_weights,
            fused_modules=tuple(sorted(m.module for m in self.modules)),
            excluded_adapters=tuple(self.excluded_adapters),
            settings_source=self.settings_origin,
            module_scaling=dict(sorted(per_module.items())) if per_module else None,
            replaced_by_modules_to_save=tuple(sorted(self.saved_overrides)) if self.saved_overrides else None,
        )


def default_scaling(settings: AdapterSettings) -> float:
    """The adapter-wide scaling (PEFT's expression, so the float is identical)."""
    return settings.lora_alpha / math.sqrt(settings.r) if settings.use_rslora else settings.lora_alpha / settings.r


def _some(items: list[str]) -> str:
    return ", ".join(items[:3]) + (" ..." if len(items) > 3 else "")


def _check_variant_flags(name: str, modules: Mapping[str, AdapterModuleKeys], settings: AdapterSettings) -> None:
    """The tensors present must agree with the config's DoRA / lora_bias flags, both ways."""
    dora = sorted(m for m, item in modules.items() if item.lora_magnitude_vector is not None)
    bias = sorted(m for m, item in modules.items() if item.lora_B_bias is not None)
    if settings.use_dora and len(dora) != len(modules):
        missing = sorted(set(modules) - set(dora))
        raise LoraError(f"adapter {name!r}: the config sets use_dora but {_some(missing)} have no DoRA magnitude vector")
    if not settings.use_dora and dora:
        raise LoraError(f"adapter {name!r}: {_some(dora)} carry DoRA magnitude vectors but the config has use_dora=false")
    if not settings.lora_bias and bias:
        raise LoraError(f"adapter {name!r}: {_some(bias)} carry lora_B biases but the config has lora_bias=false")


def _missing_config(name: str, reasons: list[str], fuse: bool) -> LoraError:
    action = "fuse" if fuse else "export"
    return LoraError(
        f"cannot {action} adapter {name!r} from lora_train_meta.json alone (it holds only r and lora_alpha): "
        f"{'; '.join(reasons)}. Put the PEFT adapter_config.json of the training beside the checkpoint "
        "or pass --adapter-config PATH"
    )


def config_requirements(
    modules: Mapping[str, AdapterModuleKeys], shapes: Mapping[str, tuple[int, ...]], *, fuse: bool
) -> list[str]:
    """What only an adapter_config.json can tell for this adapter (DoRA, lora_bias, mixed ranks; conv when fusing)."""
    if fuse:
        return requires_full_config(modules.values(), shapes)
    # An exported conv LoRA loads with plain r / alpha (PEFT builds the conv layer itself); only the
    # first two dimensions are shown, so requires_full_config does not count conv as a reason.
    flat = {key: tuple(shape[:2]) for key, shape in shapes.items()}
    return requires_full_config(modules.values(), flat)


def validate_adapter(
    name: str,
    modules: Mapping[str, AdapterModuleKeys],
    shapes: Mapping[str, tuple[int, ...]],
    model_shapes: Mapping[str, tuple[int, ...]],
    settings: AdapterSettings,
) -> list[ModuleLora]:
    """Check one adapter's every module against the model (pairs, rank, shapes, targets)."""
    planned = []
    for module, item in sorted(modules.items()):
        weight = model_shapes.get(f"{module}.weight")
        if weight is None:
            raise LoraError(
                f"adapter {name!r} targets {module}, which has no weight in the model; "
                "the adapter belongs to a different model"
            )
        rank = rank_for(module, settings)
        layer = check_adapter_shapes(
            f"adapter {name!r}: {module}",
            weight,
            shapes[item.lora_A],
            shapes[item.lora_B],
            rank=rank,
            magnitude_shape=None if item.lora_magnitude_vector is None else shapes[item.lora_magnitude_vector],
            lora_bias_shape=None if item.lora_B_bias is None else shapes[item.lora_B_bias],
            base_bias_shape=model_shapes.get(f"{module}.bias"),
        )
        planned.append(ModuleLora(module, layer, rank, scaling_for(module, settings), item.sources()))
    return planned


def validate_all_adapters(
    grouped: Mapping[str, Mapping[str, AdapterModuleKeys]],
    shapes: Mapping[str, tuple[int, ...]],
    model_shapes: Mapping[str, tuple[int, ...]],
    settings: AdapterSettings,
    *,
    selected: str,
    fuse: bool,
    layout: str,
) -> list[ModuleLora]:
    """Validate every adapter (even those not exported) and return the selected adapter's modules."""
    if selected not in grouped:
        available = ", ".join(sorted(grouped)) or "none"
        raise LoraError(f"adapter {selected!r} is not in the checkpoint (available: {available}); pass --adapter-name")
    modules = grouped[selected]
    blockers = fusion_blockers(settings)
    if blockers:
        raise LoraError(f"adapter {selected!r} uses {'; '.join(blockers)}, which mergeflow cannot reproduce")
    # What is missing from the settings is said first: it explains any rank mismatch that follows.
    if settings.from_adapter_config:
        _check_variant_flags(selected, modules, settings)
    else:
        reasons = config_requirements(modules, shapes, fuse=fuse)
        if reasons:
            raise _missing_config(selected, reasons, fuse)
    if fuse and layout == LORA_ONLY:
        reasons = lora_only_blockers(settings)
        if reasons:
            raise LoraError(f"cannot fuse the LoRA-only save of adapter {selected!r} into --base_model: {'; '.join(reasons)}")
    chosen: list[ModuleLora] = []
    for name in sorted(grouped):
        planned = validate_adapter(name, grouped[name], shapes, model_shapes, settings)
        if name == selected:
            chosen = planned
    return chosen
