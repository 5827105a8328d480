"""What every kernel's launch stands on, whatever the kernel: the per-step argument rows
(arg_words.py, step_rows.py, pinned_ring.py, launch_args.py) and launching a compiled kernel
again without Triton's JIT dispatch (compiled.py, direct_launch.py). Imports no kernel."""
