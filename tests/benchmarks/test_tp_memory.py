"""benchmarks/fsdp_model.py --tp: per-rank memory under tensor parallelism, on paper."""

import pytest

from tests.helpers import benchmark_module


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_splits_weights_and_states_as_fsdp2_and_forge_drops_the_pieces_gradients(tp):
    """TP over T ranks holds FSDP2-over-T's weights and states per rank, up to the replicated norms;
    forge's gradients are the norms' only; activations shrink with T but keep the replicated inputs."""
    with benchmark_module("fsdp_model") as m:
        parts, kw = m.model_parts("llama-3.1-8b"), m.SHAPES["llama-3.1-8b"][1]
        forge = m.tp_per_rank(parts, kw, "forge bf16", tp, 2048)
        adamw = m.tp_per_rank(parts, kw, f"{m.ADAMW}, fp32 states", tp, 2048)
        fsdp = m.per_rank(parts, "forge bf16", tp, 2048)
        norms = parts["layers"] * parts["layer_norms"] + parts["h"]
        assert forge["weights"] - fsdp["weights"] == pytest.approx(norms * (1 - 1 / tp) * m.BF16)
        assert adamw["gradients"] == adamw["weights"]
        assert forge["gradients"] == pytest.approx((norms + parts["embed"] / tp) * m.BF16)
        assert m.activations(kw, 2048, 1) > forge["activations"] > m.activations(kw, 2048, 1) / tp
        table = m.tp_memory_table(parts, kw, [tp], 2048)
        assert f"| {tp} | TP {tp} | forge bf16 |" in table and f"| {tp} | FSDP2 {tp} | forge bf16 |" in table
