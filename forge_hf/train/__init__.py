"""Recipe-driven training: YAML recipe -> arguments, model, data, ForgeTrainer; the
``forge-hf`` command. ``python -m forge_hf.train RECIPE.yaml`` (or ``accelerate launch -m
forge_hf.train ...``) runs ``cli.train``."""
