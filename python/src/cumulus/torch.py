"""PyTorch helpers: :func:`exact_ddp` makes a ``DistributedDataParallel`` job resume bit for
bit at any world size.

::

    from cumulus.torch import exact_ddp

    ddp = exact_ddp(model, device_ids=[rank])  # instead of DistributedDataParallel(...)

Why stock DDP is not exact after a restart once a job has 3 or more ranks: DDP copies the
gradients into flat buckets and all-reduces each bucket. A process's first iteration uses
buckets with the parameters in model order; after it, DDP rebuilds them once, in the order
the gradients became ready (``prev_iteration_grad_ready_order_indices``), and keeps that
layout. A restarted rank runs one more such "first iteration" than a fault-free run did at
that step, so its buckets put every gradient element at another offset. A ring (or tree)
all-reduce adds the ranks' values of an element in an order that depends on the element's
offset in the buffer; a sum of three or more floats depends on the order, so the first
step after the restart rounds differently, and the weights part from the fault-free run's
(a sum of two does not depend on the order: world size 2 stays exact). See python/README.md
("Exact DDP at any world size") for the measurement.

:func:`exact_ddp` registers a DDP communication hook that never lets the collective add
anything: every element is summed on one rank, over the ranks' values in rank order
(``((g0 + g1) + g2) + ...``, each already divided by the world size, as DDP does), with
collectives that only copy: an all-gather for small buckets, an all-to-all (each rank sums
one slice) then an all-gather for large ones. Both give the same bits wherever an element
sits, in whatever bucket, so the layout no longer matters. PyTorch is imported when the
function is called (``import cumulus`` stays free of it).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Buckets whose all-gather moves at most this many bytes to a rank (the bucket's bytes
#: times the world size) are reduced with one all-gather; larger ones with an all-to-all
#: then an all-gather, which move as many bytes as a ring all-reduce does. Both paths give
#: the same bits.
DEFAULT_GATHER_MAX_BYTES = 1024 * 1024


class _RankOrderState:
    """What the hook needs: the DDP's process group, its size and backend, and the
    all-gather threshold."""

    def __init__(self, dist: Any, group: Any, gather_max_bytes: int) -> None:
        self.dist = dist
        self.group = group
        self.world_size: int = dist.get_world_size(group)
        # Gloo has no all_gather_into_tensor before PyTorch 2.2ish: the list form works
        # on every backend and version.
        self.gloo = str(dist.get_backend(group)).lower() == "gloo"
        self.gather_max_bytes = gather_max_bytes
        # Scratch tensors kept from one iteration to the next (a fresh large tensor costs
        # page faults every step), by purpose and bucket: about one more copy of the
        # gradients in all.
        self.scratch: dict[tuple[str, int], Any] = {}

    def buffer(self, purpose: str, bucket: Any, shape: tuple[int, ...]) -> Any:
        """A tensor of ``shape`` like the bucket's buffer (dtype, device), kept for the
        next iteration (whose result DDP has copied out by then)."""
        like = bucket.buffer()
        key = (purpose, bucket.index())
        t = self.scratch.get(key)
        if t is None or t.shape != shape or t.dtype != like.dtype or t.device != like.device:
            t = like.new_empty(shape)
            self.scratch[key] = t
        return t

    def all_gather(self, out: Any, tensor: Any) -> Any:
        """Starts an all-gather of ``tensor`` into the rows of ``out`` (world size by
        ``tensor.numel()``); returns its future."""
        if self.gloo:
            rows = list(out.unbind(0))
            work = self.dist.all_gather(rows, tensor, group=self.group, async_op=True)
        else:
            work = self.dist.all_gather_into_tensor(
                out.view(-1), tensor, group=self.group, async_op=True
            )
        return work.get_future()


def _sum_rows_in_rank_order(rows: Any) -> Any:
    """``rows[0] + rows[1] + ... `` element by element, left to right, into ``rows[0]``
    (an element-wise add has one rounding, whatever the element's position)."""
    total = rows[0]
    for r in range(1, rows.shape[0]):
        total.add_(rows[r])
    return total


def _reduce_in_rank_order(state: _RankOrderState, bucket: Any) -> Any:
    """The DDP communication hook: the bucket's mean over the ranks, each element summed
    in rank order (see the module's doc)."""
    buf = bucket.buffer()
    world = state.world_size
    buf.div_(world)
    n = buf.numel()
    if n * world * buf.element_size() <= state.gather_max_bytes:
        gathered = state.buffer("gather", bucket, (world, n))
        return state.all_gather(gathered, buf).then(lambda _: _sum_rows_in_rank_order(gathered))
    # Rank r sums slice r of every rank's bucket (the all-to-all hands it those slices),
    # then every rank gathers all the summed slices: into the bucket itself when it
    # splits evenly.
    size = -(-n // world)
    if size * world == n:
        padded = out = buf
    else:
        padded = out = state.buffer("padded", bucket, (size * world,))
        padded[:n].copy_(buf)
        padded[n:].zero_()
    slices = state.buffer("slices", bucket, (world, size))
    state.dist.all_to_all_single(slices.view(-1), padded, group=state.group)
    mine = _sum_rows_in_rank_order(slices)
    result = buf if out is buf else out[:n]
    return state.all_gather(out.view(world, size), mine).then(lambda _: result)


def exact_ddp(
    module: Any, /, *, gather_max_bytes: int = DEFAULT_GATHER_MAX_BYTES, **ddp_kwargs: Any
) -> Any:
    """A ``DistributedDataParallel`` whose gradients are averaged in an order that does
    not depend on DDP's bucket layout, so a job restarted from a checkpoint ends with the
    same weights, bit for bit, as a fault-free run at any world size.

    ``module`` is the model, wrapped here as ``DistributedDataParallel(module,
    **ddp_kwargs)``, or an existing ``DistributedDataParallel`` (then pass no
    ``ddp_kwargs``), whose communication hook is set. Either way the DDP is returned and
    the training step stays as it is. ``gather_max_bytes``: see
    :data:`DEFAULT_GATHER_MAX_BYTES` (it changes the speed, never the result).

    With 1 or 2 ranks no hook is set: a sum of two floats does not depend on the order,
    so DDP's own all-reduce gives these bits already.

    Raises ``ValueError`` for a bad argument, and whatever DDP raises: e.g. a
    ``RuntimeError`` when the DDP already has a communication hook (DDP allows one).
    Dense gradients only: sparse ones are untested. The large-bucket path needs
    ``all_to_all_single`` (NCCL; Gloo on CPU tensors). Tested with ``static_graph``,
    ``gradient_as_bucket_view`` and ``find_unused_parameters`` too.
    """
    if isinstance(gather_max_bytes, bool) or not isinstance(gather_max_bytes, int):
        raise ValueError(f"gather_max_bytes must be an int, not {gather_max_bytes!r}")
    if gather_max_bytes < 0:
        raise ValueError(f"gather_max_bytes must be >= 0, not {gather_max_bytes}")
    ddp_class = importlib.import_module("torch.nn.parallel").DistributedDataParallel
    if isinstance(module, ddp_class):
        if ddp_kwargs:
            raise ValueError(
                "exact_ddp got a DistributedDataParallel and DDP arguments "
                f"({', '.join(sorted(ddp_kwargs))}): pass the model to have it wrapped, "
                "or the DDP alone"
            )
        ddp = module
    else:
        ddp = ddp_class(module, **ddp_kwargs)
    dist = importlib.import_module("torch.distributed")
    state = _RankOrderState(dist, ddp.process_group, gather_max_bytes)
    if state.world_size <= 2:
        # One addition per element, and a + b == b + a: DDP's own all-reduce is exact
        # already, and gives the bits the hook would.
        return ddp
    # DDP checks the hook's annotations against its own classes (which this module does
    # not import): the lambda has none.
    ddp.register_comm_hook(state, lambda state, bucket: _reduce_in_rank_order(state, bucket))
    return ddp
