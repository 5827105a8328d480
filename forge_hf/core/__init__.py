"""The math every backend binds: the optimizer rules (each written once), the 8-bit state
codecs, the stochastic-rounding hash, per-layer optimizer state and the options. Imports
neither Triton nor Hugging Face."""
