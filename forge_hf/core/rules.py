"""Element-wise optimizer rules, each written once and read by both backends.

A rule has three parts:

* ``defaults``: its hyperparameters with torch.optim's names and default values
  (Lion: the values of its paper);
* ``prepare(group, host)``: the per-step host work in Python floats (float64): the step
  count, bias corrections, learning-rate products. It returns the rule's scalar
  constants, which reach the kernel through a small device tensor, so a changing lr
  never recompiles anything;
* ``update(w, g, s0, s1, s2, c0, ..., c11)``: the element-wise arithmetic on fp32 values
  (a whole tile at once), returning ``(w, s0, s1, s2)``. It may only use arithmetic and
  the free name ``ops`` (``ops.sqrt``, ``ops.where``). Each backend runs the *same code
  object* with ``ops`` bound to its own module: ``triton.language`` inside the Triton
  kernel, ``torch`` in the reference backend (see ``bind_update``).

Slots are the weight-shaped optimizer-state tensors, named as torch.optim names them so
state_dicts read naturally. A rule may need only some of its slots for given
hyperparameters (SGD without momentum has none); ``slots(group)`` says which.
``slot_signed`` says which slots may hold negative values (momenta) and which never do
(second moments, sums of squares): 8-bit storage picks its code by it (codecs.py).

The order of operations in each ``update`` follows torch.optim's single-tensor
(``foreach=False``) implementation, so fp32 results agree to round-off.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field

NUM_SCALARS = 12  # c0..c11: the most any rule needs (RAdam uses 11)
MAX_SLOTS = 3


def _lerp_weight_ok(w: float) -> None:
    # torch.lerp switches formula at weight 0.5; the rules below use the small-weight
    # form, which is the one torch takes for every beta >= 0.5.
    if w >= 0.5:
        raise ValueError(
            f"1 - beta = {w} is not below 0.5: betas of 0.5 or less are not supported by "
            "forge's fused rules; use a beta above 0.5"
        )


def _pad(values: list[float]) -> list[float]:
    return values + [0.0] * (NUM_SCALARS - len(values))


def _betas(group: dict) -> tuple[float, float]:
    b1, b2 = group["betas"]
    return float(b1), float(b2)


# --------------------------------------------------------------------------- AdamW


def _adamw_prepare(group: dict, host: dict) -> list[float]:
    host["step"] += 1
    t = host["step"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    b1, b2 = _betas(group)
    _lerp_weight_ok(1 - b1)
    bc1 = 1 - b1**t
    bc2 = 1 - b2**t
    return _pad([1 - lr * wd, 1 - b1, b2, 1 - b2, bc2**0.5, eps, -(lr / bc1)])


def _adamw_update(w, g, m, v, s2, decay, omb1, b2, omb2, bc2_sqrt, eps, neg_step, c7, c8, c9, c10, c11):
    w = w * decay
    m = m + omb1 * (g - m)  # torch: exp_avg.lerp_(grad, 1 - beta1)
    v = v * b2 + omb2 * g * g
    denom = ops.sqrt(v) / bc2_sqrt + eps
    w = w + neg_step * (m / denom)
    return w, m, v, s2


# --------------------------------------------------------------------------- NAdam


def _weight_decay_terms(group: dict) -> tuple[float, float]:
    """(multiplicative decay, L2 coefficient added to the gradient)."""
    lr, wd = group["lr"], group["weight_decay"]
    if group.get("decoupled_weight_decay", False):
        return 1 - lr * wd, 0.0
    return 1.0, wd


def _nadam_prepare(group: dict, host: dict) -> list[float]:
    host["step"] += 1
    t = host["step"]
    lr, eps, psi = group["lr"], group["eps"], group["momentum_decay"]
    b1, b2 = _betas(group)
    _lerp_weight_ok(1 - b1)
    decay, l2 = _weight_decay_terms(group)
    mu = b1 * (1.0 - 0.5 * 0.96 ** (t * psi))
    mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((t + 1) * psi))
    host["mu_product"] *= mu
    mu_product = host["mu_product"]
    c_grad = -lr * (1.0 - mu) / (1.0 - mu_product)
    c_m = (-lr * mu_next) / (1.0 - mu_product * mu_next)
    return _pad([decay, l2, 1 - b1, b2, 1 - b2, 1 - b2**t, eps, c_grad, c_m])


def _nadam_update(w, g, m, v, s2, decay, l2, omb1, b2, omb2, bc2, eps, c_grad, c_m, c9, c10, c11):
    w = w * decay
    g = g + l2 * w
    m = m + omb1 * (g - m)
    v = v * b2 + omb2 * g * g
    denom = ops.sqrt(v / bc2) + eps
    w = w + c_grad * (g / denom)
    w = w + c_m * (m / denom)
    return w, m, v, s2


# --------------------------------------------------------------------------- RAdam


def _radam_prepare(group: dict, host: dict) -> list[float]:
    host["step"] += 1
    t = host["step"]
    lr, eps = group["lr"], group["eps"]
    b1, b2 = _betas(group)
    _lerp_weight_ok(1 - b1)
    decay, l2 = _weight_decay_terms(group)
    bc1 = 1 - b1**t
    bc2 = 1 - b2**t
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * t * (b2**t) / bc2
    rectified = rho_t > 5.0
    rect = (
        ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
        if rectified
        else 0.0
    )
    return _pad([decay, l2, 1 - b1, b2, 1 - b2, bc1, lr, float(rectified), rect, bc2**0.5, eps])


def _radam_update(w, g, m, v, s2, decay, l2, omb1, b2, omb2, bc1, lr, rectified, rect, bc2_sqrt, eps, c11):
    w = w * decay
    g = g + l2 * w
    m = m + omb1 * (g - m)
    v = v * b2 + omb2 * g * g
    step = (m / bc1) * lr
    adaptive = bc2_sqrt / (ops.sqrt(v) + eps)
    w = w - ops.where(rectified > 0.5, step * adaptive * rect, step)
    return w, m, v, s2


# --------------------------------------------------------------------------- Lion


def _lion_prepare(group: dict, host: dict) -> list[float]:
    host["step"] += 1
    lr, wd = group["lr"], group["weight_decay"]
    b1, b2 = _betas(group)
    return _pad([1 - lr * wd, b1, 1 - b1, b2, 1 - b2, -lr])


def _lion_update(w, g, m, s1, s2, decay, b1, omb1, b2, omb2, neg_lr, c6, c7, c8, c9, c10, c11):
    # Chen et al. 2023, Alg. 2: decoupled decay, sign of the interpolation, then the EMA.
    w = w * decay
    c = m * b1 + g * omb1
    sign = ops.where(c > 0, 1.0, ops.where(c < 0, -1.0, 0.0))
    w = w + neg_lr * sign
    m = m * b2 + g * omb2
    return w, m, s1, s2


# --------------------------------------------------------------------------- RMSprop


def _rmsprop_slots(group: dict) -> tuple[bool, bool, bool]:
    return True, group["momentum"] > 0, bool(group["centered"])


def _rmsprop_prepare(group: dict, host: dict) -> list[float]:
    host["step"] += 1
    alpha = group["alpha"]
    _lerp_weight_ok(1 - alpha)
    return _pad(
        [
            group["weight_decay"],
            alpha,
            1 - alpha,
            group["eps"],
            -group["lr"],
            group["momentum"],
            float(group["momentum"] > 0),
            float(bool(group["centered"])),
        ]
    )


def _rmsprop_update(w, g, sq, buf, gavg, l2, alpha, oma, eps, neg_lr, momentum, has_momentum, centered,
                    c8, c9, c10, c11):
    g = g + l2 * w
    sq = sq * alpha + oma * g * g
    gavg = ops.where(centered > 0.5, gavg + oma * (g - gavg), gavg)
    avg = ops.where(centered > 0.5, ops.sqrt(sq + (-1.0) * gavg * gavg), ops.sqrt(sq)) + eps
    buf = ops.where(has_momentum > 0.5, buf * momentum + g / avg, buf)
    w = ops.where(has_momentum > 0.5, w + neg_lr * buf, w + neg_lr * (g / avg))
    return w, sq, buf, gavg


# --------------------------------------------------------------------------- Adagrad


def _adagrad_prepare(group: dict, host: dict) -> list[float]:
    host["step"] += 1
    clr = group["lr"] / (1 + (host["step"] - 1) * group["lr_decay"])
    return _pad([group["weight_decay"], -clr, group["eps"]])


def _adagrad_update(w, g, ssum, s1, s2, l2, neg_clr, eps, c3, c4, c5, c6, c7, c8, c9, c10, c11):
    g = g + l2 * w
    ssum = ssum + 1.0 * g * g
    std = ops.sqrt(ssum) + eps
    w = w + neg_clr * (g / std)
    return w, ssum, s1, s2


# --------------------------------------------------------------------------- SGD


def _sgd_slots(group: dict) -> tuple[bool, bool, bool]:
    return group["momentum"] != 0, False, False


def _sgd_prepare(group: dict, host: dict) -> list[float]:
    host["step"] += 1
    momentum, dampening = group["momentum"], group["dampening"]
    if group["nesterov"] and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"nesterov=True needs momentum > 0 and dampening = 0 (got momentum={momentum}, "
            f"dampening={dampening}), as in torch.optim.SGD"
        )
    first = host["step"] == 1  # torch: the buffer starts as a copy of the first gradient
    return _pad(
        [
            group["weight_decay"],
            0.0 if first else momentum,
            1.0 if first else 1 - dampening,
            momentum,
            float(momentum != 0),
            float(bool(group["nesterov"])),
            -group["lr"],
        ]
    )


def _sgd_update(w, g, buf, s1, s2, l2, c_buf, c_g, momentum, has_momentum, nesterov, neg_lr, c7, c8, c9, c10, c11):
    g = g + l2 * w
    buf = ops.where(has_momentum > 0.5, buf * c_buf + c_g * g, buf)
    d = ops.where(nesterov > 0.5, g + momentum * buf, buf)
    d = ops.where(has_momentum > 0.5, d, g)
    w = w + neg_lr * d
    return w, buf, s1, s2


# --------------------------------------------------------------------------- registry


def _always(n: int) -> Callable[[dict], tuple[bool, bool, bool]]:
    flags = tuple(i < n for i in range(MAX_SLOTS))
    return lambda group: flags


@dataclass(frozen=True)
class Rule:
    name: str
    torch_name: str  # the torch.optim class this rule reproduces ("" for Lion)
    slot_names: tuple[str, ...]
    defaults: dict
    prepare: Callable[[dict, dict], list[float]]
    update: types.FunctionType
    slots: Callable[[dict], tuple[bool, bool, bool]]
    slot_signed: tuple[bool, ...]  # one per slot name: False for a state that is never negative
    slot_init: Callable[[dict], tuple[float, float, float]] = field(
        default=lambda group: (0.0, 0.0, 0.0)
    )
    host_init: Callable[[], dict] = field(default=lambda: {"step": 0})

    def __post_init__(self):
        if len(self.slot_signed) != len(self.slot_names):
            raise ValueError(f"rule {self.name}: slot_signed needs one entry per slot name {self.slot_names}")

    def check(self, group: dict) -> None:
        """Validate hyperparameter values the way torch.optim does, naming the value."""
        lr = group.get("lr")
        if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"invalid learning rate lr={lr!r} for forge {self.name}: use a finite number >= 0")
        for key in ("eps", "weight_decay", "momentum", "lr_decay", "initial_accumulator_value", "momentum_decay",
                    "dampening"):
            if key in group and not (isinstance(group[key], (int, float)) and group[key] >= 0):
                raise ValueError(f"invalid {key}={group[key]!r} for forge {self.name}: use a number >= 0")
        if "betas" in group:
            betas = group["betas"]
            if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
                raise ValueError(f"invalid betas={betas!r} for forge {self.name}: use two numbers in [0, 1)")
        if "alpha" in group and not 0.0 <= group["alpha"] < 1.0:
            raise ValueError(f"invalid alpha={group['alpha']!r} for forge {self.name}: use a number in [0, 1)")


_ADAM_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)

RULES: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        Rule("adamw", "AdamW", ("exp_avg", "exp_avg_sq"), dict(_ADAM_DEFAULTS, weight_decay=1e-2),
             _adamw_prepare, _adamw_update, _always(2), slot_signed=(True, False)),
        Rule("nadam", "NAdam", ("exp_avg", "exp_avg_sq"),
             dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
                  decoupled_weight_decay=False),
             _nadam_prepare, _nadam_update, _always(2), slot_signed=(True, False),
             host_init=lambda: {"step": 0, "mu_product": 1.0}),
        Rule("radam", "RAdam", ("exp_avg", "exp_avg_sq"),
             dict(_ADAM_DEFAULTS, weight_decay=0.0, decoupled_weight_decay=False),
             _radam_prepare, _radam_update, _always(2), slot_signed=(True, False)),
        Rule("lion", "", ("exp_avg",), dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0),
             _lion_prepare, _lion_update, _always(1), slot_signed=(True,)),
        Rule("rmsprop", "RMSprop", ("square_avg", "momentum_buffer", "grad_avg"),
             dict(lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False),
             _rmsprop_prepare, _rmsprop_update, _rmsprop_slots, slot_signed=(False, True, True)),
        Rule("adagrad", "Adagrad", ("sum",),
             dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10),
             _adagrad_prepare, _adagrad_update, _always(1), slot_signed=(False,),
             slot_init=lambda group: (float(group["initial_accumulator_value"]), 0.0, 0.0)),
        Rule("sgd", "SGD", ("momentum_buffer",),
             dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False),
             _sgd_prepare, _sgd_update, _sgd_slots, slot_signed=(True,)),
    )
}


def get_rule(name: str) -> Rule:
    key = name.lower()
    if key not in RULES:
        raise ValueError(f"unknown optimizer {name!r} for forge: choose one of {sorted(RULES)}")
    return RULES[key]


def bind_ops(fn: types.FunctionType, ops_module, **names) -> types.FunctionType:
    """``fn`` with its free name ``ops`` bound to ``ops_module`` (and any further global
    ``names``: Triton's interpreter wants ``triton.language`` among a kernel's globals).

    The code object is shared, so both backends run the very same arithmetic."""
    # __name__ gives the new function a __module__: Triton's compiler reads it on every
    # global a kernel touches, and fails on None
    scope = {**names, "ops": ops_module, "__builtins__": __builtins__, "__name__": fn.__module__}
    return types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)


def bind_update(rule: Rule, ops_module) -> types.FunctionType:
    """The rule's update with ``ops`` bound to ``ops_module`` (see bind_ops)."""
    return bind_ops(rule.update, ops_module)


def make_group(rule: Rule, hyperparameters: dict) -> dict:
    """A param-group-like dict: the rule's defaults overridden by ``hyperparameters``."""
    unknown = sorted(set(hyperparameters) - set(rule.defaults))
    if unknown:
        raise TypeError(
            f"unknown hyperparameter(s) {unknown} for forge {rule.name}: "
            f"it takes {sorted(rule.defaults)}"
        )
    group = dict(rule.defaults)
    group.update(hyperparameters)
    if "betas" in group:
        group["betas"] = tuple(group["betas"])
    rule.check(group)
    return group
