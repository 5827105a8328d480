"""The recipe's own argument groups. A recipe is one flat YAML mapping over these fields and
every ``TrainingArguments`` field (forge_hf.train.recipe parses it with HfArgumentParser).

Liger, gradient checkpointing, seeds and the optimizer name are TrainingArguments fields
already (``use_liger_kernel``, ``gradient_checkpointing``, ``seed``/``data_seed``,
``optim``), so they are not repeated here."""

import string
from dataclasses import dataclass, field
from typing import Literal

from ..core.state import ROUNDINGS, STATE_PRECISIONS
from ..integrations.cuda_graph import MODES as CUDA_GRAPH_MODES
from ..kernels.dispatch import BACKENDS
from ..optim.distributed import MODES
from ..optim.patch import DEFAULT_MIN_PARAMS

OMI2_COLUMNS = ("problem", "generated_solution", "expected_answer", "problem_source")


@dataclass
class ModelArguments:
    _argument_group_name = "model"

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hub id or directory of pretrained weights to continue training."})
    model_config: str | None = field(
        default=None, metadata={"help": "Hub id, directory or config.json: train a randomly initialised "
                                        "model of this shape instead (seeded by `seed`)."})
    model_revision: str = field(default="main", metadata={"help": "Hub revision of the model and config."})
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Defaults to model_name_or_path, or model_config when that is a "
                                        "hub id or directory."})
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = field(
        default="float32", metadata={"help": "Weight dtype. bfloat16 = bf16 everywhere (the paper's "
                                             "setting); float32 + `bf16: true` = autocast mixed precision. "
                                             "float16 cannot train with forge (it needs a gradient scaler)."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "e.g. sdpa, eager, flash_attention_2; default: transformers' choice."})


@dataclass
class DataArguments:
    _argument_group_name = "data"

    dataset_source: Literal["hub", "local"] = field(
        default="hub", metadata={"help": "hub: dataset_name from the Hub; local: data_files."})
    dataset_name: str = field(default="nvidia/OpenMathInstruct-2")
    dataset_split: str = field(default="train_1M", metadata={"help": "train, train_1M, train_2M or train_5M."})
    dataset_revision: str = field(
        default="main", metadata={"help": "Pin a commit hash of the dataset repository for reproducible runs."})
    data_files: list[str] | None = field(
        default=None, metadata={"help": "Local .jsonl/.json or .parquet files (globs allowed) with "
                                        "OpenMathInstruct-2's columns."})
    streaming: bool = field(default=False, metadata={"help": "Read rows lazily (IterableDataset)."})
    text_template: str = field(
        default="{problem}\n\n{generated_solution}",
        metadata={"help": f"str.format template over the columns {list(OMI2_COLUMNS)}; EOS is appended "
                          "after each row. Write literal braces as {{ }}."})
    block_size: int = field(default=512, metadata={"help": "Tokens per packed training sequence."})
    eval_rows: int = field(
        default=0, metadata={"help": "The first N source rows are held out (before shuffling) for evaluation."})
    shuffle: bool = field(default=True, metadata={"help": "Shuffle training rows, seeded by data_seed or seed."})
    shuffle_buffer_size: int = field(
        default=10_000, metadata={"help": "Streaming only: rows in the shuffle buffer."})

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size}: a block needs at least 2 tokens")
        if self.eval_rows < 0:
            raise ValueError(f"eval_rows={self.eval_rows}: use 0 (no held-out slice) or a positive count")
        if self.shuffle_buffer_size < 1:
            raise ValueError(f"shuffle_buffer_size={self.shuffle_buffer_size}: must be at least 1")
        if isinstance(self.data_files, str):
            self.data_files = [self.data_files]
        names = {name for _, name, _, _ in string.Formatter().parse(self.text_template) if name is not None}
        unknown = sorted(names - set(OMI2_COLUMNS))
        if unknown:
            raise ValueError(f"text_template uses {unknown}, which are not columns: use "
                             f"{{}}-placeholders from {list(OMI2_COLUMNS)}")


@dataclass
class ForgeArguments:
    """ForgeTrainer's options (integrations/trainer.py: OPTION_TYPES), merged into
    TrainingArguments.optim_args. Defaults (None) leave patch_model's and ForgeTrainer's own."""

    _argument_group_name = "forge"

    forge_state_precision: Literal[STATE_PRECISIONS] | None = field(  # type: ignore[valid-type]
        default=None, metadata={"help": "Optimizer-state storage of the fused layers: fp32, bf16, or 8-bit "
                                        "int8 / al8 (codes with per-block scales); unset: fp32."})
    forge_rounding: Literal[ROUNDINGS] | None = field(  # type: ignore[valid-type]
        default=None, metadata={"help": "How bf16 weights and states are rounded when stored: stochastic "
                                        "or nearest; unset: stochastic."})
    forge_backend: Literal[BACKENDS] | None = field(  # type: ignore[valid-type]
        default=None, metadata={"help": "What runs the fused step: triton (GPU kernels; needs a CUDA GPU), "
                                        "reference (PyTorch, runs anywhere) or auto (triton where it can "
                                        "run, else reference); unset: auto."})
    forge_include: list[str] | None = field(
        default=None, metadata={"help": "Fuse only modules matching these names or patterns."})
    forge_exclude: list[str] | None = field(
        default=None, metadata={"help": "Never fuse modules matching these names or patterns."})
    forge_min_params: int | None = field(
        default=None, metadata={"help": "Weights with fewer entries stay on the ordinary optimizer; 0 fuses "
                                        f"every eligible linear; unset: {DEFAULT_MIN_PARAMS:,}."})
    forge_stop_on_nonfinite: bool | None = field(
        default=None, metadata={"help": "Stop training when a tile's gradient is not finite; unset: false."})
    forge_data_parallel: Literal[MODES] | None = field(  # type: ignore[valid-type]
        default=None, metadata={"help": "Several processes: sharded (each rank keeps the states of its "
                                        "weight rows) or replicated; unset: sharded."})
    forge_recompute_swiglu: bool | None = field(
        default=None, metadata={"help": "SwiGLU MLPs keep gate and up only and form their product again "
                                        "in backward (forge_hf.recompute_swiglu): less activation memory; "
                                        "unset: false."})
    forge_cuda_graph: Literal[CUDA_GRAPH_MODES] | None = field(  # type: ignore[valid-type]
        default=None, metadata={"help": "Capture each training step as a CUDA graph and replay it (less host "
                                        "overhead): auto (where the step can be captured), true (refuse to "
                                        "train otherwise) or false; unset: auto."})
    forge_lean_loss: bool | None = field(
        default=None, metadata={"help": "Compute the loss by forge's chunked cross-entropy: Hugging "
                                        "Face's causal-LM loss without its fp32 copy of the logits and their "
                                        "gradient (less memory at large vocabularies); not with Liger's fused "
                                        "linear cross-entropy (use_liger_kernel); unset: false."})

    def options(self) -> dict:
        """The set options, under patch_model's names (state_precision, rounding, ...)."""
        return {name.removeprefix("forge_"): value for name, value in vars(self).items() if value is not None}
