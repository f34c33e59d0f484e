"""Real PEFT LoRA checkpoints as verl writes them: FSDP2 rank files, lora_train_meta.json, both layouts."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.tensor  # noqa: F401
from peft import LoraConfig, PeftModel, get_peft_model

from mergeflow.config import ModelMergerConfig
from mergeflow.demo.checkpoints import (
    build_transformer,
    run_tiny_forward,
    save_base_transformer,
    save_fsdp_checkpoint,
)
from mergeflow.lora.keys import is_adapter_only_key

ConfigFactory = Callable[[str], LoraConfig]

# Targets that exist in every tiny transformer class below (Diffusers attention naming).
ATTN_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


@dataclass
class LoraCheckpoint:
    root: Path
    actor_dir: Path
    base_dir: Path
    peft: PeftModel  # the trained model: both adapters, as training left it
    class_name: str
    layout: str
    world_size: int
    extra: dict[str, object] = field(default_factory=dict)

    def config(self, target: Path | str, **overrides: object) -> ModelMergerConfig:
        values: dict[str, object] = dict(
            operation="merge", local_dir=str(self.actor_dir), base_model=str(self.base_dir),
            target_dir=str(target), output_format="transformer",
        )
        values.update(overrides)
        return ModelMergerConfig(**values)  # type: ignore[arg-type]

    def merged(self, adapter: str) -> dict[str, torch.Tensor]:
        """PEFT's own merge_and_unload of one adapter."""
        reference = copy.deepcopy(self.peft)
        reference.set_adapter(adapter)
        return reference.merge_and_unload(adapter_names=[adapter]).state_dict()

    def forward(self, adapter: str) -> tuple[torch.Tensor, ...]:
        """The trained LoRA model's forward with one adapter active (frozen, like an inference load)."""
        reference = copy.deepcopy(self.peft)
        reference.set_adapter(adapter)
        # set_adapter marks the adapter trainable; CPU kernels differ in the last bit for weights that
        # require grad, so freeze it like a loaded inference model before comparing.
        reference.requires_grad_(False)
        return run_tiny_forward(reference.base_model.model.eval())


def randomize_lora_(model: torch.nn.Module, seed: int = 1) -> None:
    """Every LoRA tensor random and non-zero; DoRA magnitudes moved off ||W + sBA||."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1 + 0.2 * torch.rand(param.shape, generator=gen).to(param.dtype))
            elif "lora_" in name:
                param.copy_((torch.randn(param.shape, generator=gen) * 0.1).to(param.dtype))


def two_adapters(model: torch.nn.Module, make: ConfigFactory, seed: int = 1) -> PeftModel:
    """PEFT model with adapters `default` and `old` (DiffusionNFT), random non-zero LoRA weights."""
    peft_model = get_peft_model(model, make("default"))
    peft_model.add_adapter("old", make("old"))
    randomize_lora_(peft_model, seed)
    peft_model.set_adapter("default")
    return peft_model


def keep_lora_only(actor_dir: Path, world_size: int) -> None:
    """Rewrite every rank file as verl's save_lora_only does: only keys with `lora_` or `.adapter_`."""
    for rank in range(world_size):
        path = actor_dir / f"model_world_size_{world_size}_rank_{rank}.pt"
        state = torch.load(path, map_location="cpu", weights_only=True)
        torch.save({k: v for k, v in state.items() if is_adapter_only_key(k)}, path)


def build_lora_checkpoint(
    root: Path,
    class_name: str,
    make: ConfigFactory,
    *,
    world_size: int = 3,
    layout: str = "full_state",
    wrapped: bool = True,
    dtype: torch.dtype | None = None,
    adapter_config: str | None = None,
    meta: dict[str, object] | None = None,
    mutate: Callable[[PeftModel], None] | None = None,
    config_overrides: dict[str, object] | None = None,
) -> LoraCheckpoint:
    """Base transformer in root/base; its LoRA training checkpoint in root/ckpt/.../actor.

    wrapped: save the PeftModel (keys `base_model.model.`), else the LoRA-injected module itself.
    adapter_config: None, "actor" or "huggingface": where to put PEFT's adapter_config.json of `default`.
    """
    base = build_transformer(class_name, seed=0, dtype=dtype, config_overrides=config_overrides)
    base_dir = save_base_transformer(base, root / "base")
    peft_model = two_adapters(copy.deepcopy(base), make)
    if mutate is not None:
        mutate(peft_model)
    module = peft_model if wrapped else peft_model.base_model.model
    actor_dir = save_fsdp_checkpoint(module, root / "ckpt" / "global_step_1" / "actor", world_size)
    if layout == "lora_only":
        keep_lora_only(actor_dir, world_size)
    default = peft_model.peft_config["default"]
    info = meta if meta is not None else {"r": default.r, "lora_alpha": default.lora_alpha, "task_type": None}
    (actor_dir / "lora_train_meta.json").write_text(json.dumps(info))
    if adapter_config is not None:
        folder = actor_dir if adapter_config == "actor" else actor_dir / "huggingface"
        default.save_pretrained(str(folder))
    return LoraCheckpoint(root, actor_dir, base_dir, peft_model, class_name, layout, world_size)
