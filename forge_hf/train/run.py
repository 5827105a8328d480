"""Train from a recipe: ``run`` builds the model (pretrained, or randomly initialised from a
config), the tokenizer, the packed OpenMathInstruct-2 blocks and ForgeTrainer; trains with
the Trainer's progress bar, logs and checkpoints; saves the final model and tokenizer in
output_dir. It prints the patch report's headline first (the table:
output_dir/forge_report.txt) and a summary last (output_dir/forge_summary.json, with the
loss curves in output_dir/loss.png): report.py. ``main`` is what ``forge-hf train`` and
``python -m forge_hf.train`` run once cli.py has their arguments: a recipe path and its
``--key value`` overrides.
"""

import contextlib
import os
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator, set_seed

from ..integrations.trainer import ForgeTrainer
from .arguments import ModelArguments
from .data import blocks_per_step, build_datasets
from .recipe import FLOAT16_FIX, Recipe, RecipeError, load_recipe
from .report import RunClock, summarize, write_patch_report, write_summary


def build_model(args: ModelArguments, seed: int):
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    options = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
    if args.tp_plan:  # pretrained weights only (ModelArguments checks)
        options["tp_plan"] = args.tp_plan
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
    """What the recipe could not know before the model loaded: its dtype under dtype: auto,
    and mismatches that would otherwise surface as an index error deep in a forward."""
    if model.dtype == torch.float16:
        raise RecipeError(f"{recipe.path}: dtype={recipe.model.dtype!r} loads float16 weights, which cannot "
                          f"train with forge optimizers: {FLOAT16_FIX}")
    block_size = recipe.data.block_size
    n_positions = getattr(model.config, "max_position_embeddings", None)
    if n_positions is not None and block_size > n_positions:
        raise RecipeError(f"{recipe.path}: block_size={block_size} exceeds the model's "
                          f"max_position_embeddings={n_positions}: lower block_size")
    n_embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > n_embeddings:
        raise RecipeError(f"{recipe.path}: the tokenizer has {len(tokenizer)} tokens but the model embeds only "
                          f"{n_embeddings}: use the model's own tokenizer (tokenizer_name_or_path)")


def run(recipe: Recipe) -> dict:
    started = time.perf_counter()
    args = recipe.training
    tokenizer = build_tokenizer(recipe.model)
    model = build_model(recipe.model, args.seed)
    check_fits(model, tokenizer, recipe)
    data_seed = args.data_seed if args.data_seed is not None else args.seed
    train_blocks, eval_blocks = build_datasets(recipe.data, tokenizer, data_seed,
                                               n_blocks=args.max_steps * blocks_per_step(args))
    clock = RunClock()
    trainer = ForgeTrainer(model=model, args=args, train_dataset=train_blocks, eval_dataset=eval_blocks,
                           processing_class=tokenizer, data_collator=default_data_collator, callbacks=[clock],
                           forge_config=recipe.config)  # the options of the recipe's forge_* keys
    try:  # patch now (train() would): the patch's refusals are the recipe's, and its report is shown first
        trainer.create_optimizer()
    except ValueError as e:
        raise RecipeError(f"{recipe.path}: {e}") from None
    if trainer.is_world_process_zero():
        print(write_patch_report(trainer.forge_report, args.output_dir), flush=True)
    if args.resume_from_checkpoint and recipe.data.streaming and not args.ignore_data_skip \
            and trainer.is_world_process_zero():
        print(f"forge_hf.train: resuming from {args.resume_from_checkpoint}: a stream keeps no position, so its "
              "blocks up to the checkpoint are read and tokenised again first", flush=True)
    train_started = time.perf_counter()
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    train_seconds = time.perf_counter() - train_started
    trainer.save_model()  # model + tokenizer, loadable with from_pretrained
    trainer.save_state()  # trainer_state.json: the log history
    summary = summarize(recipe, trainer, clock, train_seconds, time.perf_counter() - started)
    if trainer.is_world_process_zero():
        write_patch_report(trainer.forge_report, args.output_dir)  # now with any layer that fell back
        write_summary(summary, trainer.state.log_history)
    return summary


def main(argv) -> int:
    """Run the recipe ``argv[0]`` with the overrides ``argv[1:]``; 2 when it cannot run."""
    try:
        recipe = load_recipe(argv[0], argv[1:])
    except RecipeError as e:
        print(f"forge_hf.train: error: {e}", file=sys.stderr)
        return 2
    output_dir_existed = os.path.exists(recipe.training.output_dir)
    try:
        run(recipe)
    except BaseException as e:
        if not output_dir_existed:  # a run that stops before writing anything leaves no directory behind
            with contextlib.suppress(OSError):
                os.rmdir(recipe.training.output_dir)  # only when empty
        if isinstance(e, RecipeError):
            print(f"forge_hf.train: error: {e}", file=sys.stderr)
            return 2
        raise
    return 0
