"""Host-side launching. Generic: compiled.py (a compiled kernel launched again without
Triton's JIT dispatch) and direct_launch.py (through the C launcher Triton generated). Per
kernel: fused_update_launch.py (triton/fused_update.py's kernel bound to one tensor),
gluon_launch.py (what both Gluon kernels share), persistent_launch.py and wide_launch.py (when
and how gluon/persistent_update.py and gluon/wide_update.py run)."""
