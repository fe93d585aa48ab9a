"""Tools built on the library: the comparison with hand-written ``jax.checkpoint`` strategies and
its reports and plots, the demo, the command line, and example Flax models."""
