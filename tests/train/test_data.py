"""OpenMathInstruct-2 rows -> packed blocks: exact packing, seeded order, equal sources, the
run's blocks pass after pass."""

import json
import random
from collections import Counter
from itertools import islice
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer, TrainingArguments

from forge_hf.train.arguments import DataArguments
from forge_hf.train.data import (
    block_stream,
    blocks_per_step,
    build_datasets,
    load_rows,
    pack,
    row_tokens,
    shuffle_rows,
    split_eval,
)

ASSETS = Path(__file__).resolve().parents[2] / "forge_hf" / "assets" / "smoke"
CORPUS = ASSETS / "omi2_mini.jsonl"
BLOCK = 64
TEMPLATE = DataArguments().text_template


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tokenizer")


@pytest.fixture(scope="module")
def rows():
    return [json.loads(line) for line in CORPUS.read_text().splitlines()]


def packed(some_rows, tokenizer):
    return list(pack(row_tokens(Dataset.from_list(some_rows), tokenizer, TEMPLATE), BLOCK))


def blocks_of(dataset, n: int):
    """The first n blocks' ids (a stream of the run's blocks has no end)."""
    return [b["input_ids"] for b in islice(dataset, n)]


def build(tokenizer, seed=0, n_blocks=50, **kw):
    kw = {"dataset_source": "local", "data_files": [str(CORPUS)], "block_size": BLOCK, **kw}
    return build_datasets(DataArguments(**kw), tokenizer, seed, n_blocks)


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
@pytest.mark.parametrize("seed", range(4))
def test_packing_is_exact(block_size, seed):
    r = random.Random(seed)
    # empty rows, short rows and rows several blocks long
    rows = [[r.randrange(1000) for _ in range(r.choice([0, 1, 5, 40, 150]))] for _ in range(r.randint(0, 30))]
    stream = [t for row in rows for t in row]
    blocks = list(pack(rows, block_size))
    assert all(len(b) == block_size for b in blocks)
    kept = len(blocks) * block_size
    assert [t for b in blocks for t in b] == stream[:kept]  # nothing lost, repeated or reordered
    assert len(stream) - kept < block_size  # only the trailing partial block is dropped


def test_rows_follow_the_template_and_end_with_eos(tokenizer, rows):
    template = "Problem: {problem}\nAnswer: {expected_answer} ({problem_source})"
    ids = next(row_tokens(Dataset.from_list(rows[:3]), tokenizer, template))
    assert ids[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(ids[:-1])
    assert text == template.format_map(rows[0])
    assert text.startswith(f"Problem: {rows[0]['problem']}\nAnswer: {rows[0]['expected_answer']} (")


def test_default_template_is_problem_then_solution(tokenizer, rows):
    train, _ = build(tokenizer, shuffle=False)
    first = tokenizer.decode(train[0]["input_ids"])
    assert first.startswith(f"{rows[0]['problem']}\n\n{rows[0]['generated_solution']}{tokenizer.eos_token}")


def test_template_naming_a_missing_column_is_refused():
    with pytest.raises(ValueError, match="'answer'"):
        DataArguments(text_template="{problem} {answer}")


@pytest.mark.parametrize("streaming", [False, True])
def test_same_seed_same_order(tokenizer, streaming):
    kw = dict(streaming=streaming, shuffle_buffer_size=50)
    first, again, other = (blocks_of(build(tokenizer, seed=s, **kw)[0], 50) for s in (1, 1, 2))
    assert first == again
    assert first != other


def test_streaming_and_local_formats_give_the_same_blocks(tokenizer, tmp_path):
    parquet = tmp_path / "rows.parquet"
    Dataset.from_json(str(CORPUS)).to_parquet(str(parquet))
    results = []
    for files, streaming in [(CORPUS, False), (CORPUS, True), (parquet, False), (parquet, True)]:
        train, held_out = build(tokenizer, data_files=[str(files)], streaming=streaming, shuffle=False,
                                eval_rows=30, n_blocks=200)
        results.append((blocks_of(train, 200), blocks_of(held_out, 200)))
    assert len(results[0][0]) > 100 and len(results[0][1]) > 5
    assert all(r == results[0] for r in results[1:])


def test_eval_slice_is_the_first_rows_and_is_held_out(tokenizer, rows):
    one_pass = packed(rows[30:], tokenizer)
    train, held_out = build(tokenizer, shuffle=False, eval_rows=30, n_blocks=len(one_pass))
    assert blocks_of(held_out, len(rows)) == packed(rows[:30], tokenizer)
    assert blocks_of(train, len(rows)) == one_pass
    # shuffling moves training rows only
    _, held_out_shuffled = build(tokenizer, seed=5, eval_rows=30)
    assert blocks_of(held_out_shuffled, len(rows)) == blocks_of(held_out, len(rows))


@pytest.mark.parametrize("streaming", [False, True])
def test_shuffled_blocks_hold_every_row(tokenizer, rows, streaming):
    """A shuffle reorders rows; every token is still there, bar the trailing partial block."""
    every = Counter(t for ids in row_tokens(Dataset.from_list(rows), tokenizer, TEMPLATE) for t in ids)
    one_pass = len(packed(rows, tokenizer))
    train, _ = build(tokenizer, seed=3, streaming=streaming, n_blocks=one_pass)
    shuffled = Counter(t for b in blocks_of(train, one_pass) for t in b)
    assert shuffled <= every
    assert every.total() - shuffled.total() < BLOCK


def test_too_small_eval_slice_is_refused(tokenizer):
    with pytest.raises(ValueError, match="eval_rows=1"):
        build(tokenizer, eval_rows=1, block_size=512)


@pytest.mark.parametrize("streaming", [False, True])
def test_the_run_repeats_one_pass_in_its_order(tokenizer, streaming):
    """The blocks go on pass after pass, each the same seeded order (a pass's trailing partial
    block dropped), streamed or not; map-style, exactly the run's count."""
    args = DataArguments(dataset_source="local", data_files=[str(CORPUS)], block_size=BLOCK, eval_rows=300,
                         streaming=streaming, shuffle_buffer_size=50)
    shuffled = shuffle_rows(split_eval(load_rows(args), 300)[0], seed=4, buffer_size=50)
    one_pass = list(pack(row_tokens(shuffled, tokenizer, TEMPLATE), BLOCK))
    n_blocks = 3 * len(one_pass) + len(one_pass) // 2
    train, _ = build_datasets(args, tokenizer, 4, n_blocks)
    assert blocks_of(train, n_blocks) == [one_pass[i % len(one_pass)] for i in range(n_blocks)]
    if not streaming:
        assert len(train) == n_blocks


@pytest.mark.parametrize("n_blocks", [5, 300])
def test_streamed_and_map_style_runs_are_the_same(tokenizer, n_blocks):
    """Beyond the end of the rows too; a run shorter than a pass packs only its own blocks."""
    table, _ = build(tokenizer, shuffle=False, eval_rows=300, n_blocks=n_blocks)
    stream, _ = build(tokenizer, shuffle=False, eval_rows=300, streaming=True, n_blocks=n_blocks)
    assert len(table) == n_blocks
    assert blocks_of(table, n_blocks) == blocks_of(stream, n_blocks)


@pytest.mark.parametrize("streaming", [False, True])
def test_rows_too_short_for_a_block_are_refused(tokenizer, streaming):
    with pytest.raises(ValueError, match="the training rows hold fewer than block_size=500 tokens"):
        train, _ = build(tokenizer, eval_rows=399, block_size=500, streaming=streaming)
        next(iter(train))  # a stream finds out when read


def test_a_step_trains_every_micro_batch_of_every_process(monkeypatch, tmp_path):
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=3,
                             use_cpu=True, report_to="none")
    assert blocks_per_step(args) == 4 * 3 * 2


def test_a_stream_whose_rows_cannot_be_pickled_still_gives_its_blocks(tokenizer, rows):
    """A streamed dataset's state may hold what pickle refuses (a generator, on some Python
    versions); the block stream is named by its settings, not by pickling its rows."""
    streamed = load_rows(DataArguments(dataset_source="local", data_files=[str(CORPUS)], streaming=True))
    streamed.unpicklable = (n for n in range(3))
    assert blocks_of(block_stream(streamed, tokenizer, TEMPLATE, BLOCK), 5) == packed(rows, tokenizer)[:5]
