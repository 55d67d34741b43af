"""The loop and its runners: `run(cfg)` builds the parts and records one experiment; `engine.train`
is the timed loop, and `lightning.fit` drives the same parts with Lightning's Trainer
(`engine.loop=lightning`); `meter`, `steps`, `faults` and `verify` are what they time, run and check."""
