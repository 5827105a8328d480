"""Per-weight optimizer state of a fused layer: weight-shaped slots, allocated lazily at
the layer's first fused step, plus the host-side counters of its rule (step, NAdam's
mu_product). ``state_dict`` is what optimizer checkpoints carry.

A slot is an fp32 or bf16 tensor in the parameter's shape and layout, or, for the 8-bit
precisions, a codecs.QuantisedSlot (codes in that layout, per-block metadata in logical
(out, in / 64) coordinates); for log4, packed codes in logical (out, in / 2) layout; for
log4_factored, the signed slots as log4's and the never-negative one a factored.FactoredSlot
(row and column vectors). The codec of a slot follows from the precision and whether the
rule's slot is signed (rules.Rule.slot_signed).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .codecs import LEGACY_AL8, QuantisedSlot, saved_codec, slot_codec
from .factored import FactoredSlot, rank1, whole_keys
from .precision_checks import check_group
from .rules import Rule

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _logical(slot, transposed: bool):
    """A slot as (out_features, in_features), the kernels' view."""
    if slot is None:
        return None
    if isinstance(slot, QuantisedSlot):
        return slot.logical(transposed)
    return slot.t() if transposed else slot


def slots_key(slots) -> tuple:
    """Where state slots lie (their storage, dtype or codec): a launch bound to them is made
    again when this changes (a load, an allocation, ``model.to``)."""
    return tuple(None if s is None else (s.codes.data_ptr(), s.meta.data_ptr(), s.codec)
                 if isinstance(s, QuantisedSlot) else s.vectors.data_ptr() if isinstance(s, FactoredSlot)
                 else (s.data_ptr(), s.dtype) for s in slots)


def slot_bytes(slot) -> int:
    """Bytes a state slot stores: codes and metadata, factored vectors, or its tensor."""
    if slot is None:
        return 0
    return slot.nbytes() if isinstance(slot, (QuantisedSlot, FactoredSlot)) else slot.untyped_storage().nbytes()


class ForgeState:
    """``transposed``: for a fused layer's weight, whether the parameter is stored
    (in, out) (Conv1D), and False for a fused embedding's (optim/embedding_step.py); None for
    a tensor the ordinary optimizer steps (an embedding on the ordinary path, norms, biases).
    Those states are never quantised: under an 8-bit precision they stay fp32,
    the quantisation seed's G1 grouping (they are the sensitive ones, and small)."""

    def __init__(self, rule: Rule, precision: str, transposed: bool | None = None):
        self.rule = rule
        self.precision = precision  # one of config.STATE_PRECISIONS, validated by ForgeConfig
        if precision == "al8" and rule.slot_signed.count(False) > 1:
            # al8 codes round with the element hash's high half (core/codecs.py), which two
            # al8 slots of one layer would share
            raise ValueError(f"state_precision='al8' takes at most one never-negative state a layer, and rule "
                             f"{rule.name!r} has {rule.slot_signed.count(False)}: use state_precision='int8'")
        self.transposed = transposed
        self.reset()

    def reset(self) -> None:
        """Back to no state, as before the first step. ``transposed`` stays: it says what the
        tensor is (a fused layer's weight or not), which decides how a checkpoint loads into it."""
        self.slots: list = [None, None, None]
        self.host: dict = self.rule.host_init()
        self.allocated = False

    @property
    def step(self) -> int:
        return self.host["step"]

    @property
    def stored_precision(self) -> str:
        """The precision the slots are actually stored in. Tensors outside fused layers
        (norms, an embedding on the ordinary path) keep 16-bit states under an 8-bit precision: 8-bit moments of
        rarely-touched embedding rows are the known weak spot of 8-bit optimizers."""
        quantisable = self.transposed is not None or self.precision in _DTYPES
        return self.precision if quantisable else "bf16"

    @property
    def whole_keys(self) -> set[str]:
        """state_dict keys every rank of a row-sharded layer holds whole (factored.whole_keys)."""
        return whole_keys(self.rule.slot_names)

    def _new_slot(self, param: torch.Tensor, index: int, fill: float, whole_rows: int | None = None):
        codec = slot_codec(self.stored_precision, self.rule.slot_signed[index])
        if self.stored_precision == "log4_factored" and codec is None:
            out_features, in_features = param.shape[::-1] if self.transposed else param.shape
            return FactoredSlot.empty(out_features, in_features, param.device, fill, whole_rows)
        if codec is None:
            return torch.full_like(param, fill, dtype=_DTYPES[self.stored_precision],
                                   memory_format=torch.preserve_format).detach()
        slot = QuantisedSlot.empty_like(param, codec, self.transposed)  # all zeros
        if fill != 0.0:
            view = slot.logical(self.transposed)
            view.write(torch.full((view.codes.shape[0], view.in_features()), fill, device=param.device))
        return slot

    def allocate(self, param: torch.Tensor, group: dict, transposed: bool | None = None,
                 whole_rows: int | None = None) -> None:
        """Create the slots this rule needs for ``group``, in the parameter's layout. A fused
        layer passes ``transposed``; ``whole_rows``: the whole weight's rows when ``param`` is
        a row shard of it (a factored moment's column sums are the whole weight's)."""
        if transposed is not None:
            self.transposed = transposed
        if self.allocated:
            return
        check_group(self.rule, self.stored_precision, group)
        if slot_codec(self.stored_precision, True) is not None and param.dim() != 2:
            raise ValueError(f"state_precision={self.stored_precision!r} quantises a fused layer's 2-d weight along "
                             f"its rows, not a {tuple(param.shape)} tensor: give it ForgeState(..., transposed=None) "
                             "(16-bit states) or state_precision='bf16'")
        inits = self.rule.slot_init(group)
        for i, needed in enumerate(self.rule.slots(group)):
            if needed:
                self.slots[i] = self._new_slot(param, i, inits[i], whole_rows)
        self.allocated = True

    def kernel_slots(self) -> list:
        """The slots as (out_features, in_features) views, what the backends take."""
        return [_logical(s, bool(self.transposed)) for s in self.slots]

    def nbytes(self) -> int:
        """Bytes of the allocated state tensors, codes and metadata included."""
        return sum(slot_bytes(s) for s in self.slots)

    def state_dict(self) -> dict:
        sd = {"rule": self.rule.name, "precision": self.stored_precision, **self.host}
        for name, s in zip(self.rule.slot_names, self.slots):
            if isinstance(s, QuantisedSlot):
                # codes and metadata exactly as stored, and how to read them back
                sd.update({name: s.codes, f"{name}_meta": s.meta, f"{name}_codec": s.codec.name,
                           "transposed": bool(self.transposed)})
            elif isinstance(s, FactoredSlot):
                # what the next step reads, as fp32 vectors (the other sets are zero or cleared by then)
                rows, cols, total = s.current(self.step)
                sd.update({f"{name}_row": rows.clone(), f"{name}_col": cols.clone(), f"{name}_total": total.clone()})
            elif s is not None:
                sd[name] = s
        return sd

    def load_state_dict(self, sd: dict, param: torch.Tensor, group=None) -> None:
        """``param``: this rank's part; ``group``: the ranks whose row shards make the whole
        weight, when it is one (a full moment factored here sums its columns over them)."""
        if sd.get("rule", self.rule.name) != self.rule.name:
            raise ValueError(
                f"checkpoint state was written by forge rule {sd['rule']!r} but this layer uses "
                f"{self.rule.name!r}: patch the model with optimizer={sd['rule']!r}"
            )
        source = sd.get("precision", self.stored_precision)
        if source != self.stored_precision:
            warnings.warn(
                f"optimizer state saved as {source} is converted to {self.stored_precision} on load",
                stacklevel=3,
            )
        self.host = {k: sd[k] for k in self.rule.host_init()}
        for i, name in enumerate(self.rule.slot_names):
            if f"{name}_row" in sd or (name in sd and self._factored(i)):
                self.slots[i] = self._loaded_factored(sd, name, i, param, group)
            elif name in sd:
                self.slots[i] = self._loaded_slot(sd, name, i, param)
        self.allocated = any(s is not None for s in self.slots) or self.host["step"] > 0

    def _factored(self, index: int) -> bool:
        return self.stored_precision == "log4_factored" and not self.rule.slot_signed[index]

    def _loaded_factored(self, sd: dict, name: str, index: int, param: torch.Tensor, group=None):
        """A factored moment saved as vectors (exact), or a full fp32/bf16 one factored here by its
        row and column sums (over ``group``'s row shards); into a full slot, the vectors' rank-1
        estimate."""
        if f"{name}_row" in sd:
            rows, cols, total = (sd[f"{name}_{part}"].to(param.device).float() for part in ("row", "col", "total"))
        elif f"{name}_codec" in sd:
            raise ValueError(f"the {sd[f'{name}_codec']} codes of {name} cannot be factored on load: resume with the "
                             f"precision they were saved in ({sd.get('precision')!r}), or from fp32/bf16 states")
        else:
            full = _logical(sd[name].to(param.device).float(), bool(self.transposed))
            rows, cols, total = full.sum(1), full.sum(0), full.sum()
            if group is not None:  # this rank's rows: the columns' and total's shares of the whole
                tail = torch.cat([cols, total[None]])
                dist.all_reduce(tail, group=group)
                cols, total = tail[:-1], tail[-1]
        if not self._factored(index):
            full = rank1(rows, cols, total)
            return self._loaded_slot({**sd, name: _logical(full, bool(self.transposed))}, name, index, param)
        slot = self._new_slot(param, index, 0.0)
        slot.vectors.zero_()
        r, c, s = slot.current(self.host["step"])
        r.copy_(rows)
        c.copy_(cols)
        s.copy_(total)
        return slot

    def _loaded_slot(self, sd: dict, name: str, index: int, param: torch.Tensor):
        slot = self._new_slot(param, index, 0.0)
        saved = sd[name].to(param.device)
        codec = sd.get(f"{name}_codec")
        if codec is not None:
            meta = sd[f"{name}_meta"].to(param.device)
            # in_features: 4-bit codes do not tell an odd one
            width = param.shape[0 if self.transposed else -1] if param.dim() == 2 else None
            saved = QuantisedSlot(saved_codec(codec, meta), saved, meta, width)
            if saved.codec.kind == LEGACY_AL8:
                warnings.warn(f"the al8 state of forge_hf 0.1.0 ({name}) is stored again in this version's al8 "
                              f"codes (a grid on the float's bits): its values move by up to a step", stacklevel=4)
            if isinstance(slot, QuantisedSlot) and slot.codec == saved.codec \
                    and slot.meta.shape == saved.meta.shape:
                slot.codes.copy_(saved.codes)  # same codec: the very codes, no re-rounding
                slot.meta.copy_(saved.meta)
                return slot
            was_transposed = bool(sd.get("transposed", False))
            saved = _logical(saved.logical(was_transposed).read(), was_transposed)  # back to param layout
        # another precision: dequantise (above), then store as this state's precision
        if isinstance(slot, QuantisedSlot):
            slot.logical(bool(self.transposed)).write(_logical(saved.float(), bool(self.transposed)))
        else:
            slot.copy_(saved)
        return slot
