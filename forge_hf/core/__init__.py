"""The layer every backend shares: the optimizer rules (each written once), the 8-bit state
codecs, the stochastic-rounding hash, per-layer optimizer state and the kernels' per-step
arguments. Imports neither Triton nor Hugging Face."""
