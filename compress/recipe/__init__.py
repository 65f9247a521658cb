"""Recipes: the Hydra config and its checks, the stage registry, the pipeline that runs a recipe
into a run folder, the model card and the Hub upload."""
