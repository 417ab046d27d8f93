"""midas_jax: JAX/Flax pretraining of language models that grow in depth while they train."""

__version__ = "0.1.0"
