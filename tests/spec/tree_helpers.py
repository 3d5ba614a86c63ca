"""Test helper: where each row of a tree step sits in its sequence."""

from __future__ import annotations

import torch

from specdec.spec.tree import depths


def tree_positions(parents: torch.Tensor, start: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, N+1]`` int64: the sequence position of each row (row 0 the root).

    ``start [B]`` is the root's position; row ``i + 1`` sits at
    ``start + depth(i)``: a node has the position it would have in its own
    root-to-node chain. (Padding rows get ``start``.)
    """
    d = depths(parents, num_nodes)  # [B, N]
    return start.unsqueeze(1) + torch.cat([torch.zeros_like(d[:, :1]), d], dim=1)
