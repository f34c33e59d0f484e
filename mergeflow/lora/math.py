"""Fold one LoRA adapter into one weight tensor, exactly as PEFT 0.21 merges it, in float32.

Each function takes one module's tensors, so the streaming writer fuses tensor by tensor.
The operation order copies PEFT's `get_delta_weight` / DoRA `merge_unsafe`, so for float32
weights the result is bit-identical to `merge_and_unload()`. For bf16 / fp16 weights mergeflow
computes in float32 and rounds once; PEFT instead rounds the delta to the weight dtype and adds
in that dtype (and runs DoRA entirely in it), so those results can differ from PEFT's low-precision
merge by a rounding step, while matching PEFT's float32 merge rounded once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mergeflow.errors import LoraError

_CONV_FN = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}
_LAYER_NAMES = {2: "linear", 3: "conv1d", 4: "conv2d", 5: "conv3d"}


def check_adapter_shapes(
    module: str,
    weight_shape: Sequence[int],
    a_shape: Sequence[int],
    b_shape: Sequence[int],
    *,
    rank: int | None = None,
    magnitude_shape: Sequence[int] | None = None,
    lora_bias_shape: Sequence[int] | None = None,
    base_bias_shape: Sequence[int] | None = None,
) -> str:
    """Validate one module's adapter shapes against its frozen weight; return the layer kind."""
    w, a, b = tuple(weight_shape), tuple(a_shape), tuple(b_shape)
    if len(w) not in _LAYER_NAMES:
        raise LoraError(
            f"{module}: LoRA targets a tensor of shape {list(w)}, which is not a linear or conv weight; "
            "only nn.Linear and nn.Conv1d/2d/3d adapters can be fused"
        )
    kind = _LAYER_NAMES[len(w)]
    if len(a) != len(w) or len(b) != len(w):
        raise LoraError(
            f"{module}: lora_A {list(a)} / lora_B {list(b)} do not fit a {kind} weight {list(w)}; "
            "the adapter was trained on a different layer type"
        )
    r = a[0]
    if b[1] != r:
        raise LoraError(f"{module}: lora_A has rank {r} but lora_B has rank {b[1]}; the pair is inconsistent")
    if rank is not None and r != rank:
        raise LoraError(
            f"{module}: adapter rank is {r} but the LoRA settings say r={rank}; check lora_train_meta.json "
            "(or rank_pattern in adapter_config.json) against the training config"
        )
    if b[0] != w[0] or a[1] != w[1]:
        raise LoraError(
            f"{module}: adapter maps {a[1]} -> {b[0]} features but the base weight is {list(w)} "
            f"(in={w[1]}, out={w[0]}); the adapter belongs to a different model"
        )
    if len(w) > 2 and (a[2:] != w[2:] or any(size != 1 for size in b[2:])):
        raise LoraError(
            f"{module}: conv LoRA needs lora_A kernel {list(w[2:])} and a 1x..x1 lora_B kernel, found "
            f"lora_A {list(a)} and lora_B {list(b)}"
        )
    if magnitude_shape is not None:
        # PEFT keeps the DoRA magnitude as [out] for linear and [1, out, 1, ...] for conv layers.
        expected = (w[0],) if len(w) == 2 else (1, w[0]) + (1,) * (len(w) - 2)
        if tuple(magnitude_shape) != expected:
            raise LoraError(f"{module}: DoRA magnitude has shape {list(magnitude_shape)}, expected {list(expected)}")
    if lora_bias_shape is not None:
        if base_bias_shape is None:
            raise LoraError(f"{module}: the adapter has a lora_B bias but the base layer has no bias to fold it into")
        if tuple(lora_bias_shape) != (w[0],) or tuple(base_bias_shape) != (w[0],):
            raise LoraError(
                f"{module}: lora_B bias {list(lora_bias_shape)} / base bias {list(base_bias_shape)} "
                f"do not match {w[0]} output features"
            )
    return kind


def _delta_weight(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, weight_shape: torch.Size) -> torch.Tensor:
    """PEFT's get_delta_weight, float32 in, float32 out, same operation order."""
    if len(weight_shape) == 2:
        return (lora_b @ lora_a) * scaling
    if len(weight_shape) == 4 and tuple(weight_shape[2:4]) == (1, 1):
        # PEFT's 1x1 Conv2d branch (taken from kohya_ss): a plain matmul.
        product = lora_b.squeeze(3).squeeze(2) @ lora_a.squeeze(3).squeeze(2)
        return product.unsqueeze(2).unsqueeze(3) * scaling
    # Every other conv, as PEFT: convolve A^T with B. PEFT's 1x1 branch also catches Conv3d kernels
    # (1, 1, k) and fails there; this general form gives the mathematically same dW for them.
    conv = _CONV_FN[len(weight_shape)]
    return conv(lora_a.transpose(0, 1), lora_b).transpose(0, 1) * scaling


def _dora(weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """PEFT's DoRA merge_unsafe: m / ||W + dW|| (row-wise) times (W + dW)."""
    if weight.dim() == 2:
        # DoraLinearLayer.get_weight_norm with scaling=1 (the delta already carries the scaling).
        norm = torch.linalg.norm(weight + 1 * delta, dim=1).to(weight.dtype)
        factor = (magnitude / norm).view(-1, 1)
    else:
        # _DoraConvNdLayer.get_weight_norm, then the factor view of _ConvNd._get_dora_factor_view.
        combined = weight + 1 * delta
        norm = combined.norm(p=2, dim=tuple(range(1, combined.dim())), keepdim=True).transpose(1, 0)
        factor = (magnitude / norm).view((-1,) + (1,) * (weight.dim() - 1))
    return factor * (weight + delta)


def _finite(module: str, tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(tensor).all()):
        raise LoraError(
            f"{module}: fusing the adapter gives non-finite {what} in {tensor.dtype}; the adapter is broken "
            "or its values overflow this dtype"
        )
    return tensor


def fuse_weight(
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    *,
    scaling: float,
    magnitude: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    rank: int | None = None,
    module: str = "<module>",
) -> torch.Tensor:
    """W + scaling * (B @ A) (conv and DoRA as PEFT), computed in float32 and rounded once to out_dtype."""
    if not weight.is_floating_point():
        raise LoraError(f"{module}: cannot fuse LoRA into a {weight.dtype} weight")
    check_adapter_shapes(
        module,
        weight.shape,
        lora_a.shape,
        lora_b.shape,
        rank=rank,
        magnitude_shape=None if magnitude is None else magnitude.shape,
    )
    # Out-of-place ops only: `.to(float32)` returns the caller's tensor itself when it is float32 already.
    base = weight.to(torch.float32)
    delta = _delta_weight(lora_a.to(torch.float32), lora_b.to(torch.float32), scaling, weight.shape)
    if magnitude is None:
        fused = base + delta
    else:
        fused = _dora(base, delta, magnitude.to(torch.float32))
    return _finite(module, fused.to(out_dtype or weight.dtype), "weights")


def fuse_bias(
    bias: torch.Tensor,
    lora_b_bias: torch.Tensor,
    *,
    scaling: float,
    out_dtype: torch.dtype | None = None,
    module: str = "<module>",
) -> torch.Tensor:
    """b + scaling * lora_B.bias (PEFT `lora_bias=True`), in float32, rounded once to out_dtype."""
    if bias.shape != lora_b_bias.shape or bias.dim() != 1:
        raise LoraError(f"{module}: lora_B bias {list(lora_b_bias.shape)} does not match base bias {list(bias.shape)}")
    fused = bias.to(torch.float32) + lora_b_bias.to(torch.float32) * scaling
    return _finite(module, fused.to(out_dtype or bias.dtype), "biases")
