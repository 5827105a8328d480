"""OpenMathInstruct-2 rows -> packed blocks: exact packing, seeded order, equal sources."""

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from forge_hf.train.arguments import DataArguments
from forge_hf.train.data import build_datasets, pack, row_tokens

ASSETS = Path(__file__).resolve().parents[2] / "forge_hf" / "assets" / "smoke"
CORPUS = ASSETS / "omi2_mini.jsonl"
BLOCK = 64


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS / "tokenizer")


@pytest.fixture(scope="module")
def rows():
    return [json.loads(line) for line in CORPUS.read_text().splitlines()]


def blocks_of(dataset):
    return [b["input_ids"] for b in dataset]


def build(tokenizer, seed=0, **kw):
    kw = {"dataset_source": "local", "data_files": [str(CORPUS)], "block_size": BLOCK, **kw}
    return build_datasets(DataArguments(**kw), tokenizer, seed)


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
    first = tokenizer.decode(blocks_of(train)[0])
    assert first.startswith(f"{rows[0]['problem']}\n\n{rows[0]['generated_solution']}{tokenizer.eos_token}")


def test_template_naming_a_missing_column_is_refused():
    with pytest.raises(ValueError, match="'answer'"):
        DataArguments(text_template="{problem} {answer}")


@pytest.mark.parametrize("streaming", [False, True])
def test_same_seed_same_order(tokenizer, streaming):
    kw = dict(streaming=streaming, shuffle_buffer_size=50)
    first, again, other = (blocks_of(build(tokenizer, seed=s, **kw)[0]) for s in (1, 1, 2))
    assert first == again
    assert first != other


def test_streaming_and_local_formats_give_the_same_blocks(tokenizer, tmp_path):
    parquet = tmp_path / "rows.parquet"
    Dataset.from_json(str(CORPUS)).to_parquet(str(parquet))
    results = []
    for files, streaming in [(CORPUS, False), (CORPUS, True), (parquet, False), (parquet, True)]:
        train, held_out = build(tokenizer, data_files=[str(files)], streaming=streaming, shuffle=False,
                                eval_rows=30)
        results.append((blocks_of(train), blocks_of(held_out)))
    assert len(results[0][0]) > 100 and len(results[0][1]) > 5
    assert all(r == results[0] for r in results[1:])


def test_eval_slice_is_the_first_rows_and_is_held_out(tokenizer, rows):
    train, held_out = build(tokenizer, shuffle=False, eval_rows=30)
    template = DataArguments().text_template

    def packed(some_rows):
        return list(pack(row_tokens(Dataset.from_list(some_rows), tokenizer, template), BLOCK))

    assert blocks_of(held_out) == packed(rows[:30])
    assert blocks_of(train) == packed(rows[30:])
    # shuffling moves training rows only
    _, held_out_shuffled = build(tokenizer, seed=5, eval_rows=30)
    assert blocks_of(held_out_shuffled) == blocks_of(held_out)


@pytest.mark.parametrize("streaming", [False, True])
def test_shuffled_blocks_hold_every_row(tokenizer, rows, streaming):
    """A shuffle reorders rows; every token is still there, bar the trailing partial block."""
    template = DataArguments().text_template
    every = Counter(t for ids in row_tokens(Dataset.from_list(rows), tokenizer, template) for t in ids)
    shuffled = Counter(t for b in blocks_of(build(tokenizer, seed=3, streaming=streaming)[0]) for t in b)
    assert shuffled <= every
    assert every.total() - shuffled.total() < BLOCK


def test_too_small_eval_slice_is_refused(tokenizer):
    with pytest.raises(ValueError, match="eval_rows=1"):
        build(tokenizer, eval_rows=1, block_size=512)
