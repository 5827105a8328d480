"""ForgeTrainer and ForgeTrainerMixin: the Hugging Face Trainer with forge's fused step.

Importing this module registers the ``optim="forge_<rule>"`` names (training_args.py), so
``TrainingArguments(optim="forge_adamw")`` validates; a plain ``Trainer`` given such a name
stops when it creates its optimizer and points here (it would clip and log only the
non-fused gradients: silent wrong training).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import warnings

import torch
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ..core.config import ForgeConfig
from ..nn.swiglu import recompute_swiglu
from ..optim.distributed import enable_data_parallel
from ..optim.fsdp import load_sharded_optimizer, save_sharded_optimizer
from ..optim.optimizer import ForgeOptimizer, fused_layers
from ..optim.patch import ADAPTER, BELOW_MIN_PARAMS, FLOAT16, FLOAT16_FIX, PatchReport, patch_model
from .batch_shapes import PaddingMaskCheck, causal_reason, take_mark, without_mask, without_varlen_keys
from .captured_loss import captured_loss, loss_owner
from .checkpoints import FORGE_SHARDED_OPTIMIZER, check_checkpoint, latest_checkpoint
from .cuda_graph import TrainerGraph, micro_batches, skip_packing_check
from .lean_loss import (
    check_lean_loss,
    is_causal_lm,
    keep_logits_in_model_dtype,
    lean_causal_lm_loss,
    lean_loss_conflict,
)
from .step_order import StepOrder
from .training_args import PREFIX, config_from_training_args, merged_config, register_optimizer_names, rule_name

logger = logging.get_logger(__name__)

DEFAULT_MAX_GRAD_NORM = 1.0  # TrainingArguments' own: a user who never set it is told what clipping costs

register_optimizer_names()  # TrainingArguments(optim="forge_<rule>") validates from here on


# ------------------------------------------------------------------ guards


# accelerate's distributed types under which forge_hf.distributed keeps the step exact
_DATA_PARALLEL_TYPES = {"NO", "MULTI_GPU", "MULTI_CPU", "DistributedType.NO", "DistributedType.MULTI_GPU",
                        "DistributedType.MULTI_CPU"}


def is_fsdp2(accelerator) -> bool:
    """Whether accelerate runs the model under FSDP2 (``fsdp_version: 2``), whose row shards
    forge steps (optim/fsdp.py)."""
    return accelerator is not None and getattr(accelerator, "is_fsdp2", False) is True


def _offloads_parameters(accelerator) -> bool:
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    return isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy)


def _asks_fsdp1(args, accelerator) -> bool:
    """FSDP other than FSDP2: accelerate's FSDP1, or TrainingArguments.fsdp of another (or
    no stated) version. TrainingArguments.fsdp with version 2 on a run that accelerate does
    not shard (on CPUs accelerate 1.15 falls back to DDP) is plain data parallelism."""
    if accelerator is not None and accelerator.distributed_type == "FSDP":
        return not is_fsdp2(accelerator)
    return bool(args.fsdp) and (getattr(args, "fsdp_plugin_args", None) or {}).get("fsdp_version") != 2


def check_training_arguments(args, accelerator=None) -> None:
    """Refuse, naming the value and the fix, what a fused step cannot do correctly."""
    if args.fp16:
        raise ValueError(
            "fp16=True is not supported with forge optimizers: its GradScaler scales the gradients the "
            "fused step consumes in backward, before any unscaling or skipping: use bf16=True instead"
        )
    if getattr(args, "torch_compile", False) and getattr(args, "use_liger_kernel", False):
        # Measured on the GPU: compiled with Liger's kernels, a Qwen3 model's q_norm weights moved by
        # their whole norm in 8 steps (0.5% eagerly), with and without forge's CUDA graph
        raise ValueError(
            "torch_compile=True with use_liger_kernel=True is not supported with forge optimizers: "
            "compiled together, Liger's kernels train the model wrongly (Qwen3's attention norms collapse). "
            "Use one of them: torch_compile=True alone (the compiler fuses the norms, rotary and SwiGLU "
            "itself), or use_liger_kernel=True without torch_compile"
        )
    if args.deepspeed or (accelerator is not None and accelerator.distributed_type == "DEEPSPEED"):
        raise ValueError(
            "DeepSpeed is not supported with forge optimizers (it owns the optimizer step): remove the "
            "deepspeed config and train in one process"
        )
    if _asks_fsdp1(args, accelerator):
        raise ValueError(
            "FSDP is not supported with forge optimizers through the Trainer in version 1 (FSDP1 shards and "
            "reduces flattened gradients the fused step never forms): use FSDP2 (fsdp_config={'version': 2}, "
            "or fsdp_version: 2 in the accelerate config), which ForgeTrainer runs, or launch plain data "
            "parallelism (DDP), which forge runs exactly, or run forge inside FSDP2 in your own training loop "
            "(patch_model, then torch's fully_shard, then ForgeOptimizer: see forge_hf.optim.fsdp)"
        )
    if is_fsdp2(accelerator) and _offloads_parameters(accelerator):
        raise ValueError(
            "FSDP2 with its parameters offloaded to the CPU (fsdp_config cpu_offload, or fsdp_offload_params in "
            "the accelerate config) is not supported with forge optimizers: the fused step updates each shard "
            "inside backward on the weight's device: train without the offload"
        )
    if accelerator is not None and str(accelerator.distributed_type) not in _DATA_PARALLEL_TYPES \
            and not is_fsdp2(accelerator):
        raise ValueError(
            f"distributed_type={accelerator.distributed_type} is not supported with forge optimizers: "
            "launch plain data parallelism (accelerate launch --multi_gpu, or torchrun) or FSDP2"
        )
    if args.n_gpu > 1:
        raise ValueError(
            f"n_gpu={args.n_gpu} (torch DataParallel) is not supported with forge optimizers: "
            "make one GPU visible, e.g. CUDA_VISIBLE_DEVICES=0"
        )
    if args.auto_find_batch_size:
        raise ValueError(
            "auto_find_batch_size=True is not supported with forge optimizers: an out-of-memory error in "
            "the middle of a backward leaves some layers already stepped: set per_device_train_batch_size"
        )


def unwrap_forge_optimizer(optimizer) -> ForgeOptimizer | None:
    """The ForgeOptimizer inside accelerate's (or any) optimizer wrapper."""
    while optimizer is not None and not isinstance(optimizer, ForgeOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


# ----------------------------------------------------------------- trainer


class ForgeTrainerMixin:
    """ForgeTrainer's behaviour, for any Trainer subclass:
    ``class MySFTTrainer(ForgeTrainerMixin, trl.SFTTrainer)``.

    Patches the model when the optimizer is created (after Liger), creates a
    ForgeOptimizer, logs ``grad_norm`` (from the kernels' squared sums plus the ordinary
    gradients), ``forge_nonfinite_tiles`` and ``forge_fallback_layers`` (fused layers on
    the ordinary optimizer in their last step or for good: each is also logged once per
    reason, and listed in ``forge_report.fell_back`` while it lasts). ``max_grad_norm`` and
    ``gradient_accumulation_steps`` are the ForgeOptimizer's (exact: the fused layers hold
    their gradient until the step, nn/held_gradient.py), under DDP and FSDP2 too. Under
    TRL's trainers the output head stays on the ordinary path (optim/patch.py's TRL_LM_HEAD).

    Several processes: forge's data parallelism (optim/distributed.py) under DDP, or, under
    accelerate's FSDP2, the fused layers step their FSDP2 row shards (optim/fsdp.py) and
    checkpoints carry forge's optimizer states, whole or sharded by the plugin's state_dict_type.
    FSDP1 and DeepSpeed are refused.

    Resuming: ``train(resume_from_checkpoint=True)`` takes the newest checkpoint whose save
    finished, logging each unfinished one it skips; a checkpoint with a missing or damaged
    file is refused before anything loads (checkpoints.py's CheckpointError names the file).

    ``lean_loss`` (auto: on for a causal LM where nothing conflicts) computes the training and
    eval loss by forge's chunked cross-entropy (lean_causal_lm_loss), set as the Trainer's
    compute_loss_func; ``recompute_swiglu`` (auto: every SwiGLU MLP with a fused down_proj)
    forms the MLPs' products again in backward.

    Args:
        *args, **kwargs: the Trainer's (model, args, datasets, ...). ``args.optim`` is
            ``"forge_<rule>"``; its hyperparameters come from the usual TrainingArguments
            fields (learning_rate, weight_decay, adam_beta1/2, adam_epsilon), forge's
            options and the rule's other hyperparameters from ``args.optim_args``
            (``"state_precision=bf16,cuda_graph=auto"``: the README's options table).
        forge_config: forge's options as a ForgeConfig, beside those of ``args`` (an option
            the two set differently is refused); its optimizer must be ``args.optim``'s. The
            hyperparameters it leaves unset come from ``args`` (learning_rate, ...), and the
            seed always does.
    """

    def __init__(self, *args, forge_config: ForgeConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.optimizer is not None and unwrap_forge_optimizer(self.optimizer) is None:
            raise ValueError(
                f"{type(self).__name__} was given a {type(self.optimizer).__name__}: pass a "
                "forge_hf.ForgeOptimizer, or no optimizer and optim='forge_<rule>'"
            )
        # A ForgeOptimizer the caller made needs no forge optim name; otherwise it is required.
        self.forge_config = None
        if forge_config is not None:
            self.forge_config = merged_config(self.args, forge_config)
        elif self.optimizer is None or rule_name(self.args.optim) is not None:
            self.forge_config = config_from_training_args(self.args)
        self.forge_report = None
        check_training_arguments(self.args, self.accelerator)
        self.forge_lean_loss = self._forge_takes_lean_loss()
        if self.forge_lean_loss:
            # Trainer's own hook, rather than a compute_loss override: Trainer.compute_loss then
            # takes the labels out of the model's inputs (the model builds only the logits),
            # passes num_items_in_batch and scales for average_tokens_across_devices exactly as it
            # does for the model's loss, returns the outputs for prediction_step, and runs inside
            # the CUDA-graph capture (cuda_graph.py calls compute_loss); a subclass's own
            # compute_loss (TRL's) calls the hook too, where an override would bypass it.
            self.compute_loss_func = lean_causal_lm_loss
        graph_mode = self.forge_config.cuda_graph if self.forge_config else "auto"
        if self.forge_fsdp2 and self.optimizer is not None:
            # its states and shard layouts are keyed by the unsharded parameters, which FSDP2 replaces
            raise ValueError(
                f"{type(self).__name__} under FSDP2 builds its ForgeOptimizer itself, on the parameters FSDP2 "
                "shards: pass no optimizer, with optim='forge_<rule>' and its settings in optim_args (or "
                "shard the model with fully_shard first and build the ForgeOptimizer on it in your own loop: "
                "see forge_hf.optim.fsdp)"
            )
        if self.forge_fsdp2:
            # a graphed step broadcasts rank 0's parameters and averages gradients itself: under
            # FSDP2 those are shards, and FSDP2's hooks and collectives are not captured
            if graph_mode == "true":
                raise ValueError("optim_args cuda_graph=true is not supported under FSDP2 (its all-gathers and "
                                 "reduce-scatters run outside a captured step): use cuda_graph=auto or false")
            graph_mode = "false"
        buckets = dict(graph_bucket=self.forge_config.graph_bucket, max_graphs=self.forge_config.max_graphs) \
            if self.forge_config else {}
        self.forge_graph = TrainerGraph(graph_mode, **buckets)
        self.callback_handler.callbacks.insert(0, StepOrder(self))  # first: before the callbacks it orders
        # Clipping is the ForgeOptimizer's (max_grad_norm): the Trainer's own would see only the
        # ordinary gradients.
        self.forge_max_grad_norm = float(self.args.max_grad_norm or 0.0)
        if self.forge_max_grad_norm == DEFAULT_MAX_GRAD_NORM:
            warnings.warn(
                f"forge: gradients are clipped at max_grad_norm={DEFAULT_MAX_GRAD_NORM} (the Trainer's default): each "
                "fused layer then holds its input and output gradient until the optimizer step (their rows stay "
                "through the backward) and forms its weight gradient once more for the norm. Set max_grad_norm=0 "
                "for forge's step inside backward (this note shows whenever max_grad_norm is that default value).",
                UserWarning, stacklevel=2)
        if self.args.max_grad_norm:
            self.args = copy.copy(self.args)  # the caller's arguments stay as they were
            self.args.max_grad_norm = 0.0
        given, micro = self.forge_optimizer, self.args.gradient_accumulation_steps
        if given is not None:
            spelled = given.accumulate  # as built, before the check takes the Trainer's count into accumulate=True
            if given.agree_accumulation(micro, "gradient_accumulation_steps") is not None \
                    or given.max_grad_norm != self.forge_max_grad_norm:
                raise ValueError(
                    f"the ForgeOptimizer given has accumulate={spelled}, max_grad_norm={given.max_grad_norm}, but "
                    f"the arguments ask for gradient_accumulation_steps={micro}, max_grad_norm="
                    f"{self.forge_max_grad_norm}: build it with ForgeOptimizer(..., accumulate="
                    f"{micro > 1}, max_grad_norm={self.forge_max_grad_norm})")

    def _forge_takes_lean_loss(self) -> bool:
        """lean_loss: true (refused where it cannot train), auto (a causal LM, where nothing
        conflicts) or false."""
        mode = self.forge_config.lean_loss if self.forge_config is not None else "false"
        if mode == "true":
            check_lean_loss(self.args, self.compute_loss_func, self.accelerator)
            return True
        # auto leaves a trainer with a loss of its own (TRL's compute_loss: its fused LM head,
        # its metrics from the logits) as it is; true hands the lean loss to it too
        own_loss = type(self).compute_loss is not Trainer.compute_loss
        return (mode == "auto" and not own_loss and is_causal_lm(self.model)
                and lean_loss_conflict(self.args, self.compute_loss_func, self.accelerator) is None)

    @property
    def forge_optimizer(self) -> ForgeOptimizer | None:
        return unwrap_forge_optimizer(self.optimizer)

    @property
    def forge_fsdp2(self) -> bool:
        """Whether accelerate shards the model with FSDP2 (fused layers then step their row shards)."""
        return is_fsdp2(getattr(self, "accelerator", None))

    def create_optimizer(self, model=None):
        model = self.model if model is None else model
        if self.optimizer is None:
            config = self.forge_config
            if not fused_layers(model):  # a model the user patched keeps their choices
                # the layers take the options; the hyperparameters reach the ForgeOptimizer once, as
                # its arguments (_new_forge_optimizer), whoever patched the model
                self.forge_report = patch_model(model, config.replace(hyperparameters={}))
                if not self.forge_report.fused:
                    raise ValueError(nothing_fused_message(f"{PREFIX}{config.optimizer}", model, self.forge_report))
                if config.recompute_swiglu != "false":
                    recompute_swiglu(model, required=config.recompute_swiglu == "true")
            self.optimizer = self._new_forge_optimizer(model)
            if (accumulating := self.args.gradient_accumulation_steps) > 1 and not self.args.torch_compile \
                    and not self.args.use_liger_kernel:
                # every micro-batch forms its weight gradient, as the Trainer's does: what is left to
                # win is in the model's own ops (docs/performance.md, Qwen3-1.7B: 0.73x eager)
                logger.warning(f"forge: gradient_accumulation_steps={accumulating} with the model's ops eager: each "
                               "micro-batch forms its weight gradient, so the model's own ops set the step's pace; "
                               "set torch_compile=True or use_liger_kernel=True to speed them up")
        if self.forge_fsdp2:
            # accelerate's prepare shards the model after this and puts the sharded parameters in
            # this optimizer: create_scheduler, which the Trainer calls next, builds it again on them
            return self.optimizer
        fused = fused_layers(model).values()
        if self.forge_tensor_parallel_only():
            return self.optimizer  # every rank a piece of each layer and the same batches: no data parallelism
        if self.args.world_size > 1 and not any(m.forge_dp for m in fused):
            # before accelerate wraps the model in DDP; a ForgeOptimizer the caller made needs it too
            enable_data_parallel(model, mode=self.forge_config.data_parallel if self.forge_config else "sharded")
        return self.optimizer

    def forge_tensor_parallel_only(self) -> bool:
        """Whether the ranks are one tensor-parallel group (accelerate's ParallelismConfig(tp_size=world),
        a model loaded with tp_plan): the fused layers step their pieces (optim/tensor_parallel.py).
        TP with data-parallel replicas (dp_replicate_size > 1) is refused: forge's data parallelism
        gathers tokens over the whole world, not over one piece's replicas."""
        tp = self.get_tp_size() if hasattr(self, "get_tp_size") else 1
        if tp <= 1:
            return False
        replicas = self.args.world_size // tp
        if replicas > 1:
            raise ValueError(
                f"tp_size={tp} with {replicas} data-parallel replicas (world size {self.args.world_size}) is not "
                "supported with forge optimizers outside FSDP2: give the other ranks to FSDP2 "
                f"(ParallelismConfig(tp_size={tp}, dp_shard_size={replicas})), or set tp_size to the world size")
        return True

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if optimizer is None:
            self.forge_follow_fsdp2_prepare()
        return super().create_scheduler(num_training_steps, optimizer)

    def _new_forge_optimizer(self, model) -> ForgeOptimizer:
        config = self.forge_config
        decay = self.get_decay_parameter_names(model)  # Trainer's grouping, overrides included
        return ForgeOptimizer(model, decay_parameter_names=decay, stop_on_nonfinite=config.stop_on_nonfinite,
                              accumulate=self.args.gradient_accumulation_steps,
                              max_grad_norm=self.forge_max_grad_norm, **config.hyperparameters)

    def forge_follow_fsdp2_prepare(self) -> None:
        """After accelerate's FSDP2 prepare: build the ForgeOptimizer again over the sharded model.

        The Trainer hands accelerate the model with the optimizer create_optimizer made;
        accelerate calls fully_shard on the model (new, DTensor, Parameter objects) and swaps
        them into the optimizer's param_groups (fsdp2_switch_optimizer_parameters). A
        ForgeOptimizer keys its states, fused layers and shard layouts by parameter, so it
        is built again on the sharded parameters, which also gives every fused layer its
        FSDP2 context (optim/fsdp.enable_fsdp). Nothing has stepped yet: no state is lost;
        the fused layers keep their ForgeState objects."""
        optimizer = self.forge_optimizer
        if not self.forge_fsdp2 or optimizer is None:
            return
        if all(p in optimizer.state for p in optimizer.params()):
            return  # built on the model's present parameters already
        if any(state.allocated for state in optimizer.state.values()):
            raise RuntimeError("the model was sharded by FSDP2 after the ForgeOptimizer had stepped: prepare "
                               "the model and optimizer before training")
        model = self.model
        rebuilt = self._new_forge_optimizer(model)
        if not any(m.forge_dp is not None and m.forge_dp.mode == "fsdp" for m in fused_layers(model).values()):
            raise RuntimeError(f"accelerate prepared {type(model).__name__} for FSDP2 but its fused weights are "
                               "not FSDP2 shards")
        holder = self.optimizer  # accelerate's AcceleratedOptimizer: it keeps wrapping the new one
        if holder is optimizer:
            self.optimizer = rebuilt
            return
        while holder.optimizer is not optimizer:
            holder = holder.optimizer
        holder.optimizer = rebuilt

    # ------------------------------------------------------------- checkpoints under FSDP2
    # The model's shards go through accelerate (save_fsdp_model / load_fsdp_model), as for any
    # optimizer. The optimizer's do not: torch's get/set_optimizer_state_dict, which accelerate
    # uses, keys states by parameter name and reads plain per-parameter dicts, and would drop
    # forge's states on load. So forge saves them itself, by the plugin's state_dict_type:
    # FULL_STATE_DICT: ForgeOptimizer.state_dict() (whole states, the one-process format),
    # written by rank 0 as optimizer.pt; SHARDED_STATE_DICT: each rank's rows through DCP
    # (optim/fsdp.save_sharded_optimizer), in FORGE_SHARDED_OPTIMIZER/.

    FORGE_SHARDED_OPTIMIZER = FORGE_SHARDED_OPTIMIZER

    def _forge_sharded_checkpoint(self) -> bool:
        return "SHARDED_STATE_DICT" in str(self.accelerator.state.fsdp_plugin.state_dict_type)

    # ------------------------------------------------------------- checkpoints: finished or not
    # The Trainer writes a checkpoint's trainer_state.json last (rank 0), which makes it the mark
    # of a finished save (checkpoints.py): ForgeTrainer removes a stale one before writing the
    # checkpoint again, and waits for every process's files before rank 0 writes it.

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's train(); ``resume_from_checkpoint=True`` takes the newest checkpoint
        whose save finished (logging each one skipped), and a checkpoint with a missing or
        damaged file is refused, naming it (checkpoints.CheckpointError), before anything loads."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = latest_checkpoint(self.args.output_dir) or True  # none: the Trainer's error
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = check_checkpoint(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        self.forge_graph.join()  # the weights and states the last replay wrote
        if self.args.should_save:
            checkpoint = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with contextlib.suppress(FileNotFoundError):  # a save cut short must not look finished by an old one
                os.remove(os.path.join(checkpoint, TRAINER_STATE_NAME))
        return super()._save_checkpoint(model, trial)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)  # each process's own file, the last before trainer_state.json
        if self.args.world_size > 1:
            self.accelerator.wait_for_everyone()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        self.forge_graph.join()
        return super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.forge_fsdp2:
            return super()._save_optimizer_and_scheduler(output_dir)
        from accelerate.utils import save_fsdp_model
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, get_fsdp_ckpt_kwargs, reissue_pt_warnings

        save_fsdp_model(self.accelerator.state.fsdp_plugin, self.accelerator, self.model, output_dir,
                        **get_fsdp_ckpt_kwargs())
        optimizer = self.forge_optimizer
        if self._forge_sharded_checkpoint():
            save_sharded_optimizer(optimizer, os.path.join(output_dir, self.FORGE_SHARDED_OPTIMIZER))
        else:
            whole = optimizer.state_dict()  # every rank: it gathers the rows
            if self.args.should_save:
                torch.save(whole, os.path.join(output_dir, OPTIMIZER_NAME))
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self.forge_fsdp2:
            return super()._load_optimizer_and_scheduler(checkpoint)
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        sharded = os.path.join(checkpoint, self.FORGE_SHARDED_OPTIMIZER)
        whole = os.path.join(checkpoint, OPTIMIZER_NAME)
        if os.path.isdir(sharded):
            load_sharded_optimizer(self.forge_optimizer, sharded)
        elif os.path.isfile(whole):
            self.forge_optimizer.load_state_dict(torch.load(whole, map_location="cpu", weights_only=True))
        elif os.path.isfile(scheduler):
            raise FileNotFoundError(
                f"{checkpoint} has a scheduler but no forge optimizer state ({self.FORGE_SHARDED_OPTIMIZER}/ or "
                f"{OPTIMIZER_NAME}): it was not written by ForgeTrainer under FSDP2, and resuming would restart "
                "every optimizer state")
        else:
            return  # like the Trainer: a checkpoint without optimizer (save_only_model) resumes the weights only
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    # ------------------------------------------------------------- padding masks
    # The training collator checks each batch's mask on the host (batch_shapes.PaddingMaskCheck);
    # a mask that marks right padding only is dropped before the model sees it, for a decoder whose
    # attention is causal and a loss that is the Trainer's own (a subclass's compute_loss, TRL's,
    # may read the mask; a captured step of TRL's SFTTrainer computes the Trainer's: captured_loss.py).
    # The step then takes attention's unmasked path, eagerly and captured.

    def get_train_dataloader(self):
        collator = self.data_collator
        if collator is None or isinstance(collator, PaddingMaskCheck):
            return super().get_train_dataloader()
        self.data_collator = PaddingMaskCheck(collator)
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = collator

    def _forge_model_inputs(self, inputs: dict, captured: bool = False) -> dict:
        """The batch for the model: without the collator's mark, and without a mask that only
        marks right padding where the model and the loss (``captured``: the captured step's)
        allow it; a captured step's without the varlen kernels' keys its attention ignores."""
        batch, droppable = take_mark(inputs)
        if droppable and self._forge_mask_drops()[captured]:
            batch = without_mask(batch)
        return without_varlen_keys(batch, self.model) if captured else batch

    def _forge_mask_drops(self) -> tuple[bool, bool]:
        """Whether a mask that only marks right padding is dropped (eagerly, captured): decided
        once per model (a walk over its modules, the loss's owner), not at every step."""
        known = self.__dict__.get("_forge_mask_drops_for")
        if known is None or known[0] is not self.model:
            causal = self._forge_causal()
            known = self._forge_mask_drops_for = (self.model, causal and loss_owner(self) is Trainer,
                                                  causal and captured_loss(self)[1])
        return known[1], known[2]

    def _forge_causal(self) -> bool:
        return causal_reason(self.model) is None

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.forge_graph.start_window(batches)  # with accumulation: one shape for the step's micro-batches
        return batches, num_items_in_batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._forge_keep_logits()
        if self.forge_graph.off is None:
            # with accumulation the graph takes the micro-batches of its window (get_batch_samples)
            graph_inputs = self._forge_model_inputs(inputs, captured=True) \
                if micro_batches(self) == 1 else None
            loss = self.forge_graph.run(self, model, graph_inputs, num_items_in_batch)
            if loss is not None:
                return loss
        inputs = self._forge_model_inputs(inputs)
        if self.forge_graph.off is None:  # eager steps before a capture: the same model call as captured
            inputs = skip_packing_check(model, inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.forge_graph.join()
        self._forge_keep_logits()
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _forge_keep_logits(self) -> None:
        """lean_loss: the logits out of accelerate's fp32 conversion, which its prepare (for
        training or for evaluation) puts on the model before the first forward."""
        if self.forge_lean_loss:
            keep_logits_in_model_dtype(self.model)

    def _get_grad_norm(self, model, grad_norm=None):
        # The Trainer's norm of the gradients it sees, taken every step (the fused weights have
        # none): host and GPU work for nothing, as log() reports the optimizer's own norm.
        if self.forge_optimizer is not None:
            return None
        return super()._get_grad_norm(model, grad_norm)

    def floating_point_ops(self, inputs) -> int:
        # The Trainer counts the model's parameters again at every step (a walk over all its
        # modules, milliseconds on a big model): counted once here, same formula. A trainer
        # class after this mixin with a formula of its own keeps it.
        name = getattr(self.model, "main_input_name", "input_ids")
        if name not in inputs or not hasattr(self.model, "num_parameters") or \
                _defined_after(type(self), ForgeTrainerMixin, "floating_point_ops") is not Trainer:
            return super().floating_point_ops(inputs)
        counted = self.__dict__.get("_forge_flops_params")
        if counted is None or counted[0] is not self.model:
            counted = self._forge_flops_params = (self.model, self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[name].numel() * counted[1]

    def log(self, logs: dict, *args, **kwargs):
        self.forge_graph.join()
        optimizer = self.forge_optimizer
        if optimizer is not None:
            fell_back = self.forge_note_fallbacks()
            if "loss" in logs:  # a training-step log
                if optimizer.last_grad_norm is not None:
                    logs["grad_norm"] = optimizer.last_grad_norm.item()
                logs["forge_nonfinite_tiles"] = optimizer.pop_nonfinite_tiles()
                logs["forge_fallback_layers"] = fell_back
        return super().log(logs, *args, **kwargs)

    def forge_note_fallbacks(self) -> int:
        """Bring ``forge_report`` up to date with the fused layers on the ordinary optimizer,
        for good or in their last step (nn/linear.py's forge_fall_back), log each layer once
        per reason, and return how many there are."""
        reasons = {n: m.forge_fallback() for n, m in fused_layers(self.model).items()}
        fell_back = {n: reason for n, reason in reasons.items() if reason is not None}
        if self.forge_report is not None:
            self.forge_report.update_fallbacks(self.model)
        announced = self.__dict__.setdefault("_forge_announced_fallbacks", set())
        for name, reason in sorted(fell_back.items() - announced):
            summary = f"; {self.forge_report.summary()}" if self.forge_report is not None else ""
            logger.warning(f"forge: {name} fell back to the ordinary optimizer: {reason}{summary}")
            announced.add((name, reason))
        return len(fell_back)


@functools.cache
def _defined_after(cls: type, after: type, name: str) -> type | None:
    """The class after ``after`` in ``cls``'s method order whose body defines ``name``."""
    mro = cls.__mro__
    return next((c for c in mro[mro.index(after) + 1:] if name in c.__dict__), None)


def nothing_fused_message(optim: str, model, report: PatchReport) -> str:
    """ForgeTrainer's one-line error when patch_model fused nothing: the case and its fix."""
    reasons = {s.reason for s in report.skipped}
    name = type(model).__name__
    if ADAPTER in reasons:
        adapters = sum(s.reason == ADAPTER for s in report.skipped)
        return (f"optim='{optim}' has nothing to fuse in {name}: its trainable linears are {adapters} PEFT "
                "adapters, which forge leaves to the ordinary optimizer (fused, they save no peak memory and "
                "step slower): train them with an ordinary optim such as adamw_torch_fused, or add "
                "min_params=0 to optim_args to fuse them anyway")
    if FLOAT16 in reasons:
        fp16 = sum(s.reason == FLOAT16 for s in report.skipped)
        return (f"optim='{optim}' fused no module of {name}: {fp16} of its linears have float16 weights, and "
                f"{FLOAT16_FIX}")
    if BELOW_MIN_PARAMS in reasons:
        return (f"optim='{optim}' fused no module of {name}: its trainable linears are below min_params "
                "(patch_model's warning above counts them): add min_params=0 to optim_args to fuse them, "
                "or use an ordinary optim such as adamw_torch")
    return (f"optim='{optim}' fused no module of {name} (patch_model's warning above counts the reasons): "
            "widen include/exclude, or use an ordinary optim such as adamw_torch")


class ForgeTrainer(ForgeTrainerMixin, Trainer):
    """``Trainer`` for ``optim="forge_<rule>"`` (see ForgeTrainerMixin)."""
