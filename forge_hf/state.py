"""Per-weight optimizer state of a fused layer: weight-shaped slots, allocated lazily at
the layer's first fused step, plus the host-side counters of its rule (step, NAdam's
mu_product). ``state_dict`` is what optimizer checkpoints carry."""

from __future__ import annotations

import warnings

import torch

from .rules import Rule

STATE_PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROUNDINGS = ("stochastic", "nearest")


def check_state_precision(precision: str) -> str:
    if precision not in STATE_PRECISIONS:
        raise ValueError(
            f"unknown state_precision={precision!r}: choose one of {sorted(STATE_PRECISIONS)}"
        )
    return precision


def check_rounding(rounding: str) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding={rounding!r}: choose one of {list(ROUNDINGS)}")
    return rounding


class ForgeState:
    def __init__(self, rule: Rule, precision: str):
        self.rule = rule
        self.precision = check_state_precision(precision)
        self.slots: list[torch.Tensor | None] = [None, None, None]
        self.host: dict = rule.host_init()
        self.allocated = False

    @property
    def step(self) -> int:
        return self.host["step"]

    def allocate(self, param: torch.Tensor, group: dict) -> None:
        """Create the slots this rule needs for ``group``, in the parameter's layout."""
        if self.allocated:
            return
        dtype = STATE_PRECISIONS[self.precision]
        inits = self.rule.slot_init(group)
        for i, needed in enumerate(self.rule.slots(group)):
            if needed:
                self.slots[i] = torch.full_like(
                    param, inits[i], dtype=dtype, memory_format=torch.preserve_format
                ).detach()
        self.allocated = True

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slots if s is not None)

    def state_dict(self) -> dict:
        names = self.rule.slot_names
        return {
            "rule": self.rule.name,
            "precision": self.precision,
            **{k: v for k, v in self.host.items()},
            **{names[i]: s for i, s in enumerate(self.slots) if s is not None},
        }

    def load_state_dict(self, sd: dict, param: torch.Tensor) -> None:
        if sd.get("rule", self.rule.name) != self.rule.name:
            raise ValueError(
                f"checkpoint state was written by forge rule {sd['rule']!r} but this layer uses "
                f"{self.rule.name!r}: patch the model with optimizer={sd['rule']!r}"
            )
        source = sd.get("precision", self.precision)
        if source != self.precision:
            warnings.warn(
                f"optimizer state saved as {source} is converted to {self.precision} on load",
                stacklevel=3,
            )
        dtype = STATE_PRECISIONS[self.precision]
        self.host = {k: sd[k] for k in self.rule.host_init()}
        for i, name in enumerate(self.rule.slot_names):
            if name in sd:
                value = sd[name].to(device=param.device)
                slot = torch.empty_like(param, dtype=dtype, memory_format=torch.preserve_format)
                slot.copy_(value)
                self.slots[i] = slot
        self.allocated = any(s is not None for s in self.slots) or self.host["step"] > 0
