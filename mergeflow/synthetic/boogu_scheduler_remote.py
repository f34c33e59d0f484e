"""Remote code of tiny Boogu-Image bases: ``scheduler/scheduling_flow_match_euler_discrete_time_shifting.py``.

Boogu's own flow-matching Euler scheduler (the upstream class name is kept): time runs
*ascending* from noise (t = 0) to data (t = 1), and the grid is shifted towards the noise end by
``sqrt(seq_len / 256)`` (static) or by the image's token count (dynamic). Self-contained: only
torch and diffusers imports.
"""

from __future__ import annotations

import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin, SchedulerOutput

_BASE_SEQ_LEN = 256


class FlowMatchEulerDiscreteScheduler(SchedulerMixin, ConfigMixin):
    """Euler steps of ``x' = v`` over an ascending, time-shifted grid in [0, 1]."""

    order = 1

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        do_shift: bool = True,
        dynamic_time_shift: bool = False,
        time_shift_version: str = "v1",
        seq_len: int = 4096,
    ) -> None:
        if time_shift_version != "v1":
            raise ValueError(f"unknown time_shift_version {time_shift_version!r}; only 'v1' exists")
        self.timesteps = torch.empty(0)
        self._grid = torch.empty(0)
        self.step_index = 0

    def _shift(self, num_tokens: int | None) -> float:
        """Shift factor: static from ``seq_len``, or from the image's tokens when dynamic."""
        if not self.config.do_shift:
            return 1.0
        tokens = num_tokens if self.config.dynamic_time_shift and num_tokens else self.config.seq_len
        return math.sqrt(tokens / _BASE_SEQ_LEN)

    def set_timesteps(
        self, num_inference_steps: int, device: str | torch.device | None = None, num_tokens: int | None = None
    ) -> None:
        """Build the ascending grid of ``num_inference_steps`` times plus the final t = 1."""
        t = torch.linspace(0.0, 1.0, num_inference_steps + 1, dtype=torch.float64)
        shift = self._shift(num_tokens)
        # v1 shift: spend more steps near the noise end (t' <= t for shift >= 1).
        grid = t / (t + shift * (1.0 - t))
        self._grid = grid.to(device=device, dtype=torch.float32)
        self.timesteps = self._grid[:-1]
        self.step_index = 0

    def step(
        self, model_output: torch.Tensor, timestep: torch.Tensor | float, sample: torch.Tensor, return_dict: bool = True
    ) -> SchedulerOutput | tuple[torch.Tensor]:
        """Advance ``sample`` by one Euler step along the predicted velocity ``model_output``."""
        # The step counter picks the interval, as in Diffusers' Euler schedulers; ``timestep`` is
        # accepted for their calling convention.
        dt = self._grid[self.step_index + 1] - self._grid[self.step_index]
        prev_sample = (sample.float() + dt * model_output.float()).to(sample.dtype)
        self.step_index += 1
        return SchedulerOutput(prev_sample=prev_sample) if return_dict else (prev_sample,)

    def __len__(self) -> int:
        return self.config.num_train_timesteps
