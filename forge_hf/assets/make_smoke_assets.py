"""Regenerate the smoke-run assets next to this file (run once; the outputs are committed).

    python forge_hf/assets/make_smoke_assets.py            # everything below
    python forge_hf/assets/make_smoke_assets.py --corpus-only --rows 50000 --out big.jsonl

- ``smoke/omi2_mini.jsonl``: synthetic arithmetic problems with worked solutions, in
  nvidia/OpenMathInstruct-2's columns (problem, generated_solution, expected_answer,
  problem_source). Written here, not sampled from the real data set.
- ``smoke/tokenizer/``: a byte-level BPE tokenizer trained on that corpus (loads offline
  with AutoTokenizer).
- ``smoke/llama_tiny/config.json``: a 2-layer Llama small enough to train on a CPU.
- ``qwen3_1.7b_shape/config.json``: Qwen3-1.7B's shapes for random-init GPU runs (the
  bundled tokenizer's ids all fall inside its 151,936-entry vocabulary).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
EOS, PAD = "<|endoftext|>", "<|pad|>"


def _add(r):
    a, b = r.randint(10, 999), r.randint(10, 999)
    return (f"What is ${a} + {b}$?",
            f"We add the two numbers: ${a} + {b} = {a + b}$.\n\nThe answer is $\\boxed{{{a + b}}}$.",
            a + b, "synthetic_arithmetic")


def _subtract(r):
    a, b = sorted((r.randint(10, 999), r.randint(10, 999)), reverse=True)
    return (f"Compute ${a} - {b}$.",
            f"Subtracting, ${a} - {b} = {a - b}$.\n\nThe answer is $\\boxed{{{a - b}}}$.",
            a - b, "synthetic_arithmetic")


def _multiply(r):
    a, b = r.randint(2, 99), r.randint(2, 99)
    tens, ones = b // 10 * 10, b % 10
    return (f"What is ${a} \\times {b}$?",
            f"Split ${b}$ as ${tens} + {ones}$. Then ${a} \\times {tens} = {a * tens}$ and "
            f"${a} \\times {ones} = {a * ones}$, so ${a} \\times {b} = {a * tens} + {a * ones} = {a * b}$."
            f"\n\nThe answer is $\\boxed{{{a * b}}}$.",
            a * b, "synthetic_arithmetic")


def _remainder(r):
    a, b = r.randint(20, 999), r.randint(3, 19)
    q, m = divmod(a, b)
    return (f"What is the remainder when ${a}$ is divided by ${b}$?",
            f"We have ${b} \\times {q} = {b * q}$ and ${a} - {b * q} = {m}$, which is less than ${b}$."
            f"\n\nThe answer is $\\boxed{{{m}}}$.",
            m, "synthetic_number_theory")


def _linear_equation(r):
    a, x, b = r.randint(2, 12), r.randint(-20, 20), r.randint(-50, 50)
    c = a * x + b
    return (f"Solve for $x$: ${a}x + {b} = {c}$.".replace("+ -", "- "),
            f"Subtract ${b}$ from both sides: ${a}x = {c - b}$. Divide by ${a}$: $x = {x}$."
            f"\n\nThe answer is $\\boxed{{{x}}}$.",
            x, "synthetic_algebra")


def _word_problem(r):
    name = r.choice(["Sam", "Maya", "Liam", "Ava", "Noah", "Zoe"])
    item = r.choice(["apples", "stickers", "marbles", "books", "pencils"])
    have, bags, each = r.randint(2, 60), r.randint(2, 9), r.randint(2, 12)
    total = have + bags * each
    return (f"{name} has {have} {item} and buys {bags} packs with {each} {item} in each pack. "
            f"How many {item} does {name} have now?",
            f"The packs hold ${bags} \\times {each} = {bags * each}$ {item}. "
            f"So {name} has ${have} + {bags * each} = {total}$ {item}.\n\nThe answer is $\\boxed{{{total}}}$.",
            total, "synthetic_word_problem")


GENERATORS = (_add, _subtract, _multiply, _remainder, _linear_equation, _word_problem)


def make_rows(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        problem, solution, answer, source = r.choice(GENERATORS)(r)
        rows.append({"problem": problem, "generated_solution": solution,
                     "expected_answer": str(answer), "problem_source": source})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def make_tokenizer(rows: list[dict], out: Path, vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((f"{r['problem']}\n\n{r['generated_solution']}" for r in rows), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   model_max_length=512)
    fast.save_pretrained(out)
    # the class name every transformers version resolves (newer ones write their own alias)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return fast


def make_configs(tokenizer) -> None:
    from transformers import LlamaConfig, Qwen3Config

    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    # every linear holds >= 65,536 weights: patch_model's default min_params fuses them all
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                tie_word_embeddings=False, **ids).save_pretrained(HERE / "smoke" / "llama_tiny")
    # Qwen3-1.7B's published shapes; only the special-token ids follow the bundled tokenizer.
    Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000,
                tie_word_embeddings=True, **ids).save_pretrained(HERE / "qwen3_1.7b_shape")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-only", action="store_true", help="write only the jsonl corpus")
    p.add_argument("--out", type=Path, default=HERE / "smoke" / "omi2_mini.jsonl")
    a = p.parse_args()
    rows = make_rows(a.rows, a.seed)
    write_jsonl(rows, a.out)
    if not a.corpus_only:
        make_configs(make_tokenizer(rows, HERE / "smoke" / "tokenizer"))


if __name__ == "__main__":
    main()
