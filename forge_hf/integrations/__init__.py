"""Hugging Face glue: the ``forge_<rule>`` optimizer names and ForgeTrainer / ForgeTrainerMixin."""
