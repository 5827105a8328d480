"""Modules and autograd functions: ForgeLinear and ForgeConv1D (the step inside backward),
SwiGLU recomputation and the chunked causal-LM loss."""
