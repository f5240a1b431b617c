"""The snapshot ring: recurrent (GDN) state after every token of the last verify batch.

Attention rolls back by moving its length, but a recurrent state has no history: to accept only
the first m tokens of a k-token verify batch we need the state as it was after token m. The ring
is allocated once for k_max and is written by the recurrence itself, on the state's own device, so
there is no stale host copy. Slot i holds S after the batch's (i+1)-th token, for i < k_max - 1:
the state after the last token is the live state, and a verify step always keeps its first
(certain) token, so k_max - 1 slots (= the draft count N) serve every rollback. The conv state is
cheap, so the batch's whole conv input history is kept instead of per-token copies.
"""
from __future__ import annotations

import torch

from .kv_cache import state_zeros


class SnapshotRing:
    def __init__(self, n_layers: int, k_max: int, conv_rows: int, conv_channels: int,
                 s_shape: tuple[int, int, int], device):
        self.k_max = k_max
        # S after each token but the last, per GDN layer
        self.S = state_zeros(n_layers, max(k_max - 1, 0), *s_shape, device=device)
        # conv input history of the batch: [old conv state; the batch's inputs]; the conv state
        # after m tokens is rows [m, m + conv_rows)
        self.conv_hist = state_zeros(n_layers, conv_rows + k_max, conv_channels, device=device)
        self.conv_rows = conv_rows
        self.batch_start: int | None = None     # absolute position of the batch's first token
        self.batch_len = 0

    def begin(self, start: int, n: int) -> bool:
        """Start capturing a batch; returns False (and invalidates the ring) when n > k_max."""
        if n > self.k_max:
            self.batch_start, self.batch_len = None, 0
            return False
        self.batch_start, self.batch_len = start, n
        return True

    def can_restore(self, n_keep: int) -> bool:
        return self.batch_start is not None and self.batch_start < n_keep <= self.batch_start + self.batch_len

    def restore(self, n_keep: int, conv_state: torch.Tensor, S: torch.Tensor) -> None:
        """Put every layer's live state ([layers, ...] tensors) back to what it was after absolute
        position n_keep - 1: two device-to-device copies for all layers, no host round trip."""
        m = n_keep - self.batch_start
        if m == self.batch_len:
            return
        S.copy_(self.S[:, m - 1])
        conv_state.copy_(self.conv_hist[:, m:m + self.conv_rows])
        self.batch_len = m

    @property
    def nbytes(self) -> int:
        return self.S.numel() * 4 + self.conv_hist.numel() * 4
