"""A second CUDA stream for a layer's independent branches (`ModelOps.side_stream`): at the 1 to 33 tokens of a
decode or a verify, each kernel of a layer is short and leaves SMs idle (launch and ramp, not bandwidth), so two
chains that do not depend on each other overlap when they run on two streams, as SGLang runs DeepSeek-V3's shared
expert beside the routed ones at small batches.

    with beside(x.device):   # queued after everything on the current stream so far
        shared = mlp(x)
    routed = experts(x)      # on the current stream meanwhile
    join(x.device)           # the current stream waits for the side work
    return routed + shared

The same kernels on the same inputs: results are bit for bit the one-stream ones. Under CUDA-graph capture the side
stream joins the capture (it waits on the capturing stream) and `join` brings it back before the capture ends, so a
graph holds both branches. Tensors are safe to free: side work made in one layer is consumed after `join`, and the
next layer's side work waits on the current stream first; a tensor the side work reads must stay referenced until
`join` (the callers' locals do).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One second stream a GPU, shared by every layer of the process (the layers run one after another)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


@contextmanager
def beside(device: torch.device):
    """The block's work on `device`'s side stream, after everything queued on the current stream so far."""
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield


def join(device: torch.device) -> None:
    """The current stream waits for the side stream's work."""
    torch.cuda.current_stream(device).wait_stream(side_stream(device))
