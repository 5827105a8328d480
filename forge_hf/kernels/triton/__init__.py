"""The @triton.jit code: the fused step's Triton kernel (fused_update.py), the multi-tensor
rule pass, the loss's row kernels, and the jit functions the Gluon kernels share (bf16_bits.py,
state_tiles.py, tile_step.py). Importing a module here imports Triton."""
