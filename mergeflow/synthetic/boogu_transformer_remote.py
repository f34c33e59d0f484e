"""Remote code of tiny Boogu-Image bases: shipped as ``transformer/transformer_boogu.py``.

A compact stand-in for the upstream ``boogu`` transformer (not installable here) with its
config fields and module layout: a Lumina-2 style DiT with timestep/caption embedding, noise,
reference-image and context refiners, double-stream blocks (separate image and instruction
weights, joint attention), single-stream blocks, 3-axis RoPE and a continuous AdaLN output
norm. Self-contained on purpose: Diffusers copies this one file into its module cache and
imports it alone, so it may only import torch and diffusers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

ROPE_THETA = 10000.0


def _modulation_width(hidden_size: int) -> int:
    """Width of the timestep embedding that every AdaLN projection reads (capped like Lumina 2)."""
    return min(hidden_size, 1024)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to [B, N, heads, D] on interleaved channel pairs; cos/sin are [B, N, D/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, :, None], sin[:, :, None]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


class BooguAttention(nn.Module):
    """Grouped-query self-attention with per-head RMS qk-norm."""

    def __init__(self, hidden_size: int, heads: int, kv_heads: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden_size // heads
        self.to_q = nn.Linear(hidden_size, heads * self.head_dim, bias=False)
        self.to_k = nn.Linear(hidden_size, kv_heads * self.head_dim, bias=False)
        self.to_v = nn.Linear(hidden_size, kv_heads * self.head_dim, bias=False)
        self.norm_q = nn.RMSNorm(self.head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(self.head_dim, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(heads * self.head_dim, hidden_size, bias=False)])

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values of ``x`` as [B, heads, N, D], rotated and normed."""
        q = self.norm_q(self.to_q(x).unflatten(-1, (self.heads, -1)))
        k = self.norm_k(self.to_k(x).unflatten(-1, (self.kv_heads, -1)))
        v = self.to_v(x).unflatten(-1, (self.kv_heads, -1))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return self.to_out[0](out.transpose(1, 2).flatten(2))


class BooguFeedForward(nn.Module):
    """SwiGLU feed-forward (gate ``linear_1``, up ``linear_3``, down ``linear_2``)."""

    def __init__(self, hidden_size: int, multiple_of: int, ffn_dim_multiplier: float | None) -> None:
        super().__init__()
        inner = 4 * hidden_size
        if ffn_dim_multiplier is not None:
            inner = int(ffn_dim_multiplier * inner)
        inner = multiple_of * math.ceil(inner / multiple_of)
        self.linear_1 = nn.Linear(hidden_size, inner, bias=False)
        self.linear_2 = nn.Linear(inner, hidden_size, bias=False)
        self.linear_3 = nn.Linear(hidden_size, inner, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)) * self.linear_3(x))


class BooguModulatedNorm(nn.Module):
    """RMSNorm scaled by the timestep: returns the normed input and the gate/scale terms."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.linear = nn.Linear(_modulation_width(hidden_size), 4 * hidden_size, bias=True)
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.linear(F.silu(temb)).chunk(4, dim=-1)
        return self.norm(x) * (1 + scale_msa[:, None]), gate_msa, scale_mlp, gate_mlp


class BooguSingleStreamBlock(nn.Module):
    """Sandwich-norm transformer block; timestep-modulated unless ``modulation`` is False."""

    def __init__(self, hidden_size: int, heads: int, kv_heads: int, eps: float, ffn: dict, modulation: bool) -> None:
        super().__init__()
        self.modulation = modulation
        self.norm1 = BooguModulatedNorm(hidden_size, eps) if modulation else nn.RMSNorm(hidden_size, eps=eps)
        self.attn = BooguAttention(hidden_size, heads, kv_heads, eps)
        self.norm2 = nn.RMSNorm(hidden_size, eps=eps)
        self.ffn_norm1 = nn.RMSNorm(hidden_size, eps=eps)
        self.ffn_norm2 = nn.RMSNorm(hidden_size, eps=eps)
        self.feed_forward = BooguFeedForward(hidden_size, **ffn)

    def forward(
        self, x: torch.Tensor, temb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        if not self.modulation:
            x = x + self.norm2(self.attn(self.norm1(x), cos, sin, mask))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        h, gate_msa, scale_mlp, gate_mlp = self.norm1(x, temb)
        x = x + gate_msa.tanh()[:, None] * self.norm2(self.attn(h, cos, sin, mask))
        h = self.feed_forward(self.ffn_norm1(x) * (1 + scale_mlp[:, None]))
        return x + gate_mlp.tanh()[:, None] * self.ffn_norm2(h)


class BooguDoubleStreamBlock(nn.Module):
    """Image and instruction streams with their own weights, attending jointly."""

    def __init__(self, hidden_size: int, heads: int, kv_heads: int, eps: float, ffn: dict) -> None:
        super().__init__()
        for stream in ("img", "instruct"):
            setattr(self, f"{stream}_norm1", BooguModulatedNorm(hidden_size, eps))
            setattr(self, f"{stream}_attn", BooguAttention(hidden_size, heads, kv_heads, eps))
            setattr(self, f"{stream}_norm2", nn.RMSNorm(hidden_size, eps=eps))
            setattr(self, f"{stream}_ffn_norm1", nn.RMSNorm(hidden_size, eps=eps))
            setattr(self, f"{stream}_ffn_norm2", nn.RMSNorm(hidden_size, eps=eps))
            setattr(self, f"{stream}_feed_forward", BooguFeedForward(hidden_size, **ffn))

    def forward(
        self, streams: dict[str, torch.Tensor], temb: torch.Tensor, rope: dict, mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        normed, qkv = {}, {}
        for name, x in streams.items():
            normed[name] = getattr(self, f"{name}_norm1")(x, temb)
            qkv[name] = getattr(self, f"{name}_attn").project(normed[name][0], *rope[name])
        q, k, v = (torch.cat([qkv["instruct"][i], qkv["img"][i]], dim=2) for i in range(3))
        joint = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :]).transpose(1, 2).flatten(2)
        split = {"instruct": joint[:, : streams["instruct"].shape[1]], "img": joint[:, streams["instruct"].shape[1] :]}
        out = {}
        for name, x in streams.items():
            _, gate_msa, scale_mlp, gate_mlp = normed[name]
            attn = getattr(self, f"{name}_attn").to_out[0](split[name])
            x = x + gate_msa.tanh()[:, None] * getattr(self, f"{name}_norm2")(attn)
            h = getattr(self, f"{name}_feed_forward")(getattr(self, f"{name}_ffn_norm1")(x) * (1 + scale_mlp[:, None]))
            out[name] = x + gate_mlp.tanh()[:, None] * getattr(self, f"{name}_ffn_norm2")(h)
        return out


class BooguTimestepCaptionEmbedding(nn.Module):
    """Sinusoidal timestep MLP and the RMSNorm + Linear instruction (MLLM feature) projection."""

    def __init__(self, hidden_size: int, instruction_feat_dim: int, eps: float, timestep_scale: float) -> None:
        super().__init__()
        self.time_proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=timestep_scale)
        self.timestep_embedder = TimestepEmbedding(in_channels=256, time_embed_dim=_modulation_width(hidden_size))
        self.caption_embedder = nn.Sequential(
            nn.RMSNorm(instruction_feat_dim, eps=eps), nn.Linear(instruction_feat_dim, hidden_size, bias=True)
        )

    def forward(self, timestep: torch.Tensor, instruction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.timestep_embedder.linear_1.weight
        temb = self.timestep_embedder(self.time_proj(timestep).to(weight.dtype))
        return temb, self.caption_embedder(instruction.to(weight.dtype))


class BooguImageTransformer2DModel(ModelMixin, ConfigMixin):
    """Tiny-capable Boogu-Image DiT: latents [B, C, H, W] + MLLM features -> velocity [B, C_out, H, W]."""

    _no_split_modules = ["BooguSingleStreamBlock", "BooguDoubleStreamBlock"]

    @register_to_config
    def __init__(
        self,
        patch_size: int = 2,
        in_channels: int = 16,
        out_channels: int | None = None,
        hidden_size: int = 2304,
        num_layers: int = 26,
        num_double_stream_layers: int = 8,
        num_refiner_layers: int = 2,
        num_attention_heads: int = 24,
        num_kv_heads: int = 8,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        axes_dim_rope: tuple[int, int, int] = (32, 32, 32),
        axes_lens: tuple[int, int, int] = (1024, 1664, 1664),  # upstream's RoPE table lengths (tables unused here)
        instruction_feature_configs: dict | None = None,
        timestep_scale: float = 1000.0,
    ) -> None:
        super().__init__()
        head = hidden_size // num_attention_heads
        if sum(axes_dim_rope) != head:
            raise ValueError(f"axes_dim_rope {axes_dim_rope} must sum to the head size {head}")
        if num_double_stream_layers > num_layers:
            raise ValueError("num_double_stream_layers cannot exceed num_layers")
        feat = (instruction_feature_configs or {}).get("instruction_feat_dim", 4096)
        out_channels = out_channels or in_channels
        patch = patch_size * patch_size
        block = {"hidden_size": hidden_size, "heads": num_attention_heads, "kv_heads": num_kv_heads, "eps": norm_eps}
        ffn = {"multiple_of": multiple_of, "ffn_dim_multiplier": ffn_dim_multiplier}

        def singles(count: int, modulation: bool = True) -> nn.ModuleList:
            blocks = [BooguSingleStreamBlock(**block, ffn=ffn, modulation=modulation) for _ in range(count)]
            return nn.ModuleList(blocks)

        self.time_caption_embed = BooguTimestepCaptionEmbedding(hidden_size, feat, norm_eps, timestep_scale)
        self.x_embedder = nn.Linear(patch * in_channels, hidden_size)
        self.ref_image_patch_embedder = nn.Linear(patch * in_channels, hidden_size)
        self.noise_refiner = singles(num_refiner_layers)
        self.ref_image_refiner = singles(num_refiner_layers)
        self.context_refiner = singles(num_refiner_layers, modulation=False)
        self.double_stream_layers = nn.ModuleList(
            [BooguDoubleStreamBlock(**block, ffn=ffn) for _ in range(num_double_stream_layers)]
        )
        self.single_stream_layers = singles(num_layers - num_double_stream_layers)
        # Continuous AdaLN output norm (scale only), then the patch projection.
        self.norm_out = nn.ModuleDict(
            {
                "linear_1": nn.Linear(_modulation_width(hidden_size), hidden_size),
                "norm": nn.LayerNorm(hidden_size, eps=1e-6, elementwise_affine=False),
                "linear_2": nn.Linear(hidden_size, patch * out_channels),
            }
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, N, D/2] of 3-axis positions [B, N, 3] (axis a rotates axes_dim_rope[a] channels)."""
        angles = []
        for axis, dim in enumerate(self.config.axes_dim_rope):
            inv = ROPE_THETA ** -(torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
            angles.append(positions[..., axis, None].double() * inv)
        angle = torch.cat(angles, dim=-1).float()
        return angle.cos(), angle.sin()

    def _patchify(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, (H/p)*(W/p), C*p*p] tokens, row-major over patches."""
        p = self.config.patch_size
        return x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)

    def _grid(self, batch: int, height: int, width: int, frame: int, device: torch.device) -> torch.Tensor:
        """RoPE positions [B, height*width, 3] of an image grid: (frame, row, column)."""
        rows = torch.arange(height, device=device).repeat_interleave(width)
        cols = torch.arange(width, device=device).repeat(height)
        grid = torch.stack([torch.full_like(rows, frame), rows, cols], dim=-1)
        return grid.expand(batch, -1, -1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        instruction_hidden_states: torch.Tensor,
        instruction_attention_mask: torch.Tensor | None = None,
        ref_image_hidden_states: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:
        batch, _, height, width = hidden_states.shape
        p, device = self.config.patch_size, hidden_states.device
        h_tokens, w_tokens = height // p, width // p
        text_len = instruction_hidden_states.shape[1]
        text_mask = (
            torch.ones(batch, text_len, dtype=torch.bool, device=device)
            if instruction_attention_mask is None
            else instruction_attention_mask.bool()
        )
        temb, instruct = self.time_caption_embed(timestep, instruction_hidden_states)
        text_pos = torch.arange(text_len, device=device)[None, :, None].expand(batch, -1, 3)
        rope = {"instruct": self._rope(text_pos)}
        for block in self.context_refiner:
            instruct = block(instruct, temb, *rope["instruct"], text_mask)

        dtype = self.x_embedder.weight.dtype
        img = self.x_embedder(self._patchify(hidden_states.to(dtype)))
        # Image positions start after the text on the first axis, like upstream's pe_shift.
        frame, image_rope, streams_img = text_len, [], []
        if ref_image_hidden_states is not None:
            ref = self.ref_image_patch_embedder(self._patchify(ref_image_hidden_states.to(dtype)))
            ref_h, ref_w = ref_image_hidden_states.shape[2] // p, ref_image_hidden_states.shape[3] // p
            ref_rope = self._rope(self._grid(batch, ref_h, ref_w, frame, device))
            ones = torch.ones(batch, ref.shape[1], dtype=torch.bool, device=device)
            for block in self.ref_image_refiner:
                ref = block(ref, temb, *ref_rope, ones)
            streams_img.append(ref)
            image_rope.append(ref_rope)
            frame += max(ref_h, ref_w)  # shift the target image past the reference
        img_rope = self._rope(self._grid(batch, h_tokens, w_tokens, frame, device))
        ones = torch.ones(batch, img.shape[1], dtype=torch.bool, device=device)
        for block in self.noise_refiner:
            img = block(img, temb, *img_rope, ones)
        streams_img.append(img)
        image_rope.append(img_rope)
        rope["img"] = tuple(torch.cat([r[i] for r in image_rope], dim=1) for i in range(2))
        streams = {"instruct": instruct, "img": torch.cat(streams_img, dim=1)}

        mask = torch.cat([text_mask, torch.ones(batch, streams["img"].shape[1], dtype=torch.bool, device=device)], 1)
        for block in self.double_stream_layers:
            streams = block(streams, temb, rope, mask)
        x = torch.cat([streams["instruct"], streams["img"]], dim=1)
        cos, sin = (torch.cat([rope["instruct"][i], rope["img"][i]], dim=1) for i in range(2))
        for block in self.single_stream_layers:
            x = block(x, temb, cos, sin, mask)

        x = x[:, -img.shape[1] :]
        scale = self.norm_out["linear_1"](F.silu(temb))
        x = self.norm_out["linear_2"](self.norm_out["norm"](x) * (1 + scale[:, None]))
        # Inverse of _patchify: token features are (channel, row-in-patch, column-in-patch).
        out = x.unflatten(2, (-1, p, p)).unflatten(1, (h_tokens, w_tokens)).permute(0, 3, 1, 4, 2, 5)
        sample = out.reshape(batch, -1, height, width)
        return Transformer2DModelOutput(sample=sample) if return_dict else (sample,)
