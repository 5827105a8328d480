"""OpenMathInstruct-2 rows -> continued-pretraining text -> tokens -> fixed-length blocks.

Rows from the Hub or local .jsonl/.parquet files, streamed or not; a held-out slice taken
before the seeded shuffle; each row's ``text_template`` tokenised with EOS appended; rows
packed into ``block_size`` blocks (only the trailing partial block dropped). Training blocks
are streamed, so a run's length is ``max_steps``. The steps in detail:
docs/architecture.md, "Recipe data".
"""

from collections.abc import Iterable, Iterator
from pathlib import Path

from datasets import Dataset, Features, IterableDataset, Sequence, Value, load_dataset

from .arguments import DataArguments

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
BLOCK_FEATURES = Features({"input_ids": Sequence(Value("int32")), "labels": Sequence(Value("int32"))})
TOKENIZE_BATCH = 256


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


def _blocks(rows, tokenizer, template, block_size):
    for block in pack(row_tokens(rows, tokenizer, template), block_size):
        yield {"input_ids": block, "labels": block}  # the model shifts labels itself


def block_stream(rows, tokenizer, template: str, block_size: int) -> IterableDataset:
    return IterableDataset.from_generator(
        _blocks, features=BLOCK_FEATURES,
        gen_kwargs=dict(rows=rows, tokenizer=tokenizer, template=template, block_size=block_size))


def build_datasets(args: DataArguments, tokenizer, seed: int) -> tuple[IterableDataset, Dataset | None]:
    """(streamed training blocks, held-out evaluation blocks or None)."""
    train_rows, eval_rows = split_eval(load_rows(args), args.eval_rows)
    if args.shuffle:
        train_rows = shuffle_rows(train_rows, seed, args.shuffle_buffer_size)
    train = block_stream(train_rows, tokenizer, args.text_template, args.block_size)
    if eval_rows is None:
        return train, None
    # the slice is small: materialise it, so evaluation has a length and a progress bar
    blocks = list(pack(row_tokens(eval_rows, tokenizer, args.text_template), args.block_size))
    if not blocks:
        raise ValueError(f"eval_rows={args.eval_rows} holds fewer than block_size={args.block_size} tokens: "
                         "raise eval_rows")
    return train, Dataset.from_dict({"input_ids": blocks, "labels": blocks}, features=BLOCK_FEATURES)
