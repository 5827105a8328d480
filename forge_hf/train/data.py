"""OpenMathInstruct-2 rows -> continued-pretraining text -> tokens -> fixed-length blocks.

Rows from the Hub or local .jsonl/.parquet files, streamed or not; a held-out slice taken
before the seeded shuffle; each row's ``text_template`` tokenised with EOS appended; rows
packed into ``block_size`` blocks (only a pass's trailing partial block dropped).

The training blocks are the run's: pass after pass over the training rows, each pass packed
alike and in the same order, cut at ``max_steps`` optimizer steps of full micro-batches. The
Trainer sees them as one epoch, which it fast-forwards exactly at resume whatever the pass:
rows not streamed give a map-style ``Dataset`` (one pass packed, indexed over the run), whose
sampler skips without reading; streamed rows give an endless ``IterableDataset``, which the
Trainer reads again up to the checkpoint's block (a stream keeps no position). The steps in
detail: docs/architecture.md, "Recipe data".
"""

from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from datasets import Dataset, Features, IterableDataset, Sequence, Value, load_dataset
from datasets.fingerprint import Hasher
from datasets.io.generator import GeneratorDatasetInputStream

from .arguments import DataArguments

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
BLOCK_FEATURES = Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32"))})
TOKENIZE_BATCH = 256


def blocks_per_step(args) -> int:
    """The blocks one optimizer step trains (TrainingArguments ``args``): every micro-batch of
    gradient accumulation, on every process."""
    return args.train_batch_size * args.gradient_accumulation_steps * args.world_size


def load_rows(args: DataArguments) -> Dataset | IterableDataset:
    if args.dataset_source == "hub":
        return load_dataset(args.dataset_name, split=args.dataset_split, revision=args.dataset_revision,
                            streaming=args.streaming)
    builder = LOCAL_FORMATS[Path(args.data_files[0]).suffix]
    return load_dataset(builder, data_files=list(args.data_files), split="train", streaming=args.streaming)


def split_eval(rows, n: int):
    """(training rows, the first n rows or None)."""
    if n == 0:
        return rows, None
    if isinstance(rows, IterableDataset):
        return rows.skip(n), rows.take(n)
    if n >= len(rows):
        raise ValueError(f"eval_rows={n} leaves no training rows (the data has {len(rows)}): lower eval_rows")
    return rows.select(range(n, len(rows))), rows.select(range(n))


def shuffle_rows(rows, seed: int, buffer_size: int):
    if isinstance(rows, IterableDataset):
        return rows.shuffle(seed=seed, buffer_size=buffer_size)
    return rows.shuffle(seed=seed)


def row_tokens(rows, tokenizer, template: str) -> Iterator[list[int]]:
    """Each row's token ids, EOS-terminated, in row order."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"the tokenizer {tokenizer.name_or_path!r} has no eos_token: set one, since "
                         "EOS marks where each row ends in a packed block")
    for batch in rows.iter(batch_size=TOKENIZE_BATCH):
        columns = list(batch)
        try:
            texts = [template.format_map(dict(zip(columns, values))) for values in zip(*batch.values())]
        except KeyError as e:
            raise ValueError(f"text_template uses column {e.args[0]!r}, which the data lacks "
                             f"(it has {columns})") from None
        for ids in tokenizer(texts, verbose=False)["input_ids"]:
            yield ids + [eos]


def pack(token_lists: Iterable[list[int]], block_size: int) -> Iterator[list[int]]:
    """Concatenate and cut into block_size pieces; the trailing partial block is dropped."""
    buffer: list[int] = []
    for ids in token_lists:
        buffer.extend(ids)
        full = len(buffer) // block_size * block_size
        for start in range(0, full, block_size):
            yield buffer[start:start + block_size]
        del buffer[:full]


def _no_block(block_size: int) -> ValueError:
    return ValueError(f"the training rows hold fewer than block_size={block_size} tokens: lower block_size, "
                      "or give more rows (eval_rows holds the first ones out)")


def _endless_blocks(rows, tokenizer, template, block_size):
    while True:  # the next pass repeats the rows' order, so a skip from the start lands where a run was
        empty = True
        for block in pack(row_tokens(rows, tokenizer, template), block_size):
            empty = False
            yield {"input_ids": block, "labels": block}  # the model shifts labels itself
        if empty:
            raise _no_block(block_size)


def block_stream(rows, tokenizer, template: str, block_size: int) -> IterableDataset:
    """The run's blocks, without end: for streamed rows. IterableDataset.from_generator, with
    the stream named by its settings: from_generator names it by pickling its arguments, which
    fails on some Python versions for a streamed dataset's state (a generator inside)."""
    name = Hasher.hash((template, block_size, tokenizer.name_or_path, len(tokenizer)))
    return GeneratorDatasetInputStream(
        generator=_endless_blocks, features=BLOCK_FEATURES, streaming=True, fingerprint=name,
        gen_kwargs=dict(rows=rows, tokenizer=tokenizer, template=template, block_size=block_size)).read()


def block_table(rows, tokenizer, template: str, block_size: int, n_blocks: int) -> Dataset:
    """The run's first n_blocks blocks: one pass packed (no more of it than the run trains), its
    blocks indexed pass after pass."""
    one_pass = [np.asarray(b, dtype=np.int32)
                for b in islice(pack(row_tokens(rows, tokenizer, template), block_size), n_blocks)]
    if not one_pass:
        raise _no_block(block_size)
    ids = np.stack(one_pass)
    blocks = Dataset.from_dict({"input_ids": ids, "labels": ids}, features=BLOCK_FEATURES)
    return blocks if len(blocks) == n_blocks else blocks.select(np.arange(n_blocks) % len(blocks))


def build_datasets(args: DataArguments, tokenizer, seed: int, n_blocks: int) -> tuple[Dataset | IterableDataset,
                                                                                         Dataset | None]:
    """(the run's n_blocks training blocks, held-out evaluation blocks or None). The training
    blocks are a map-style Dataset, or an endless IterableDataset where the rows are streamed."""
    train_rows, eval_rows = split_eval(load_rows(args), args.eval_rows)
    if args.shuffle:
        train_rows = shuffle_rows(train_rows, seed, args.shuffle_buffer_size)
    if isinstance(train_rows, IterableDataset):
        train = block_stream(train_rows, tokenizer, args.text_template, args.block_size)
    else:
        train = block_table(train_rows, tokenizer, args.text_template, args.block_size, n_blocks)
    if eval_rows is None:
        return train, None
    # the slice is small: materialise it, so evaluation has a length and a progress bar
    blocks = list(pack(row_tokens(eval_rows, tokenizer, args.text_template), args.block_size))
    if not blocks:
        raise ValueError(f"eval_rows={args.eval_rows} holds fewer than block_size={args.block_size} tokens: "
                         "raise eval_rows")
    return train, Dataset.from_dict({"input_ids": blocks, "labels": blocks}, features=BLOCK_FEATURES)
