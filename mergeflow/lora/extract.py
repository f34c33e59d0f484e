"""A LoRA out of a full fine-tune, one layer at a time: dW = W_trained - W_base -> up @ down (truncated SVD).

Everything is float32. A layer whose smaller side is at most `EXACT_MAX_DIM` is decomposed exactly
(`torch.linalg.svd`); a larger one with the randomized range finder of Halko, Martinsson & Tropp
(2011, algorithms 4.4 and 5.1, what `torch.svd_lowrank` runs) with q = rank + oversample columns and
`niter` power iterations. `torch.svd_lowrank` draws its test matrix from torch's global generator,
which the export's other threads share; here the draw comes from a private `torch.Generator` seeded
per layer (the seed and the layer's name), so two runs give the same bytes whatever else runs.

The singular values are split evenly (up = U sqrt(S), down = sqrt(S) V^T) so neither factor carries
the whole scale when they are rounded to bf16; lora_alpha = rank, so the scale PEFT applies is 1.
Retained energy is the issue's measure, ||dW_r||_F / ||dW||_F, taken on the factors as written
(rounded to the output dtype), so what the record says is what the file holds.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from mergeflow.errors import UsageError
from mergeflow.lora.extract_spec import ExtractSpec

EXACT_MAX_DIM = 256  # exact where cheap (a [n, 256] float32 SVD); wider layers (FLUX.1: 3072) go randomized
OVERSAMPLE = 8
NITER = 2
SEED = 0
METHOD_EXACT = "torch.linalg.svd"
METHOD_RANDOMIZED = "randomized_svd(halko2011, as torch.svd_lowrank)"


@dataclass(frozen=True)
class ExtractSettings:
    """What the user asked for: a rank cap and, optionally, the norm fraction each layer must keep."""

    rank: int
    energy: float | None = None  # smallest rank with ||dW_r|| / ||dW|| >= energy, capped at rank
    oversample: int = OVERSAMPLE
    niter: int = NITER
    seed: int = SEED
    exact_max_dim: int = EXACT_MAX_DIM

    @classmethod
    def of(cls, spec: ExtractSpec) -> ExtractSettings:
        return cls(rank=spec.rank, energy=spec.energy)

    def method_for(self, shape: tuple[int, ...]) -> str:
        return METHOD_EXACT if min(shape) <= self.exact_max_dim else METHOD_RANDOMIZED

    def record(self) -> dict[str, object]:
        """The parameters of the choice, as the manifest's extraction record keeps them."""
        return {"rank": self.rank, "energy": self.energy, "exact_max_dim": self.exact_max_dim,
                "exact_method": METHOD_EXACT, "randomized_method": METHOD_RANDOMIZED,
                "oversample": self.oversample, "niter": self.niter, "seed": self.seed,
                "split": "up = U*sqrt(S), down = sqrt(S)*V^T", "lora_alpha": "rank (scale 1)"}


@dataclass(frozen=True)
class LayerExtraction:
    """One layer's figures: its rank, the norms of dW and of what the factors keep, the worst element error."""

    module: str
    shape: tuple[int, int]
    rank: int
    method: str
    delta_norm: float
    kept_norm: float
    max_abs_error: float

    @property
    def retained(self) -> float:
        return 1.0 if self.delta_norm == 0.0 else self.kept_norm / self.delta_norm

    def to_json(self) -> dict[str, object]:
        return {"module": self.module, "shape": list(self.shape), "rank": self.rank, "method": self.method,
                "delta_norm": self.delta_norm, "kept_norm": self.kept_norm, "retained": self.retained,
                "max_abs_error": self.max_abs_error}


def _generator(seed: int, module: str) -> torch.Generator:
    # Per layer, from the name: a layer's factors do not depend on which layers came before it.
    digest = hashlib.sha256(f"{seed}:{module}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def randomized_svd(a: torch.Tensor, q: int, niter: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U, S, V^T of the best rank-q approximation's range (Halko et al. 4.4 + 5.1), q columns, seeded."""
    _, n = a.shape
    omega = torch.randn((n, q), generator=generator, dtype=a.dtype)
    basis, _ = torch.linalg.qr(a @ omega)
    for _ in range(niter):  # power iterations, re-orthonormalised each half step (subspace iteration)
        basis, _ = torch.linalg.qr(a.mT @ basis)
        basis, _ = torch.linalg.qr(a @ basis)
    small = basis.mT @ a  # [q, n]
    u_small, s, vh = torch.linalg.svd(small, full_matrices=False)
    return basis @ u_small, s, vh


def _rank_for_energy(s: torch.Tensor, total_sq: float, energy: float, cap: int) -> int:
    """Smallest r with sqrt(sum s_i^2, i < r) >= energy * ||dW||, capped (float64 sums)."""
    if total_sq == 0.0:
        return 1
    kept = torch.cumsum(s.to(torch.float64) ** 2, 0)
    target = (energy ** 2) * total_sq * (1 - 1e-12)
    reached = torch.nonzero(kept >= target)
    found = int(reached[0]) + 1 if reached.numel() else cap
    return max(1, min(found, cap))


def extract_layer(module: str, delta: torch.Tensor, settings: ExtractSettings,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, LayerExtraction]:
    """(up [out, r], down [r, in]) in out_dtype for one float32 dW [out, in], and what they keep."""
    out_features, in_features = delta.shape
    limit = min(out_features, in_features)
    # A fixed rank above a layer's size cannot be honoured: refused. With --extract-energy the rank is
    # chosen per layer and RANK is only its cap, so a smaller layer is capped at its own size.
    cap = settings.rank if settings.energy is None else min(settings.rank, limit)
    if cap > limit:
        raise UsageError(f"--extract-lora {settings.rank} exceeds {module}'s smallest dimension "
                         f"({out_features} x {in_features}); pass a rank <= {limit}")
    method = settings.method_for(delta.shape)
    if method == METHOD_EXACT:
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    else:
        q = min(cap + settings.oversample, limit)
        u, s, vh = randomized_svd(delta, q, settings.niter, _generator(settings.seed, module))
    total_sq = float(torch.linalg.vector_norm(delta)) ** 2  # no float64 copy of dW: memory stays one dW
    rank = cap if settings.energy is None else _rank_for_energy(s, total_sq, settings.energy, cap)
    root = torch.sqrt(s[:rank])
    up = (u[:, :rank] * root).to(out_dtype).contiguous()
    down = (root[:, None] * vh[:rank]).to(out_dtype).contiguous()
    approx = up.to(torch.float32) @ down.to(torch.float32)
    kept_norm = float(torch.linalg.norm(approx))
    max_error = float((delta - approx).abs().max()) if delta.numel() else 0.0
    record = LayerExtraction(module, (out_features, in_features), rank, method, math.sqrt(total_sq), kept_norm, max_error)
    return up, down, record
