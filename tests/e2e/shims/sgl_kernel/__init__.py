"""TEST SCAFFOLDING, not SGLang's: a pure-torch stand-in for the `sgl_kernel` package on the CPU.

PyPI has no CPU build of `sglang-kernel`, and SGLang 0.5.23 imports `sgl_kernel` unconditionally on
the CPU path (`sglang/srt/mem_cache/allocation.py`). For a Llama model on a CPU without AMX the
only function it calls is `assign_req_to_token_pool_cpu`, written here in plain torch with the
semantics of SGLang's Triton kernel `assign_req_to_token_pool`. Every other name resolves to a
function that raises NotImplementedError, so a code path we did not expect fails loudly instead
of computing something else. No `torch.ops.sgl_kernel` op is registered, so SGLang's AMX probe
(`hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`) stays False and it takes its native
torch paths. Put this folder's parent on PYTHONPATH of the SGLang servers only (see
tests/e2e/lane.sh); used by `make e2e-sglang`, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

__version__ = "0.0.0+pd-gateway-e2e-cpu-shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request i: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next (end - start) slots."""
    del pool_len  # the row length of req_to_token; implied by the tensor here
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _missing(name: str) -> Callable[..., NoReturn]:
    def stub(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name} is not in the pd-gateway e2e CPU shim")

    stub.__name__ = name
    return stub


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
