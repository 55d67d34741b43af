"""Tools around the loop: the machine's copy ceilings (`limits`), the environment a result was
measured in (`environment`), profiler traces (`profiling`) and the engine's own cost (`overhead`)."""
