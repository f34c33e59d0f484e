"""ComfyUI's LoRA key handling, restated for tests that cannot install ComfyUI.

What comfy/lora.py does (comfyanonymous/ComfyUI, commit 41444b5236c613ee5ff7d09aa620f94b702f30eb)
with a LoRA file and a diffusion model whose state dict is `diffusion_model.<original key>`:

- `model_lora_keys_unet`: for every model key `k` under `diffusion_model.`: a `.weight` is reachable as
  `lora_unet_<key minus .weight, dots as underscores>` and as `k` minus `.weight` ("generic lora format
  without any weird key names"); any other tensor as `k` itself. (The per-architecture Diffusers names,
  SD3's `transformer.` for instance, are not restated: the files tested here do not use them.)
- `load_lora`: for every key map entry `x` -> model key: `x.lora_up.weight` / `x.lora_down.weight`
  (or `x.lora_B.weight` / `x.lora_A.weight`) with `x.alpha` are a LoRA patch of the model key;
  `x.diff` a diff patch of it; `x.diff_b` a diff patch of `<model key minus .weight>.bias`. A file key no
  entry reads is "lora key not loaded" (a warning).
- `calculate_weight` (float32): a LoRA patch adds `up @ down * alpha / rank` (alpha absent: 1), a diff
  patch adds the diff (a shape mismatch is skipped with a warning). A patch of a key the model lacks is
  dropped (ModelPatcher.add_patches).

`apply_comfy_lora` returns the patched state dict and raises on everything ComfyUI would only warn
about (an unread key, a patch of a missing key, a shape mismatch): a test passes only if ComfyUI
would apply every tensor of the file.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

PREFIX = "diffusion_model."


def key_map(model_keys: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k in model_keys:
        if not k.startswith(PREFIX):
            continue
        if k.endswith(".weight"):
            out["lora_unet_" + k[len(PREFIX):-len(".weight")].replace(".", "_")] = k
            out[k[: -len(".weight")]] = k
        else:
            out[k] = k
    return out


def apply_comfy_lora(model: Mapping[str, torch.Tensor], lora: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    to_load = key_map(sorted(model))
    patches: dict[str, list[tuple[str, tuple[torch.Tensor, ...]]]] = {}
    loaded: set[str] = set()
    for x, target in to_load.items():
        alpha = lora.get(f"{x}.alpha")
        if alpha is not None:
            loaded.add(f"{x}.alpha")
        for up_name, down_name in ((f"{x}.lora_up.weight", f"{x}.lora_down.weight"),
                                   (f"{x}.lora_B.weight", f"{x}.lora_A.weight")):
            if up_name in lora:
                scale = float(alpha) / lora[down_name].shape[0] if alpha is not None else 1.0
                patches.setdefault(target, []).append(("lora", (lora[up_name], lora[down_name], torch.tensor(scale))))
                loaded.update({up_name, down_name})
                break
        if f"{x}.diff" in lora:
            patches.setdefault(target, []).append(("diff", (lora[f"{x}.diff"],)))
            loaded.add(f"{x}.diff")
        if f"{x}.diff_b" in lora:
            patches.setdefault(f"{target[: -len('.weight')]}.bias", []).append(("diff", (lora[f"{x}.diff_b"],)))
            loaded.add(f"{x}.diff_b")
    unread = sorted(set(lora) - loaded)
    if unread:
        raise AssertionError(f"ComfyUI would not load {unread[:5]}")
    missing = sorted(set(patches) - set(model))
    if missing:
        raise AssertionError(f"ComfyUI would drop patches of {missing[:5]}, which the model lacks")
    out = {k: v.to(torch.float32).clone() for k, v in model.items()}
    for key, todo in patches.items():
        for kind, values in todo:
            if kind == "lora":
                up, down, scale = values
                change = (up.float().flatten(1) @ down.float().flatten(1)).reshape(out[key].shape) * float(scale)
            else:
                change = values[0].float()
                if change.shape != out[key].shape:
                    raise AssertionError(f"ComfyUI would skip the diff of {key}: {list(change.shape)} vs {list(out[key].shape)}")
            out[key] += change
    return out
