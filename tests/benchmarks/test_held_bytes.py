"""benchmarks/held_bytes.py: what the fused layers hold between the backwards and the step,
counted on a meta-device Qwen3-0.6B (bf16 weights) through forge's own holding code."""

import pytest

from tests.helpers import benchmark_module

LAYERS = 28
GIB = 2**30
HIDDEN, Q, KV, FFN = 1024, 2048, 1024, 3072
SHAPES = {  # (in, out) of each fused layer type
    "self_attn.q_proj": (HIDDEN, Q), "self_attn.k_proj": (HIDDEN, KV), "self_attn.v_proj": (HIDDEN, KV),
    "self_attn.o_proj": (Q, HIDDEN), "mlp.gate_proj": (HIDDEN, FFN), "mlp.up_proj": (HIDDEN, FFN),
    "mlp.down_proj": (FFN, HIDDEN),
}
SHARES_INPUT = {"self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"}  # counted under q_proj, gate_proj


@pytest.fixture(scope="module")
def held_bytes():
    with benchmark_module("held_bytes") as module:
        yield module


def expected_row(name, tokens, micro):
    """auto's choice for bf16 weights, from the rule: the stash while its bf16 rows take no more
    than the layer's bf16 gradient after each micro-batch, else the bf16 buffer; its bytes."""
    k, n = SHAPES[name]
    if all(m * tokens * (k + n) * 2 <= k * n * 2 for m in range(1, micro + 1)):
        own_input = 0 if name in SHARES_INPUT else k
        return "stash", micro * tokens * (own_input + n) * 2
    return "bf16 buffer", k * n * 2


@pytest.mark.parametrize("tokens,micro", [(512, 3), (256, 3), (2048, 1)])
def test_each_layer_holds_no_more_than_the_trainers_gradient(held_bytes, tokens, micro):
    """256 x 3: q and o (682 tokens of rows at most), k and v (512) move to the bf16 buffer at the
    third micro-batch; gate, up and down (768) keep their rows, at the bound exactly."""
    result = held_bytes.held_rows("qwen3-0.6b", tokens=tokens, micro=micro)
    rows = {r["layer"]: r for r in result["layers"]}
    assert set(rows) == set(SHAPES)  # the head is tied to the embedding: not fused
    for name, (k, n) in SHAPES.items():
        holds, per_layer = expected_row(name, tokens, micro)
        row = rows[name]
        assert row["count"] == LAYERS and row["holds"] == holds, name
        assert row["gib"] == pytest.approx(LAYERS * per_layer / GIB), name
        assert row["trainer_gib"] == pytest.approx(LAYERS * k * n * 2 / GIB), name
        assert row["bytes_per_param"] == pytest.approx(per_layer / (k * n)), name
        assert row["worst"] <= 1.0 and row["gib"] <= row["trainer_gib"], name
    weights = LAYERS * sum(k * n for k, n in SHAPES.values())
    assert result["buffer_gib"] == pytest.approx(weights * 4 / GIB)
    assert result["grad_gib"] == pytest.approx(weights * 2 / GIB)
    assert result["held_gib"] == pytest.approx(sum(r["gib"] for r in rows.values()))
    assert result["held_gib"] <= result["grad_gib"]
    if (tokens, micro) == (256, 3):
        assert {r["holds"] for r in rows.values()} == {"stash", "bf16 buffer"}


def test_the_fp32_buffer_asked_for_holds_twice_the_trainers(held_bytes):
    result = held_bytes.held_rows("qwen3-0.6b", tokens=512, micro=3, accumulation="buffer")
    assert {(r["holds"], r["bytes_per_param"], r["worst"]) for r in result["layers"]} == {("fp32 buffer", 4.0, 2.0)}
    assert "| mlp.down_proj | 28 | fp32 buffer |" in held_bytes.markdown(result)


def test_the_stash_alone_is_chosen_when_asked(held_bytes):
    result = held_bytes.held_rows("qwen3-0.6b", tokens=512, micro=3, accumulation="stash")
    assert {r["holds"] for r in result["layers"]} == {"stash"}
    assert "| mlp.down_proj | 28 | stash |" in held_bytes.markdown(result)
