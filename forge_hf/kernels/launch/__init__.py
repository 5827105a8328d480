"""Host-side launching, one file per kernel: fused_update_launch.py (triton/fused_update.py's
kernel bound to one tensor), gluon_launch.py (what both Gluon kernels share: the layouts they
take, a layer's launches), persistent_launch.py and wide_launch.py (their arguments and grids)."""
