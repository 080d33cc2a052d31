"""Solvers the server rules share: the simplex (projection, softmax, exponentiated
gradient), small QPs over the box-capped simplex (FedMGDA+), and online convex
optimisation on the simplex (AAggFF's ONS and entropic FTRL)."""
from fedjax_fair.solvers import online, qp, simplex

__all__ = ["online", "qp", "simplex"]
