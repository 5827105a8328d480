"""The fused weight-gradient + optimizer step of a linear layer, and the code that chooses
and launches it (docs/kernels.md). Imports nothing of Hugging Face.

    dispatch.py   which code runs a layer's step: backend, kernel, fused or two-pass path
    two_pass.py   the two-pass path's weight gradient: cuBLAS into one scratch buffer a device
    reference.py  the step in PyTorch, tile by tile: the CPU backend and the tests' oracle
    triton/       the @triton.jit kernels and the jit functions they share with gluon/
    gluon/        the Hopper (sm_90) Gluon kernels: persistent_update.py, wide_update.py
    launch/       host-side launching: generic (compiled.py, direct_launch.py) and per kernel
                  (fused_update_launch.py, gluon_launch.py, persistent_launch.py, wide_launch.py)
"""
