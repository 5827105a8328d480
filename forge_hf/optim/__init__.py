"""Whole-model training: patch_model and its report, ForgeOptimizer for what is not fused,
GraphedStep (a step as one CUDA graph) and exact data parallelism."""
