"""Benchmarks that run fdp beside its peer (torch DDP, torch.optim, a plain copy) in one run
and report ratios of medians: ``python -m fdp.bench [subcommand]`` (``__main__.py`` lists them).
Nothing in the library imports this package."""
