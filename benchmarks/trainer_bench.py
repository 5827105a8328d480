"""The user's path, side by side: a step through the Trainer API with each arm a user could set
up, in one process, one arm after another, on a real-shaped model with random weights.

Arms (any subset, in the order given):
  adamw_fused          Trainer(optim="adamw_torch_fused")
  adamw_fused_compile  the same with torch_compile=True
  forge_eager          ForgeTrainer(optim="forge_adamw"), cuda_graph=false
  forge                ForgeTrainer(optim="forge_adamw") with its default options
  forge_compile        ForgeTrainer with torch_compile=True (cuda_graph=auto)
  sft_adamw_fused      trl.SFTTrainer(optim="adamw_torch_fused") on cells of varying lengths, TRL's collator
  sft_forge            trl.SFTTrainer with ForgeTrainerMixin, default options
  ..._int8             suffix: forge arms with int8 state (the default otherwise: bf16 for bf16 weights)
  ..._fsdp2            suffix: the model under accelerate's FSDP2 (fully_shard of each decoder
                       layer) in a world of one process: what the wrapping costs where there
                       is nothing to shard. Trainer's bf16 flag off (accelerate would upcast
                       bf16 weights to fp32 under mixed precision): compare with --bf16 off

Every arm: bf16 weights, SDPA attention, packed batches of random tokens (or rows of varying
lengths, padded or flattened: ``Cell``; their rows give the mean step, real tokens a second and
the share of padding), max_grad_norm=0 unless --max-grad-norm (clipping, the same on every
arm), one micro-batch a step unless --accumulation K (K micro-batches of the cell a step), a
callback that synchronises and times each optimizer step; the median over the steps after the warm-up,
with the interquartile range, and the arm's peak allocated memory (statistics reset, caches
emptied between arms; the timed steps' own peak in the note, every step's in the log). A
captured step allocates nothing while it replays, so its steps' peak is what stays allocated
outside its pool: the capture's own peak is in the arm's. Each arm's row goes to the results
table (results_table.py) as the arm ends.

    python benchmarks/trainer_bench.py --models llama-3.1-8b --batches 1x512 --arms adamw_fused,forge
    python benchmarks/trainer_bench.py --arms forge_compile --forge-options recompute_swiglu=true
    python benchmarks/trainer_bench.py --arms adamw_fused,forge_eager --rounds 3 --step-sync off
    python benchmarks/trainer_bench.py --batches 4x128-512 --arms adamw_fused,forge_eager,forge   # SFT-like rows
    python benchmarks/trainer_bench.py --models llama-3.1-8b --batches 1x512 --accumulation 4 --max-grad-norm 1.0

--forge-options adds forge options (optim_args syntax) to every forge arm; --liger on gives every arm
the recipes' Liger kernels (ForgeTrainer refuses them with torch_compile). The row's arm names both
(trainer_forge+liger+recompute_swiglu), its note their values.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import pstats
import re
import socket
import statistics
import tempfile
import time
import traceback

import torch

from models import build_model
from results_table import add_table_option, append_rows

ARMS = ("adamw_fused", "adamw_fused_compile", "forge_eager", "forge", "forge_compile", "sft_adamw_fused", "sft_forge")


class StepClock:
    """A TrainerCallback (built lazily: transformers is imported in main) timing each step;
    with ``memory_steps`` it also records the allocator's history over the first steps (what is
    alive at each one's peak), with ``profile_from`` it profiles the GPU's kernels from that step on."""

    def __new__(cls, memory_steps: int = 0, profile_from: int | None = None, step_sync: bool = True):
        from transformers import TrainerCallback

        class Clock(TrainerCallback):
            forge_host_only = True  # timers and allocator statistics: a replay's backward need not be waited for

            def __init__(self):
                self.times: list[float] = []
                self.peaks: list[float] = []  # GiB, each step's own peak
                self.graph = None  # a forge arm's TrainerGraph: which steps captured a graph
                self.captured: list[bool] = []  # each step's: whether a graph was captured in it
                self._captures = 0  # captures seen by the last step's end
                self.before = 0.0  # GiB, the peak before the first step (the model, the Trainer's set-up)
                self.memory: dict | None = None  # memory_steps: what is alive at each step's peak
                self.profile = None  # profile_from: the torch.profiler of the steps from then on
                self.host = None  # and a cProfile of their host time
                self._ends: list[int] = []  # memory_steps: the trace's length at each step's end

            def on_train_begin(self, args, state, control, **kw):
                self.before = torch.cuda.max_memory_allocated() / 2**30
                self._last = time.perf_counter()
                if memory_steps:
                    self._base = torch.cuda.memory_allocated()
                    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)

            def on_step_begin(self, args, state, control, **kw):
                if step_sync:
                    torch.cuda.synchronize()
                if profile_from is not None and len(self.times) == profile_from:
                    self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    self.host = cProfile.Profile()
                    self.profile.start()
                    self.host.enable()
                torch.cuda.reset_peak_memory_stats()
                self._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                if step_sync:  # the step alone, from a drained GPU to a drained GPU
                    torch.cuda.synchronize()
                    self.times.append((time.perf_counter() - self._t) * 1e3)
                else:  # the interval since the last step's end: what a run without a clock sees
                    now = time.perf_counter()
                    self.times.append((now - self._last) * 1e3)
                    self._last = now
                self.peaks.append(torch.cuda.max_memory_allocated() / 2**30)
                captures = len(self.graph.capture_seconds) if self.graph is not None else 0
                self.captured.append(captures > self._captures)
                self._captures = captures
                if len(self.times) <= memory_steps:
                    trace = _device_trace()  # a snapshot of the whole history: taken once a step
                    self._ends.append(len(trace))
                    if len(self.times) == memory_steps:
                        self.memory = _alive_at_peaks(trace, self._ends, self._base)
                        torch.cuda.memory._record_memory_history(enabled=None)

            def on_train_end(self, args, state, control, **kw):
                if self.profile is not None:
                    self.host.disable()
                    torch.cuda.synchronize()
                    self.profile.stop()

        return Clock()


def _device_trace() -> list:
    return torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]


def _alive_at_peaks(trace: list, ends: list[int], base: int) -> list[dict]:
    """Each recorded step's peak and the allocation sites alive then, named by the step that
    made them; the bytes allocated before the first step are ``before_steps_gib``."""
    from capture_memory import peaks_by_step

    return [dict(step=i, peak_gib=(base + extra) / 2**30, before_steps_gib=base / 2**30,
                 sites_mib={k: round(v / 2**20, 1) for k, v in sites.items()})
            for i, (extra, sites) in enumerate(peaks_by_step(trace, ends))]


def host_table(profile, steps: int, top: int = 40) -> list[dict]:
    """The profiled steps' Python functions by their cumulative host time (cProfile's
    accounting, which inflates Python against C): ms a step, own and cumulative."""
    stats = pstats.Stats(profile).stats
    rows = [dict(function=f"{path.split('site-packages/')[-1]}:{line} {name}", cum_ms_per_step=cum * 1e3 / steps,
                 own_ms_per_step=own * 1e3 / steps, calls_per_step=calls / steps)
            for (path, line, name), (_, calls, own, cum, _) in stats.items()]
    rows.sort(key=lambda r: -r["cum_ms_per_step"])
    return rows[:top]


def kernel_table(profile, steps: int, top: int = 40) -> list[dict]:
    """The profiled steps' GPU kernels by their total time: ms a step and calls a step."""
    rows = [dict(kernel=e.key[:160], ms_per_step=e.device_time_total / 1e3 / steps, calls_per_step=e.count / steps)
            for e in profile.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    return [dict(kernel="(all kernels)", ms_per_step=total, calls_per_step=sum(r["calls_per_step"] for r in rows)),
            *rows[:top]]


class Cell:
    """A BATCHxLENGTH cell (packed rows of one length) or BATCHxMIN-MAX (rows of lengths drawn
    uniformly from MIN to MAX, collated by ``collator``: ``pad`` to each batch's longest row
    with an attention mask and labels -100 under the padding, as a padding collator does; ``flat``
    into one row with position_ids restarting at each example, as transformers'
    DataCollatorWithFlattening and TRL's padding_free do)."""

    def __init__(self, text: str, collator: str = "pad"):
        batch, _, lengths = text.partition("x")
        low, _, high = lengths.partition("-")
        self.batch, self.low, self.high = int(batch), int(low), int(high or low)
        self.varies = self.low != self.high
        self.collator = collator if self.varies else None
        self.label = text + ("/flat" if self.collator == "flat" else "")
        self.real_tokens: list[int] = []  # each collated batch's real (label-bearing) tokens
        self.widths: list[int] = []  # each padded batch's longest row

    def dataset(self, n: int, vocab: int):
        if not self.varies:
            return RandomTokens(n, self.high, vocab)
        return VaryingTokens(n, self.low, self.high, vocab)

    def collate(self, rows: list[dict]) -> dict:
        self.real_tokens.append(sum(len(r["input_ids"]) for r in rows))
        if self.collator == "flat":
            from transformers import DataCollatorWithFlattening

            return DataCollatorWithFlattening(return_tensors="pt")(rows)
        longest = max(len(r["input_ids"]) for r in rows)
        self.widths.append(longest)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, :len(r["input_ids"])], mask[i, :len(r["input_ids"])] = torch.as_tensor(r["input_ids"]), 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def padding_note(self, bucket: int | None) -> str:
        """The share of padding tokens: to each batch's longest row, and then to its bucket."""
        if not self.widths:
            return ""
        real, padded = sum(self.real_tokens), self.batch * sum(self.widths)
        note = f"; padding {1 - real / padded:.1%} of tokens to the longest row"
        if bucket:
            bucketed = self.batch * sum(-(-w // bucket) * bucket for w in self.widths)
            note += f", {1 - real / bucketed:.1%} to buckets of {bucket}"
        return note


class VaryingTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, low: int, high: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
        self.rows = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@contextlib.contextmanager
def world_of_one():
    """A torch.distributed world of this process alone (as torch.distributed.run would set it,
    unless a launcher did), for accelerate's FSDP2; afterwards no process group and accelerate's
    state reset, so a later arm runs without FSDP."""
    from accelerate.state import AcceleratorState

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
        for k in added:
            os.environ.pop(k, None)


# --liger on: the recipes' Liger kernels (RoPE, RMSNorm, SwiGLU; the loss stays the model's or lean_loss)
LIGER = dict(use_liger_kernel=True, liger_kernel_config=dict(rope=True, rms_norm=True, swiglu=True,
                                                             cross_entropy=False, fused_linear_cross_entropy=False))


def arm_label(arm: str, forge_options: str, liger: bool, loss_rows: str = "triton", overlap: bool = True,
              step_sync: bool = True, non_blocking: bool = False) -> str:
    """The row's arm: ``trainer_<arm>``, then ``+liger``, ``+<key>`` for each forge option given
    to a forge arm (in name order), its ablations (``+torch_loss_rows``, ``+no_overlap``),
    ``+non_blocking`` for batches copied without blocking the host and ``+no_step_sync`` for
    steps timed as the intervals between their ends, so that the report keeps configurations
    and ways of timing apart. A forge arm run with FORGE_HF_KERNEL or FORGE_HF_WGRAD set in the
    environment is named by it too (``+kernel_persistent``, ``+wgrad_two_pass``)."""
    tags = ["liger"] if liger else []
    if arm.removeprefix("sft_").startswith("forge"):
        tags += sorted(item.partition("=")[0].strip() for item in forge_options.split(",") if item.strip())
        tags += ["torch_loss_rows"] * (loss_rows == "torch") + ["no_overlap"] * (not overlap)
        tags += [f"{tag}_{os.environ[env]}" for tag, env in (("kernel", "FORGE_HF_KERNEL"), ("wgrad", "FORGE_HF_WGRAD"))
                 if os.environ.get(env)]
    tags += ["non_blocking"] * non_blocking + ["no_step_sync"] * (not step_sync)
    return "+".join([f"trainer_{arm}", *tags])


def run_arm(arm: str, model_name: str, cell: Cell, steps: int, warmup: int, bf16: bool,
            forge_options: str = "", liger: bool = False, memory_steps: int = 0, profile_steps: int = 0,
            details: dict | None = None, step_sync: bool = True, non_blocking: bool = False) -> dict:
    """The arm's row; ``details`` (when given) receives what memory_steps and profile_steps found."""
    base, fsdp2 = arm.removesuffix("_fsdp2"), arm.endswith("_fsdp2")
    with world_of_one() if fsdp2 else contextlib.nullcontext():
        return _run_arm(base, model_name, cell, steps, warmup, bf16 and not fsdp2, fsdp2, forge_options,
                        liger, memory_steps, profile_steps, {} if details is None else details, step_sync,
                        non_blocking)


def _run_arm(arm: str, model_name: str, cell: Cell, steps: int, warmup: int, bf16: bool,
             fsdp2: bool, forge_options: str, liger: bool, memory_steps: int, profile_steps: int,
             details: dict, step_sync: bool, non_blocking: bool) -> dict:
    from transformers import Trainer, TrainingArguments

    import forge_hf

    base, _, state = arm.partition("_int8")
    state = "int8" if _ == "_int8" else None  # None: the default, auto (bf16 states for these bf16 weights)
    sft, base = base.startswith("sft_"), base.removeprefix("sft_")
    forge = base.startswith("forge")
    torch.cuda.reset_peak_memory_stats()  # here: an arm that fails reports its own peak, not the last arm's
    model = build_model(model_name)
    clock = StepClock(memory_steps, warmup + steps if profile_steps else None, step_sync)
    fsdp = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": model._no_split_modules}
                ) if fsdp2 else {}
    with tempfile.TemporaryDirectory() as out:
        args = (_sft_config if sft else TrainingArguments)(
            output_dir=out, per_device_train_batch_size=cell.batch, max_steps=warmup + steps + profile_steps,
            learning_rate=2e-5, lr_scheduler_type="constant", bf16=bf16, logging_steps=10_000,
            save_strategy="no", report_to="none", dataloader_num_workers=0, torch_compile=base.endswith("compile"),
            seed=0, optim="forge_adamw" if forge else "adamw_torch_fused",
            optim_args=",".join(filter(None, (state and f"state_precision={state}",
                                              "cuda_graph=false" if base == "forge_eager" else "", forge_options)))
            if forge else None, **fsdp, **(LIGER if liger else {}), **TRAINING_ARGS,
            **(dict(accelerator_config={"non_blocking": True}, dataloader_pin_memory=True) if non_blocking else {}))
        micro = TRAINING_ARGS["gradient_accumulation_steps"]
        data = cell.dataset(cell.batch * micro * (warmup + steps + profile_steps), model.config.vocab_size)
        if sft:  # TRL's collator: padded, or padding-free with --collator flat
            trainer = _sft_trainer(forge, model, args, data, clock)
        else:
            trainer_cls = forge_hf.ForgeTrainer if forge else Trainer
            trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=[clock],
                                  **(dict(data_collator=cell.collate) if cell.varies else {}))
        clock.graph = getattr(trainer, "forge_graph", None)
        trainer.train()
        peak = max(clock.before, *clock.peaks, torch.cuda.max_memory_allocated() / 2**30)
        print(f"{arm}: peak GiB before the steps {clock.before:.2f}, step by step "
              f"{' '.join(f'{p:.2f}' for p in clock.peaks)}", flush=True)
        graphs = len(trainer.forge_graph.captured) if forge else 0
        capture_s = sum(trainer.forge_graph.capture_seconds) if forge else 0.0
        reserved = torch.cuda.max_memory_reserved() / 2**30
        bucket = trainer.forge_config.graph_bucket if forge and graphs else None
    timed = clock.times[warmup:warmup + steps]  # the profiled steps after them are not timed
    uncaptured = [t for t, c in zip(timed, clock.captured[warmup:warmup + steps]) if not c]
    if clock.memory is not None:
        details["memory"] = clock.memory
    after_profile = bool(_PROFILED_ARMS)
    if clock.profile is not None:
        details["kernels"] = kernel_table(clock.profile, profile_steps)
        details["host"] = host_table(clock.host, profile_steps)
        _PROFILED_ARMS.append(arm)
    q = statistics.quantiles(timed, n=4) if len(timed) >= 4 else [min(timed), 0, max(timed)]
    del trainer, model
    steady = max(clock.peaks[warmup:warmup + steps])
    note = f"{len(timed)} steps after {warmup}; IQR; timed steps' peak {steady:.2f} GiB" + \
        (f"; graphs={graphs}, captured in {capture_s:.2f} s" if forge else "") + \
        f"; peak reserved {reserved:.2f} GiB" + \
        (f"; PYTORCH_CUDA_ALLOC_CONF={conf}" if (conf := os.environ.get("PYTORCH_CUDA_ALLOC_CONF")) else "") + \
        ("" if bf16 else "; bf16=False (pure bf16 weights, no autocast)") + ("; FSDP2 world of 1" if fsdp2 else "") + \
        ("; Liger RoPE, RMSNorm, SwiGLU" if liger else "") + \
        (f"; {forge_options}" if forge and forge_options else "") + \
        ("" if step_sync else "; no device sync at the steps: intervals between step ends") + \
        ("; batches copied to the GPU without blocking" if non_blocking else "") + \
        ("; after a profiled arm in this process (its launches may carry the profiler's overhead)"
         if after_profile else "")
    step_ms = statistics.median(timed)
    if cell.varies:  # lengths vary from step to step: the mean is the run's pace
        step_ms = statistics.fmean(timed)
        per_step = cell.batch * micro * statistics.fmean(len(row) for row in data.rows)  # real tokens a step
        collator = "TRL's collator" + ", padding-free" * (cell.collator == "flat") if sft else \
            f"{cell.collator} collator"
        note = f"mean over steps (lengths vary), median {statistics.median(timed):.1f} ms; " + \
            f"{per_step / step_ms:.1f}k real tokens/s; {collator}{cell.padding_note(bucket)}; " + \
            steady_note(uncaptured, len(timed), per_step) + note
    return dict(step_ms=step_ms, spread_ms=q[2] - q[0], peak_gib=peak, note=note)


# TrainingArguments every arm of this process takes (--gradient-checkpointing, --accumulation, --max-grad-norm)
TRAINING_ARGS: dict = {"gradient_accumulation_steps": 1, "max_grad_norm": 0.0}


def steady_note(uncaptured: list[float], timed: int, per_step: float) -> str:
    """The pace of the timed steps that captured no graph (a long run's, once every shape is
    captured), for cells of varying lengths: their mean and real tokens a second."""
    if len(uncaptured) == timed:
        return ""
    if not uncaptured:
        return f"every one of the {timed} timed steps captured a graph; "
    mean = statistics.fmean(uncaptured)
    return (f"the {len(uncaptured)} of {timed} timed steps that captured no graph: mean {mean:.1f} ms, "
            f"{per_step / mean:.1f}k real tokens/s; ")
_PROFILED_ARMS: list[str] = []  # arms of this process run under torch.profiler: CUPTI stays loaded after it stops


def _sft_config(**kwargs):
    """TRL's SFTConfig for the sft_ arms: the rows are token ids already, of any length
    (max_length=None), padding-free with --collator flat."""
    import trl

    return trl.SFTConfig(**kwargs, max_length=None, padding_free=SFT["padding_free"],
                         dataset_kwargs={"skip_prepare_dataset": True})


SFT = {"padding_free": False}  # set by main from --collator


def _sft_trainer(forge: bool, model, args, data, clock):
    """trl.SFTTrainer, with ForgeTrainerMixin for sft_forge; the bundled smoke tokenizer gives
    the padding token (the rows are random ids: no text is tokenized)."""
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer

    import forge_hf

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(forge_hf.__file__), "assets", "smoke",
                                                            "tokenizer"))
    cls = type("ForgeSFT", (forge_hf.ForgeTrainerMixin, trl.SFTTrainer), {}) if forge else trl.SFTTrainer
    rows = Dataset.from_list([{"input_ids": row} for row in data.rows])
    return cls(model=model, args=args, train_dataset=rows, processing_class=tokenizer, callbacks=[clock])


def write_details(folder: str, row: dict, details: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9._-]", "-", f"{row['model']}_{row['batch']}_{row['arm']}")
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w") as f:
        json.dump({**row, **details}, f, indent=1)
    for kernel in details.get("kernels", [])[:12]:
        print(f"  {kernel['ms_per_step']:8.2f} ms {kernel['calls_per_step']:7.1f}x  {kernel['kernel'][:100]}")
    for function in details.get("host", [])[:25]:
        print(f"  {function['cum_ms_per_step']:8.2f} ms cum {function['own_ms_per_step']:7.2f} own "
              f"{function['calls_per_step']:7.1f}x  {function['function'][:100]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3-0.6b")
    p.add_argument("--batches", default="4x512", help="comma-separated cells: BATCHxLENGTH (packed rows of one length) "
                   "or BATCHxMIN-MAX (rows of lengths uniform from MIN to MAX, collated by --collator)")
    p.add_argument("--collator", choices=("pad", "flat"), default="pad",
                   help="cells of varying lengths: pad each batch to its longest row (attention mask, labels -100 "
                   "under the padding), or flatten it into one row with position_ids (padding-free)")
    p.add_argument("--arms", default="adamw_fused,adamw_fused_compile,forge_eager,forge")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the arms this many times, interleaved, every other round reversed (A, B, B, A, ...): "
                        "a row each, under the same drift of the host's speed, for the report to take medians of")
    p.add_argument("--warmup", type=int, default=6, help="untimed steps (compile, capture)")
    p.add_argument("--bf16", choices=("on", "off"), default="on",
                   help="TrainingArguments.bf16 (autocast) for the arms without FSDP2")
    p.add_argument("--forge-options", default="", help="more forge options for the forge arms, as in optim_args "
                   "(e.g. recompute_swiglu=true)")
    p.add_argument("--gradient-checkpointing", choices=("on", "off"), default="off",
                   help="every arm with TrainingArguments.gradient_checkpointing")
    p.add_argument("--accumulation", type=int, default=1,
                   help="every arm with gradient_accumulation_steps: this many micro-batches of the cell a step")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="every arm clips at this global norm (0: no clipping, every arm's fastest setting)")
    p.add_argument("--liger", choices=("on", "off"), default="off",
                   help="every arm with the recipes' Liger kernels (RoPE, RMSNorm, SwiGLU; not its losses)")
    p.add_argument("--step-sync", choices=("on", "off"), default="on",
                   help="on: each step timed from a drained GPU to a drained GPU; off: the interval between step "
                   "ends, no device sync (a run's throughput: host work between steps may overlap the GPU's)")
    p.add_argument("--non-blocking", choices=("on", "off"), default="off",
                   help="every arm's batches copied to the GPU without blocking the host (accelerator_config "
                   "non_blocking with pinned memory)")
    p.add_argument("--loss-rows", choices=("triton", "torch"), default="triton",
                   help="lean_loss's rows on CUDA by forge's Triton kernels, or by torch's (the blocks of fp32 "
                   "temporaries they replace)")
    p.add_argument("--overlap", choices=("on", "off"), default="on",
                   help="off: a replayed forge step's loss waits for its backward, so nothing of the Trainer's "
                   "host work between steps runs beside it")
    p.add_argument("--memory-steps", type=int, default=0, help="record the allocator's history over this many "
                   "first steps of each arm: what is alive at each one's peak, by the step and site that allocated it")
    p.add_argument("--profile-steps", type=int, default=0, help="this many more steps after the timed ones, under "
                   "torch.profiler: each arm's GPU kernels by time a step")
    p.add_argument("--details-dir", help="where --memory-steps and --profile-steps write an arm's JSON "
                   "(MODEL_BATCH_ARM.json, the arm's + as -)")
    p.add_argument("--memory-cap-gib", type=float, default=0.0,
                   help="cap this process's GPU memory at this many GiB (torch.cuda.set_per_process_memory_fraction): "
                   "a smaller card's room, simulated")
    p.add_argument("--out", help="also write the rows as JSON here")
    add_table_option(p)
    opts = p.parse_args()
    if opts.overlap == "off":
        from forge_hf.integrations.cuda_graph import TrainerGraph
        TrainerGraph.overlap = False
    if opts.loss_rows == "torch":
        from forge_hf.nn import loss
        loss.ROW_KERNELS = False
    if (opts.memory_steps or opts.profile_steps) and not opts.details_dir:
        p.error("--memory-steps and --profile-steps write their findings to --details-dir: give one")
    if opts.rounds < 1:
        p.error(f"--rounds {opts.rounds}: give 1 or more")
    if opts.memory_cap_gib < 0:
        p.error(f"--memory-cap-gib {opts.memory_cap_gib}: give a size in GiB, or 0 for the whole card")
    if opts.memory_cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, opts.memory_cap_gib / total))
    SFT["padding_free"] = opts.collator == "flat"
    if opts.gradient_checkpointing == "on":
        TRAINING_ARGS["gradient_checkpointing"] = True
    if opts.accumulation < 1 or opts.max_grad_norm < 0:
        p.error(f"--accumulation {opts.accumulation} --max-grad-norm {opts.max_grad_norm}: give 1 or more, 0 or more")
    TRAINING_ARGS.update(gradient_accumulation_steps=opts.accumulation, max_grad_norm=opts.max_grad_norm)
    rows = []
    for model_name in opts.models.split(","):
        for text in opts.batches.split(","):
            arms = opts.arms.split(",")
            # every other round in reverse: no arm always runs first (or after the same one)
            for arm, round_ in ((arm, r) for r in range(opts.rounds) for arm in (arms[::-1] if r % 2 else arms)):
                label = arm_label(arm, opts.forge_options, opts.liger == "on", opts.loss_rows, opts.overlap == "on",
                                  opts.step_sync == "on", opts.non_blocking == "on")
                label += "+gradient_checkpointing" * (opts.gradient_checkpointing == "on")
                label += f"+accumulation{opts.accumulation}" * (opts.accumulation > 1)
                label += f"+clip{opts.max_grad_norm:g}" * (opts.max_grad_norm > 0)
                label += f"+cap{opts.memory_cap_gib:g}GiB" * (opts.memory_cap_gib > 0)
                cell = Cell(text, opts.collator)
                row = dict(model=model_name, batch=cell.label, arm=label,
                           tool="trainer_bench")
                details: dict = {}
                try:
                    row.update(run_arm(arm, model_name, cell, opts.steps, opts.warmup, opts.bf16 == "on",
                                       opts.forge_options, opts.liger == "on", opts.memory_steps,
                                       opts.profile_steps, details, opts.step_sync == "on",
                                       opts.non_blocking == "on"))
                except Exception as e:  # an arm that fails (out of memory, a compile error) is a row too
                    traceback.print_exc()
                    row.update(step_ms="", spread_ms="", peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                               note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                if opts.rounds > 1:
                    row["note"] = f"{row.get('note', '')}; round {round_ + 1} of {opts.rounds}".lstrip("; ")
                print(json.dumps(row), flush=True)
                if details:
                    write_details(opts.details_dir, row, details)
                append_rows([row], opts.table)  # each arm as it ends: a later arm may run out of time
                rows.append(row)
                gc.collect()
                torch.cuda.empty_cache()
                torch._dynamo.reset()
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
