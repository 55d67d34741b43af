"""The loop and its runners: `run(cfg)` builds the parts and records one experiment; `engine.train`
is the timed loop; `meter`, `steps`, `faults` and `verify` are what it times, runs and checks."""
