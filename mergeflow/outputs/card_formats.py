"""What a model card says that differs by output: the relation to the base, the library, the loading snippet.

Kept with the outputs (nothing outside this package branches on an artifact type); the card itself is
mergeflow/hub/model_card.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mergeflow.formats.manifest import Manifest
from mergeflow.formats.verl_checkpoint import verl_run_step

Relation = Literal["finetune", "adapter", "quantized", "merge"]
ADAPTER_TYPES = ("peft_adapter",)


@dataclass(frozen=True)
class CardFacts:
    """What the card says beyond the manifest: the base's id, the training run and step, the tensors' file."""

    base_model: str | None
    run: str | None
    step: int | None
    weights_file: str
    transformer_class: str

    @staticmethod
    def of(actor_dir: str, base_model: str | None, weights_file: str, transformer_class: str) -> CardFacts:
        found = verl_run_step(Path(actor_dir)) if actor_dir else None
        return CardFacts(base_model, found[0] if found else None, found[1] if found else None, weights_file,
                         transformer_class)


def relation(manifest: Manifest) -> Relation:
    """What the artifact is to its base: an adapter, quantized weights, a fused LoRA (merge) or a fine-tune."""
    if manifest.artifact_type in ADAPTER_TYPES:
        return "adapter"
    if manifest.quantization is not None:
        return "quantized"
    if manifest.lora_fusion is not None:
        return "merge"
    return "finetune"


def library_name(manifest: Manifest) -> str:
    """`peft` for a PEFT adapter (PEFT loads it), else `diffusers`."""
    return "peft" if manifest.lora_adapter is not None and manifest.lora_adapter.format == "peft" else "diffusers"


def format_name(manifest: Manifest) -> str:
    if manifest.lora_adapter is not None:
        return f"lora-{manifest.lora_adapter.format}"
    if manifest.quantization is not None:
        return str(manifest.quantization.get("method", manifest.artifact_type))
    return manifest.artifact_type


def load_snippet(manifest: Manifest, facts: CardFacts) -> str:
    """How to load this artifact: Python for its format (`repo`: this folder, or its Hub repo id)."""
    base = facts.base_model or "BASE_PIPELINE"  # the base pipeline's id or folder, when the card cannot name it
    head = 'import torch\nfrom diffusers import DiffusionPipeline\n\nrepo = "."  # this folder, or its Hub repo id\n'
    cls = facts.transformer_class
    if manifest.lora_adapter is not None:
        fmt = manifest.lora_adapter.format
        if fmt == "peft":
            return (f'{head}pipe = DiffusionPipeline.from_pretrained("{base}", torch_dtype=torch.bfloat16)\n'
                    "from peft import PeftModel\n"
                    "pipe.transformer = PeftModel.from_pretrained(pipe.transformer, repo)\n")
        return (f'{head}pipe = DiffusionPipeline.from_pretrained("{base}", torch_dtype=torch.bfloat16)\n'
                f'pipe.load_lora_weights(repo, weight_name="{facts.weights_file}")\n')
    if manifest.artifact_type == "diffusers_transformer":
        return (f"{head}from diffusers import {cls}\n\n"
                f"transformer = {cls}.from_pretrained(repo, torch_dtype=torch.bfloat16)\n"
                f'pipe = DiffusionPipeline.from_pretrained("{base}", transformer=transformer, torch_dtype=torch.bfloat16)\n')
    if manifest.artifact_type == "gguf":
        return (f"{head}from diffusers import {cls}, GGUFQuantizationConfig\n\n"
                f'transformer = {cls}.from_single_file(f"{{repo}}/{facts.weights_file}", '
                "quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16), "
                f'config="{base}", subfolder="transformer")\n')
    if manifest.artifact_type == "single_file":
        note = ("# ComfyUI's scaled float8: load it in ComfyUI, or dequantize (weight * scale_weight) first\n"
                if manifest.quantization is not None else "")
        return (f"{head}from diffusers import {cls}\n\n{note}"
                f'transformer = {cls}.from_single_file(f"{{repo}}/{facts.weights_file}", '
                f'config="{base}", subfolder="transformer", torch_dtype=torch.bfloat16)\n')
    return f"{head}pipe = DiffusionPipeline.from_pretrained(repo, torch_dtype=torch.bfloat16)\n"
