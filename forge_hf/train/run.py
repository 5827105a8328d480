"""Train from a recipe:

    python -m forge_hf.train RECIPE.yaml [--key value ...]
    accelerate launch -m forge_hf.train RECIPE.yaml [--key value ...]
    forge-hf train RECIPE.yaml [--key value ...]

Builds the model (pretrained, or randomly initialised from a config), the tokenizer, the
packed OpenMathInstruct-2 blocks and ForgeTrainer; trains with the Trainer's progress bar,
logs and checkpoints; saves the final model and tokenizer in output_dir; prints a summary
(also written to output_dir/forge_summary.json).

Command-line overrides follow the recipe path as ``--key value`` (any recipe key, listed
below) and win over the file, e.g. ``--learning_rate 1e-5 --max_steps 100``.
"""

import json
import os
import resource
import sys
import time

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    TrainerCallback,
    default_data_collator,
    set_seed,
)

from ..integrations.trainer import ForgeTrainer
from .arguments import ModelArguments
from .data import build_datasets
from .recipe import Recipe, RecipeError, load_recipe, recipe_parser


def build_model(args: ModelArguments, seed: int):
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    options = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
    if args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(args.model_name_or_path, revision=args.model_revision,
                                                    dtype=dtype, **options)
    config = AutoConfig.from_pretrained(args.model_config, revision=args.model_revision)
    set_seed(seed)  # the random initialisation is part of the run's reproducibility
    return AutoModelForCausalLM.from_config(config, dtype=None if dtype == "auto" else dtype, **options)


def build_tokenizer(args: ModelArguments):
    name = args.tokenizer_name_or_path or args.model_name_or_path or args.model_config
    revision = args.model_revision if name in (args.model_name_or_path, args.model_config) else "main"
    return AutoTokenizer.from_pretrained(name, revision=revision)


def check_fits(model, tokenizer, recipe: Recipe) -> None:
    """Mismatches that would otherwise surface as an index error deep in a forward."""
    block_size = recipe.data.block_size
    n_positions = getattr(model.config, "max_position_embeddings", None)
    if n_positions is not None and block_size > n_positions:
        raise RecipeError(f"{recipe.path}: block_size={block_size} exceeds the model's "
                          f"max_position_embeddings={n_positions}: lower block_size")
    n_embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > n_embeddings:
        raise RecipeError(f"{recipe.path}: the tokenizer has {len(tokenizer)} tokens but the model embeds only "
                          f"{n_embeddings}: use the model's own tokenizer (tokenizer_name_or_path)")


def peak_memory() -> dict:
    peak = {"host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    if torch.cuda.is_available():
        peak["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        peak["cuda_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return peak


class RunClock(TrainerCallback):
    """Where this run starts (not step 0 when resuming) and when its first step ends: the
    throughput after it leaves out one-off costs such as kernel compilation."""

    start_step, first_step_end, train_end = 0, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        if self.first_step_end is None:
            self.first_step_end = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        self.train_end = time.perf_counter()


def summarize(recipe: Recipe, trainer, clock: RunClock, train_seconds: float, wall_seconds: float) -> dict:
    args = recipe.training
    steps = trainer.state.global_step
    # every block is full (data.pack), so tokens are exact
    tokens_per_step = args.per_device_train_batch_size * recipe.data.block_size * args.world_size
    run_steps = steps - clock.start_step
    later = (run_steps - 1) * tokens_per_step / (clock.train_end - clock.first_step_end) if run_steps > 1 else None
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    return {
        "recipe": str(recipe.path), "output_dir": args.output_dir, "processes": args.world_size,
        "steps": steps, "tokens": steps * tokens_per_step, "train_seconds": train_seconds, "wall_seconds": wall_seconds,
        "tokens_per_second": run_steps * tokens_per_step / train_seconds,
        "tokens_per_second_after_first_step": later,
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "last_eval_loss": evals[-1] if evals else None, **peak_memory(),
    }


def _fmt(loss) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def print_summary(summary: dict) -> None:
    memory = ", ".join(f"{k.removesuffix('_gib')} {v:.2f} GiB" for k, v in summary.items() if k.endswith("_gib"))
    lines = [
        f"steps       {summary['steps']}",
        f"tokens      {summary['tokens']:,} ({summary['tokens_per_second']:,.0f} tokens/s; "
        f"{summary['tokens_per_second_after_first_step'] or 0:,.0f} after the first step)",
        f"time        train {summary['train_seconds']:.1f} s, total {summary['wall_seconds']:.1f} s",
        f"loss        first {_fmt(summary['first_loss'])}, last {_fmt(summary['last_loss'])}, "
        f"eval {_fmt(summary['last_eval_loss'])}",
        f"memory      {memory}",
        f"saved       {summary['output_dir']}",
    ]
    print("\nforge_hf.train summary (" + summary["recipe"] + ")\n  " + "\n  ".join(lines), flush=True)


def run(recipe: Recipe) -> dict:
    started = time.perf_counter()
    args = recipe.training
    tokenizer = build_tokenizer(recipe.model)
    model = build_model(recipe.model, args.seed)
    check_fits(model, tokenizer, recipe)
    data_seed = args.data_seed if args.data_seed is not None else args.seed
    train_blocks, eval_blocks = build_datasets(recipe.data, tokenizer, data_seed)
    clock = RunClock()
    trainer = ForgeTrainer(model=model, args=args, train_dataset=train_blocks, eval_dataset=eval_blocks,
                           processing_class=tokenizer, data_collator=default_data_collator, callbacks=[clock])
    train_started = time.perf_counter()
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    train_seconds = time.perf_counter() - train_started
    trainer.save_model()  # model + tokenizer, loadable with from_pretrained
    trainer.save_state()  # trainer_state.json: the log history
    summary = summarize(recipe, trainer, clock, train_seconds, time.perf_counter() - started)
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "forge_summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print_summary(summary)
    return summary


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        recipe_parser().print_help()
        return 0
    try:
        run(load_recipe(argv[0], argv[1:]))
    except RecipeError as e:
        print(f"forge_hf.train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
