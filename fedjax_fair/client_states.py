"""Per-client tables: pytrees whose leaves have a leading client axis [N, ...].

Stateful methods (A-FedPD duals, SCAFFOLD control variates, personal models) keep
one row per client; a round gathers the cohort's rows and scatters them back.
Masked-out cohort rows never write: their index is sent out of range and dropped,
so padded cohorts that repeat a client id cannot clobber its row.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def init_table(row, num_clients: int):
    """A table with ``num_clients`` copies of the pytree ``row``."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_clients, *jnp.shape(x))), row)


def gather(table, client_ids):
    """Rows at client_ids: leaves [K, ...]."""
    return jax.tree.map(lambda t: t[client_ids], table)


def scatter(table, client_ids, rows, client_mask):
    """Writes ``rows`` [K, ...] at ``client_ids`` where ``client_mask`` is True."""
    num_clients = jax.tree.leaves(table)[0].shape[0] if jax.tree.leaves(table) else 0
    ids = jnp.where(client_mask, client_ids, num_clients)
    return jax.tree.map(lambda t, r: t.at[ids].set(r, mode="drop"), table, rows)
