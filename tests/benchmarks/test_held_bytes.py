"""benchmarks/held_bytes.py: what the fused layers hold between the backwards and the step,
counted on a meta-device Qwen3-0.6B through forge's own holding code."""

import pytest

from tests.helpers import benchmark_module

LAYERS = 28
GIB = 2**30


@pytest.fixture(scope="module")
def held_bytes():
    with benchmark_module("held_bytes") as module:
        yield module


def test_each_layer_type_holds_the_smaller_of_stash_and_buffer(held_bytes):
    """3 x 512 tokens: past 2·in·out/(in+out) tokens (1365 for q and o, 1024 for k and v) a layer
    holds the fp32 buffer; gate, up and down (1536) keep their bf16 rows, gate and up one input."""
    result = held_bytes.held_rows("qwen3-0.6b", tokens=512, micro=3)
    rows = {r["layer"]: r for r in result["layers"]}
    tokens, hidden, q, kv, ffn = 3 * 512, 1024, 2048, 1024, 3072
    expected = {
        "self_attn.q_proj": ("fp32 buffer", q * hidden * 4),
        "self_attn.k_proj": ("fp32 buffer", kv * hidden * 4),
        "self_attn.v_proj": ("fp32 buffer", kv * hidden * 4),
        "self_attn.o_proj": ("fp32 buffer", hidden * q * 4),
        "mlp.gate_proj": ("stash", tokens * (hidden + ffn) * 2),  # the input gate and up share, counted here
        "mlp.up_proj": ("stash", tokens * ffn * 2),
        "mlp.down_proj": ("stash", tokens * (ffn + hidden) * 2),
    }
    assert set(rows) == set(expected)  # the head is tied to the embedding: not fused
    for name, (holds, per_layer) in expected.items():
        assert rows[name]["count"] == LAYERS and rows[name]["holds"] == holds, name
        assert rows[name]["gib"] == pytest.approx(LAYERS * per_layer / GIB), name
    weights = LAYERS * hidden * (q + 2 * kv + q + 3 * ffn)
    assert result["buffer_gib"] == pytest.approx(weights * 4 / GIB)
    assert result["grad_gib"] == pytest.approx(weights * 2 / GIB)
    assert result["held_gib"] == pytest.approx(sum(r["gib"] for r in rows.values()))


def test_the_stash_alone_is_chosen_when_asked(held_bytes):
    result = held_bytes.held_rows("qwen3-0.6b", tokens=512, micro=3, accumulation="stash")
    assert {r["holds"] for r in result["layers"]} == {"stash"}
    assert "| mlp.down_proj | 28 | stash |" in held_bytes.markdown(result)
