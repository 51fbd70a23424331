"""Measurement hooks for benchmarks, off in production: the one named option (`RankOptions.probes`) through which a
benchmark asks the rank factory for more than users run. The production step never reads them; the device loop
adds extra phases and events only when a field is set.

- oracle: the device loop's drafts and target choices follow a known continuation (the pipeline's cost at full
  acceptance: every stage runs for real, then its logits are replaced; `benchmarks/oracle_drafter.py` is the host
  loop's counterpart);
- split_phases: the device loop captures one graph per phase instead of one per step, so events between them time
  each phase;
- record_events: CUDA events around every graph replay (device-loop steps and, on the host loop, each profile's
  graph), for the GPU's idle time between them;
- context_rows: every request starts after this many cached rows of random latent and draft K/V (written once,
  seeded) instead of a prefilled prompt of that length: long-context steps without a long prefill. A step's cost does
  not depend on the cached values (attention reads every row whatever it holds), so the steps' times are those of a
  real context of that length; its tokens are not a real continuation of anything. The ranks' capacity must hold
  these rows, the prompt and the request's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Probes:
    oracle: torch.Tensor | None = None  # [N] the known continuation, on the rank's device
    split_phases: bool = False
    record_events: bool = False
    context_rows: int = 0
