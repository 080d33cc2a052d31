"""fedjax_fair: fast, functional simulation of fair federated learning in JAX."""
