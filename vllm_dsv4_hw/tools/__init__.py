"""Tools that generate or test, apart from the runtime packages: the checkpoint generator, the
compiled-op trap, and the single-process vLLM state benchmarks and tests build the model in.
Nothing in the served path imports this package (the trap is installed only when asked for)."""
