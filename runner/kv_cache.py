"""One rank's caches of one sequence. The runner owns them; engines only read them and return new rows.

- target latent cache [layers, capacity, latent_dim]: rows [0, num_cached) are committed tokens;
- draft cache [draft_layers, 2, capacity, kv_heads, head_dim]: context K/V of committed tokens already drafted on;
- pending context: taps (and positions) of committed tokens the drafter has not yet seen.
Only accepted tree rows are ever written, so rejected branches never touch a cache and nothing is compacted.
"""

from __future__ import annotations

import torch


class SequenceCache:
    def __init__(
        self,
        latent_shape: tuple[int, ...],
        draft_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.latent = torch.zeros(latent_shape, dtype=dtype, device=device)
        self.draft = torch.zeros(draft_shape, dtype=dtype, device=device)
        self.capacity = latent_shape[1]
        self.reset()

    @classmethod
    def over(cls, latent: torch.Tensor, draft: torch.Tensor) -> SequenceCache:
        """A cache over existing tensors (a batch slot's: a row of the batch's caches, `runner/device/batch.py`)."""
        cache = cls.__new__(cls)
        cache.latent, cache.draft, cache.capacity = latent, draft, latent.shape[1]
        cache.reset()
        return cache

    def reset(self) -> None:
        self.num_cached = 0  # committed target rows
        self.num_drafted = 0  # committed draft-cache rows
        self.pending_taps: torch.Tensor | None = None  # [C, taps * hidden]
        self.pending_start = 0  # position of pending_taps[0]

    def commit_target(self, new_kv: torch.Tensor, taps: torch.Tensor | None, rows: list[int] | None) -> None:
        """Appends the chosen rows (all when None) of a forward's new latent KV; their taps become pending context
        (`taps` None: no drafter follows, as in autoregressive decoding)."""
        if rows is not None:
            index = torch.as_tensor(rows, device=new_kv.device)
            new_kv = new_kv.index_select(1, index)
            taps = taps.index_select(0, index) if taps is not None else None
        count = new_kv.shape[1]
        if self.num_cached + count > self.capacity:
            raise ValueError(
                f"sequence needs {self.num_cached + count} cache rows; the engine's max_seq_len is {self.capacity}"
            )
        self.latent[:, self.num_cached : self.num_cached + count] = new_kv
        if taps is not None and self.pending_taps is None:
            self.pending_taps, self.pending_start = taps, self.num_cached
        elif taps is not None:
            self.pending_taps = torch.cat((self.pending_taps, taps), dim=0)
        self.num_cached += count

    def take_context(self) -> tuple[torch.Tensor, int]:
        """The pending context rows and the position of the first; the drafter consumes them."""
        if self.pending_taps is None:
            raise RuntimeError("no committed context for the drafter: prefill first")
        taps, start = self.pending_taps, self.pending_start
        self.pending_taps = None
        return taps, start

    def commit_draft(self, new_context_kv: torch.Tensor, count: int) -> None:
        end = self.num_drafted + count
        self.draft[:, :, self.num_drafted : end] = new_context_kv[:, :, :count]
        self.num_drafted = end
