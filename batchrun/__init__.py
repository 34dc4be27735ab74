"""batch_runner internals: the pieces behind the three public faces, batch_runner.py, model_tools.py and
toolset_distributions.py, which import from here and are never imported by it."""
