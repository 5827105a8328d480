"""Which rules and hyperparameters a state precision can serve. Free of torch, so that
ForgeConfig's checks run before torch loads (``forge-hf --help``)."""

from __future__ import annotations

from .rules import Rule


def check_group(rule: Rule, precision: str, group: dict) -> None:
    """Refuse a rule's hyperparameters the precision cannot serve, in one line."""
    if precision in ("log4", "log4_factored") and rule.name == "rmsprop" and group.get("centered"):
        # square_avg - grad_avg**2 of two 4-bit (or a factored and a 4-bit) states can turn
        # negative: a NaN square root
        raise ValueError(f"state_precision={precision!r} cannot serve rmsprop with centered=True (square_avg - "
                         "grad_avg**2 of approximate states may turn negative): use centered=False, or "
                         "state_precision='int8' or 'bf16'")
    if precision == "log4_factored" and all(rule.slot_signed):
        raise ValueError(f"state_precision='log4_factored' factors a second moment, and forge {rule.name} keeps "
                         "none: use state_precision='log4'")
