"""forge_hf/kernels/cute/ (QuACK's Hopper GEMM with the fused step as its epilogue) is an optional
GPU dependency: CPU installs and CI import nothing of it, and asking for it without the packages
says how to install them."""

import subprocess
import sys

import pytest

from forge_hf.kernels import cute


def test_importing_forge_hf_imports_neither_quack_nor_the_cute_dsl():
    names = ("cutlass", "quack", "forge_hf.kernels.cute.wgrad_epilogue")
    code = ("import sys, forge_hf, forge_hf.kernels.cute, forge_hf.kernels.dispatch; "
            f"print(sorted(m for m in {names!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_packages_are_named_with_the_install_command(monkeypatch):
    monkeypatch.setattr(cute, "_REQUIRED", ("cutlass", "quack", "forge_hf_no_such_package"))
    assert "forge_hf_no_such_package" in cute.missing_packages()
    assert not cute.available()
    with pytest.raises(ImportError, match=r"pip install forge-hf\[hopper\]"):
        cute.load()


@pytest.mark.skipif(cute.available(), reason="QuACK and the CuTe DSL are installed here")
def test_without_the_packages_load_refuses():
    with pytest.raises(ImportError, match="forge_hf.kernels.cute needs"):
        cute.load()


# ---------------------------------------------- with the packages (no GPU needed)

with_packages = pytest.mark.skipif(not cute.available(), reason="needs QuACK and the CuTe DSL (forge-hf[hopper])")


def _layer(weight_dtype=None, state_dtype=None, n=64, k=96, t=10):
    import torch

    bf16 = torch.bfloat16
    x, dy = torch.zeros(t, k, dtype=bf16), torch.zeros(t, n, dtype=bf16)
    w = torch.zeros(n, k, dtype=weight_dtype or bf16)
    slots = [torch.zeros(n, k, dtype=state_dtype or bf16) for _ in range(2)] + [None]
    return x, dy, w, slots, torch.zeros(15, dtype=torch.int32)


@with_packages
def test_refusals_name_what_the_engine_does_not_take():
    from dataclasses import replace

    from forge_hf.core.codecs import CODECS, LEGACY_AL8_CODEC, QuantisedSlot

    W = cute.load()
    x, dy, w, slots, args = _layer()
    int8 = QuantisedSlot.empty_like(w, CODECS["absmax8"], transposed=False)
    legacy = replace(int8, codec=LEGACY_AL8_CODEC)
    wide = _layer(k=104)  # in features a multiple of 8, not 16
    wide_int8 = QuantisedSlot.empty_like(wide[2], CODECS["absmax8"], transposed=False)
    moved = replace(int8, meta=int8.meta.contiguous())
    refusals = {
        "0.1.0 are read by the Triton kernels only": (x, dy, w, [legacy, slots[1], None], "adamw"),
        "a multiple of 16": (*wide[:3], [wide_int8, wide[3][1], None], "adamw"),
        "not as QuantisedSlot.empty_like allocates it": (x, dy, w, [moved, slots[1], None], "adamw"),
        "contiguous torch.int8 codes": (x, dy, w, [replace(int8, codes=int8.codes.t().contiguous().t()),
                                                   slots[1], None], "adamw"),
        "lion keeps 1 state slot": (x, dy, w, slots, "lion"),
        "unknown optimizer": (x, dy, w, slots, "adam"),
        "bf16 or fp32 states": (x, dy, w, [slots[0].half(), slots[1], None], "adamw"),
        "bf16 x and dy": (x.float(), dy, w, slots, "adamw"),
        "bf16 or fp32 weight": (x, dy, w.half(), slots, "adamw"),
        "non-contiguous": (x, dy, w.t().contiguous().t(), slots, "adamw"),
        "multiples of 8": (x[:, :92].contiguous(), dy, w[:, :92].contiguous(),
                           [s[:, :92].contiguous() for s in slots[:2]], "adamw"),
    }
    for message, (xs, dys, ws, ss, rule) in refusals.items():
        with pytest.raises(ValueError, match=message):
            W.step_call(xs, dys, ws, ss, args, rule=rule)
    assert W.step_call(x, dy, w, slots[:2], args)[0] is W.step_call(x, dy, w, slots, args)[0]  # None-padded


@with_packages
def test_epilogues_are_built_once_per_kind_at_first_use():
    import torch

    W = cute.load()
    x, dy, w, slots, args = _layer(weight_dtype=torch.float32, state_dtype=torch.float32)
    epilogue, operands, keywords = W.step_call(x, dy, w, slots, args, rule="adamw", stochastic=True)
    # nothing is stored in bf16: stochastic rounding is moot, one kernel for both
    assert epilogue is W.step_call(x, dy, w, slots, args, rule="adamw", stochastic=False)[0]
    assert epilogue.fn.__name__ == "adamw_fp32_fp32_fp32_rn"
    assert set(keywords["out"]) == {"D", "exp_avg_new", "exp_avg_sq_new"}
    assert [name for name in keywords if name in W.SCALAR_NAMES] == [f"c{i}" for i in range(7)]  # AdamW reads 7
    rms = [torch.zeros_like(w), None, torch.zeros_like(w, dtype=torch.bfloat16)]  # centered, no momentum
    epilogue, _, keywords = W.step_call(x, dy, w, rms, args, rule="rmsprop")
    assert epilogue.fn.__name__ == "rmsprop_fp32_fp32_no_bf16_sr"
    assert set(keywords["out"]) == {"D", "square_avg_new", "grad_avg_new"} and "momentum_buffer" not in keywords
    assert W.CONSTANTS_READ == {"adamw": 7, "nadam": 9, "radam": 11, "lion": 6, "rmsprop": 8, "adagrad": 3,
                                "sgd": 7}


@with_packages
def test_a_layers_prepared_call_is_the_checked_call():
    """layer_call, made once for a layer (launch/quack_launch.py), gives each step the call
    step_call checks and builds from scratch."""
    import torch

    W = cute.load()
    x, dy, w, slots, args = _layer()
    stats = torch.zeros(2)
    epilogue, operands, keywords = W.step_call(x, dy, w, slots, args, stats=stats)
    again = W.step_call(x, dy, w, slots, args, stats=stats, layer=W.layer_call(w, slots))
    assert again[0] is epilogue and list(again[2]) == list(keywords)
    for name, value in keywords.items():
        assert again[2][name] is value or (torch.is_tensor(value) and again[2][name].data_ptr() == value.data_ptr()
                                           and torch.equal(again[2][name], value)) or again[2][name] == value
    with pytest.raises(ValueError, match="bf16 x and dy"):  # a step's tokens are still checked
        W.step_call(x.float(), dy, w, slots, args, layer=W.layer_call(w, slots))


@with_packages
def test_an_8bit_layer_hands_its_codes_as_bytes_and_its_metadata_to_the_codec_ops():
    import torch

    from forge_hf.core.codecs import CODECS, QuantisedSlot

    W = cute.load()
    x, dy, w, _, args = _layer(k=128)
    m = QuantisedSlot.empty_like(w, CODECS["absmax8"], transposed=False)
    v = QuantisedSlot.empty_like(w, CODECS["al8"], transposed=False)
    epilogue, operands, keywords = W.step_call(x, dy, w, [m, v, None], args, stochastic=True)
    assert epilogue.fn.__name__ == "adamw_bf16_absmax8_al8_sr"
    assert keywords["exp_avg"].dtype == torch.uint8 and keywords["exp_avg"].data_ptr() == m.codes.data_ptr()
    assert keywords["out"]["exp_avg_sq_new"].data_ptr() == v.codes.data_ptr()
    assert keywords["exp_avg_sq_meta"] is v.meta and keywords["exp_avg_sq_encode"] is v.meta
    assert keywords["exp_avg_sq_word"] == 0.0 and "exp_avg_word" not in keywords  # absmax8 rounds to nearest
    nearest = W.step_call(x, dy, w, [m, v, None], args, stochastic=False)
    assert nearest[0].fn.__name__ == "adamw_bf16_absmax8_al8_rn" and "exp_avg_sq_word" not in nearest[2]
    with pytest.raises(ValueError, match="rolled epilogue only"):
        W.step_call(x, dy, w, [m, v, None], args, rolled=False)


@with_packages
def test_the_rolled_kernel_keeps_the_main_loop_two_stages(monkeypatch):
    """Where QuACK's split of shared memory would leave the GEMM one stage (three fp32 states'
    epilogue staging), the rolled kernel stages fewer epilogue loads; where even one load stage
    leaves too little, it says so rather than build a kernel that never finishes."""
    cute.load()
    from quack.gemm_sm90 import GemmSm90

    from forge_hf.kernels.cute.rolled import MIN_AB_STAGES, RolledEpilogueSm90

    def split(free):  # a stand-in for QuACK's split: each epilogue load stage costs a GEMM stage
        return classmethod(lambda cls, *a, **k: (free - cls.epi_c_stage_base, 2, cls.epi_c_stage_base))

    monkeypatch.setattr(GemmSm90, "_compute_stages", split(5))
    assert RolledEpilogueSm90._compute_stages() == (MIN_AB_STAGES, 2, 3)  # 4 load stages left 1
    monkeypatch.setattr(GemmSm90, "_compute_stages", split(9))
    assert RolledEpilogueSm90._compute_stages() == (5, 2, 4)  # enough: QuACK's split as it is
    monkeypatch.setattr(GemmSm90, "_compute_stages", split(2))
    with pytest.raises(ValueError, match="leaves the GEMM 1 stage"):
        RolledEpilogueSm90._compute_stages()
