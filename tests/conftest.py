"""Test settings: strict rank promotion (DESIGN.md §9) and float32 by default."""
import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
