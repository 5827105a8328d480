"""The Gluon kernels for Hopper (sm_90): the fused step on 64 x 64 blocks
(persistent_update.py) and on 128 x 128 tiles at thousands of tokens (wide_update.py), and the
ring of token chunks both multiply from (chunk_ring.py). docs/kernels.md describes them."""
