"""Train from a recipe:

    python -m forge_hf.train RECIPE.yaml [--key value ...]
    accelerate launch -m forge_hf.train RECIPE.yaml [--key value ...]
    forge-hf train RECIPE.yaml [--key value ...]

Builds the model (pretrained, or randomly initialised from a config), the tokenizer, the
packed OpenMathInstruct-2 blocks and ForgeTrainer; trains with the Trainer's progress bar,
logs and checkpoints; saves the final model and tokenizer in output_dir; prints a summary
(also written to output_dir/forge_summary.json). Overrides: see forge_hf.recipe.
"""

import json
import os
import resource
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator, set_seed

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
        raise RecipeError(f"{recipe.path}: block_size={block_size} exceeds the model's max_position_embeddings={n_positions}: "
                          "lower block_size")
    n_embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > n_embeddings:
        raise RecipeError(f"{recipe.path}: the tokenizer has {len(tokenizer)} tokens but the model embeds only {n_embeddings}: "
                          "use the model's own tokenizer (tokenizer_name_or_path)")


def peak_memory() -> dict:
    peak = {"host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux
    if torch.cuda.is_available():
        peak["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        peak["cuda_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return peak


def summarize(recipe: Recipe, trainer, train_seconds: float, wall_seconds: float) -> dict:
    args = recipe.training
    steps = trainer.state.global_step
    # every block is full (data.pack), so tokens are exact
    tokens = steps * args.per_device_train_batch_size * recipe.data.block_size * args.world_size
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    return {
        "recipe": str(recipe.path), "output_dir": args.output_dir, "steps": steps, "tokens": tokens,
        "processes": args.world_size, "train_seconds": train_seconds, "wall_seconds": wall_seconds,
        "tokens_per_second": tokens / train_seconds if train_seconds else None,
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "last_eval_loss": evals[-1] if evals else None, **peak_memory(),
    }


def print_summary(summary: dict) -> None:
    memory = ", ".join(f"{k.removesuffix('_gib')} {v:.2f} GiB" for k, v in summary.items() if k.endswith("_gib"))
    lines = [
        f"steps       {summary['steps']}",
        f"tokens      {summary['tokens']:,} ({summary['tokens_per_second'] or 0:,.0f} tokens/s)",
        f"time        train {summary['train_seconds']:.1f} s, total {summary['wall_seconds']:.1f} s",
        f"loss        first {summary['first_loss']}, last {summary['last_loss']}, "
        f"eval {summary['last_eval_loss']}",
        f"memory      {memory}",
        f"saved       {summary['output_dir']}",
    ]
    print("\nforge_hf.train summary (" + summary["recipe"] + ")\n  " + "\n  ".join(lines), flush=True)


def run(recipe: Recipe) -> dict:
    from .trainer import ForgeTrainer

    started = time.perf_counter()
    args = recipe.training
    tokenizer = build_tokenizer(recipe.model)
    model = build_model(recipe.model, args.seed)
    check_fits(model, tokenizer, recipe)
    data_seed = args.data_seed if args.data_seed is not None else args.seed
    train_blocks, eval_blocks = build_datasets(recipe.data, tokenizer, data_seed)
    trainer = ForgeTrainer(model=model, args=args, train_dataset=train_blocks, eval_dataset=eval_blocks,
                           processing_class=tokenizer, data_collator=default_data_collator)
    train_started = time.perf_counter()
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    train_seconds = time.perf_counter() - train_started
    trainer.save_model()  # model + tokenizer, loadable with from_pretrained
    trainer.save_state()  # trainer_state.json: the log history
    summary = summarize(recipe, trainer, train_seconds, time.perf_counter() - started)
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
