"""benchmarks/stream_overlap.py (the gate of the update across streams): the layer it times,
and its refusals. The timing itself needs CUDA streams."""

import sys

import pytest
import torch

from tests.helpers import benchmark_module

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def stream_overlap():
    with benchmark_module("stream_overlap") as module:
        yield module


@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen3-1.7b"])
def test_the_timed_layer_is_one_decoder_layer_of_the_models_shape(stream_overlap, model):
    layer, rotary, config = stream_overlap.decoder_layer(model, **SMALL)
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert layer.mlp.gate_proj.weight.shape == (96, 64)
    device = layer.mlp.gate_proj.weight.device  # built on the GPU where there is one
    hidden = torch.randn(1, 8, 64, dtype=torch.bfloat16, device=device)
    position_ids = torch.arange(8, device=device)[None]
    out = layer(hidden, position_embeddings=rotary(hidden, position_ids), position_ids=position_ids)
    assert (out[0] if isinstance(out, tuple) else out).shape == hidden.shape


@pytest.mark.parametrize("argv, message", [
    (["--arms", "autograd,bogus"], "--arms autograd,bogus"),
    (["--ring", "0"], "--ring 0"),
])
def test_bad_arguments_are_named(stream_overlap, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["stream_overlap.py", *argv])
    with pytest.raises(SystemExit):
        stream_overlap.main()
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_without_cuda_it_says_it_needs_a_gpu(stream_overlap, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["stream_overlap.py"])
    with pytest.raises(SystemExit, match="run it on a GPU"):
        stream_overlap.main()
