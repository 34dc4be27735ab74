"""batch_runner internals: the pieces behind batch_runner.py, model_tools.py and toolset_distributions.py."""
