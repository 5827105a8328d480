"""The fused weight-gradient + optimizer step: the Triton kernel, the persistent Gluon
kernel for Hopper, the PyTorch reference, and dispatch.py, which chooses among them.
Imports nothing of Hugging Face."""
