"""The stop decision agreed by every rank of a ``torch.distributed`` group (see
:func:`cumulus.runtime.stop_agreed`).

Standard library only: torch is found in ``sys.modules`` (a script whose process group
exists has imported it), never imported here.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["any_rank"]


def any_rank(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is true on any rank of ``group`` (default: the whole world): an
    all-reduce (MAX) of one int, on the CPU for gloo and on the current CUDA device for
    NCCL. Without an initialized process group (a single process, ``torch.distributed``
    never set up) it returns ``flag``.

    :raises RuntimeError: ``group`` is given but no process group is initialized.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError(
                "stop_agreed(group=...) needs torch.distributed's process group: call "
                "torch.distributed.init_process_group first"
            )
        return flag
    torch = sys.modules["torch"]
    backend = str(dist.get_backend(group))
    # NCCL reduces only CUDA tensors; gloo, MPI, UCC and a "cpu:gloo,cuda:nccl" group
    # reduce CPU ones.
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
