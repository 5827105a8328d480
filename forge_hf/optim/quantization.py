"""How faithful a state precision is: reconstruction error of each state and the
update-domain error E_upd of the log-space quantisation paper (§3),

    E_upd = ||U(S_hat, G) - U(S, G)|| / (||U(S, G)|| + eps),

where U is the rule's own update (rules.py, run by the reference backend's torch binding)
and S_hat the states after a store/load round trip in ``precision``. States are given, or
synthetic: per-element scales 2**N(-10, sigma**2) (log-normal, sigma in bits per spread),
second moments = scale**2, signed states = scale * N(0, 1) clipped to below the scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.codecs import decode, encode, slot_codec
from ..core.config import ForgeConfig
from ..core.rules import get_rule, make_group
from ..kernels import TORCH_RULE_UPDATES
from . import four_bit_maps

SPREADS = {"narrow": 0.5, "medium": 2.0, "wide": 6.0}  # sigma of log2 of the scale, bits


@dataclass
class QuantizationReport:
    precision: str
    rule: str
    codecs: dict = field(default_factory=dict)  # slot name -> codec name (or dtype)
    relative_l2: dict = field(default_factory=dict)  # slot -> ||S_hat - S|| / ||S||
    e_upd_slot: dict = field(default_factory=dict)  # slot -> E_upd with only that slot stored
    e_upd: float = 0.0  # every slot stored in ``precision``

    def __str__(self) -> str:
        lines = [f"{self.rule} states in {self.precision}: E_upd {self.e_upd:.4%}"]
        lines += [f"  {name:16s} {self.codecs[name]:16s} rel. L2 {self.relative_l2[name]:.4%}  "
                  f"E_upd alone {self.e_upd_slot[name]:.4%}" for name in self.codecs]
        return "\n".join(lines)


def round_trip(x: torch.Tensor, precision: str, signed: bool, rounding: str = "nearest",
               generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (out, in) after being stored as one slot in ``precision`` and read back."""
    codec = slot_codec(precision, signed)
    if codec is None and precision == "log4_factored":  # a factored second moment: its row and column sums
        return four_bit_maps.factored(x)
    if codec is None:
        return x.to({"fp32": torch.float32, "bf16": torch.bfloat16}[precision]).float()
    stochastic = rounding == "stochastic" and codec.stochastic
    span = 2**16 if codec.bits == 4 else 2**32  # a slot's 16 hash bits, or al8's whole word
    words = torch.randint(0, span, x.shape, generator=generator, device=x.device) if stochastic else None
    return decode(codec, *encode(codec, x, words))


def synthetic_states(rule: str = "adamw", spread: str = "wide", shape=(256, 1024), seed: int = 0,
                     **hyperparameters) -> tuple[dict, torch.Tensor]:
    """({slot name: state}, gradient) for the slots ``rule`` uses with these hyperparameters."""
    if spread not in SPREADS:
        raise ValueError(f"unknown spread={spread!r}: choose one of {list(SPREADS)}")
    r = get_rule(rule)
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(-10.0 + SPREADS[spread] * torch.randn(shape, generator=gen))
    states = {}
    for name, signed, used in zip(r.slot_names, r.slot_signed, r.slots(make_group(r, hyperparameters))):
        if used:
            z = torch.randn(shape, generator=gen).clamp(-3.0, 3.0) / 3.5
            states[name] = scale * z if signed else scale * scale
    return states, scale * torch.randn(shape, generator=gen)


def _update(rule, group: dict, states: dict, grad: torch.Tensor) -> torch.Tensor:
    host = rule.host_init()
    host["step"] = 999  # past warm-up: bias corrections near 1
    consts = torch.tensor(rule.prepare(group, host), dtype=torch.float32).to(grad.device)
    zero = torch.zeros_like(grad)
    slots = [states.get(name, zero) for name in rule.slot_names] + [zero] * (3 - len(rule.slot_names))
    w = TORCH_RULE_UPDATES[rule.name](zero, grad, *slots, *consts.unbind())[0]
    return w  # the weight started at 0: this is the update


def quantization_report(states: dict | None = None, grad: torch.Tensor | None = None, precision: str = "al8",
                        rule: str = "adamw", spread: str = "wide", shape=(256, 1024), seed: int = 0,
                        rounding: str = "nearest", **hyperparameters) -> QuantizationReport:
    """Reconstruction error and E_upd of ``precision`` on ``states`` ({slot name: (out, in)
    tensor}, with their ``grad``) or on synthetic log-normal states of ``spread``.
    ``hyperparameters`` go to the rule (lr is 1 and weight_decay 0 unless given)."""
    ForgeConfig(state_precision=precision)  # a bad precision raises, naming the choices
    if precision == "auto":
        raise ValueError("quantization_report measures one storage precision, and 'auto' picks one by the weights' "
                         "dtype: give precision='bf16' (auto's pick for bf16 weights), 'fp32', 'int8', 'al8' or 'log4'")
    r = get_rule(rule)
    hyperparameters = {"lr": 1.0, "weight_decay": 0.0, **hyperparameters}
    if states is None:
        states, grad = synthetic_states(rule, spread, shape, seed, **hyperparameters)
    elif grad is None:
        raise ValueError("quantization_report(states=...) needs the gradient too (grad=...): "
                         "E_upd is measured on the update the states produce with it")
    unknown = sorted(set(states) - set(r.slot_names))
    if unknown or not states:
        raise ValueError(f"states {sorted(states)} are not slots of forge {r.name}: give some of {r.slot_names}")
    group = make_group(r, hyperparameters)
    gen = torch.Generator(device=grad.device).manual_seed(seed)
    signed = dict(zip(r.slot_names, r.slot_signed))
    stored = {k: round_trip(v.float(), precision, signed[k], rounding, gen) for k, v in states.items()}
    exact = _update(r, group, states, grad.float())

    def e_upd(trial: dict) -> float:
        return float((_update(r, group, trial, grad.float()) - exact).norm() / (exact.norm() + 1e-30))

    report = QuantizationReport(precision, r.name, e_upd=e_upd(stored))
    for name, value in states.items():
        codec = slot_codec(precision, signed[name])
        report.codecs[name] = codec.name if codec is not None else "factored" if precision == "log4_factored" \
            else precision
        report.relative_l2[name] = float((stored[name] - value).norm() / value.norm().clamp_min(1e-30))
        report.e_upd_slot[name] = e_upd({**states, name: stored[name]})
    return report


# ------------------------------------------------------------ along a trajectory


def trajectory_gradients(shape=(256, 1024), steps: int = 300, seed: int = 0):
    """Gradients with the structure of a transformer linear's (a generator of ``steps``):
    log-normal row and column scales with a few outlier columns (x16), a persistent signal
    under heavy-tailed (Student-t, 3 dof) noise, and a fifth of the columns (rare inputs)
    active in 5% of the steps only, zero otherwise."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    col = torch.exp2(1.5 * torch.randn(cols, generator=gen))
    col[torch.randperm(cols, generator=gen)[: max(1, cols // 100)]] *= 16.0
    scale = 1e-3 * torch.exp2(torch.randn(rows, 1, generator=gen)) * col
    signal = 0.3 * torch.randn(shape, generator=gen)
    rare = torch.rand(cols, generator=gen) < 0.2
    student = torch.distributions.StudentT(3.0)
    for _ in range(steps):
        noise = student.sample(shape).clamp(-20.0, 20.0)  # the global RNG: seeded below
        active = ~rare | (torch.rand(cols, generator=gen) < 0.05)
        yield scale * (signal + noise) * active


def trajectory_error(store: dict, rule: str = "adamw", shape=(256, 1024), steps: int = 300, seed: int = 0,
                     **hyperparameters) -> dict:
    """E_upd along ``steps`` of trajectory_gradients: the rule run twice on the same gradients,
    once on fp32 states, once storing each slot named in ``store`` ({slot: x -> stored x}) after
    every step, as a fused layer does. {"mean": over the second half of the steps, "last"}."""
    r = get_rule(rule)
    group = make_group(r, {"lr": 1.0, "weight_decay": 0.0, **hyperparameters})
    update = TORCH_RULE_UPDATES[r.name]
    host = r.host_init()
    torch.manual_seed(seed)
    exact = quant = None
    errors = []
    for g in trajectory_gradients(shape, steps, seed):
        if exact is None:
            init = r.slot_init(group)
            exact = [torch.full_like(g, init[i]) if i < len(r.slot_names) else torch.zeros_like(g) for i in range(3)]
            quant = [s.clone() for s in exact]
        consts = torch.tensor(r.prepare(group, host), dtype=torch.float32).unbind()
        zero = torch.zeros_like(g)
        u, *exact = update(zero, g, *exact, *consts)
        uq, *quant = update(zero, g, *quant, *consts)
        quant = [store[n](s) if n in store else s for n, s in zip((*r.slot_names, "", "", ""), quant)]
        errors.append(float((uq - u).norm() / (u.norm() + 1e-30)))
    half = errors[len(errors) // 2:]
    return {"mean": sum(half) / len(half), "last": errors[-1]}
