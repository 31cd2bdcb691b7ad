"""``EpochSampler``: the position of a rank in in-memory data, epoch after epoch, as a
small JSON value, so a resumed rank continues at the exact record.

``torch.utils.data.DistributedSampler`` shuffles each epoch from ``seed + epoch`` but
knows no position inside an epoch: a run resumed mid-epoch starts the epoch over (or
skips it). This sampler hands out record indices batch by batch, each epoch in its own
order (a permutation derived from the seed and the epoch alone), and its :meth:`state`
(``epoch``, ``offset``, ``seed``...) is all a resume needs: no permutation tensor and no
generator state to checkpoint, so nothing that a rebinding (``perm = randperm(...)``)
could leave stale.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

__all__ = ["EpochSampler"]

#: ``format`` of :meth:`EpochSampler.state`.
_STATE_FORMAT = 1


def _int(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


class EpochSampler:
    """Indices into ``n`` in-memory records, epoch after epoch: :meth:`take` returns the
    next ones, moving to the next epoch (in a new order) when one is used up. Put
    :meth:`state` in a checkpoint's JSON ``state`` and :meth:`restore` it on resume, or
    checkpoint the sampler itself with :mod:`cumulus.ckpt` (it has ``state_dict()`` /
    ``load_state_dict()``): the resumed rank takes the very next record.

    :param n: how many records (indices ``0..n-1``).
    :param seed: the shuffle's seed; epoch ``e``'s order is a function of ``(seed, e)``
        only (Python's ``random.Random`` seeded from both), the same on every machine
        and every run.
    :param shuffle: ``False``: every epoch in index order.
    :param rank: this rank, with ``world_size`` > 1: every rank shuffles all ``n``
        records the same way (pass the same ``seed`` on every rank) and takes every
        ``world_size``-th one from position ``rank``, ``n // world_size`` per epoch (the
        rest of that epoch's order is left out, as ``DistributedSampler(drop_last=True)``
        does), so that the ranks' epochs have the same length. Leave both at their
        defaults when each rank holds its own records (its Cumulus shards), with a seed
        of its own.
    :param world_size: the number of ranks sharing the records (see ``rank``).
    :raises ValueError: an argument is out of range (``n // world_size`` must be >= 1).
    """

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.n = _int("n", n, 1)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be a bool, got {shuffle!r}")
        self.world_size = _int("world_size", world_size, 1)
        self.rank = _int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank {rank} is not below world_size {world_size}")
        if n // world_size < 1:
            raise ValueError(f"{n} records cannot be shared by {world_size} ranks")
        self.seed = seed
        self.shuffle = shuffle
        #: The epoch of the last index taken (0 first).
        self.epoch = 0
        #: Indices of :attr:`epoch` taken so far (``0..epoch_length``).
        self.offset = 0
        #: Indices taken since the start, over every epoch.
        self.taken = 0
        self._order: list[int] = []
        self._order_epoch = -1

    def __repr__(self) -> str:
        return (
            f"EpochSampler(n={self.n}, epoch={self.epoch}, offset={self.offset}, "
            f"seed={self.seed}, rank={self.rank}, world_size={self.world_size})"
        )

    @property
    def epoch_length(self) -> int:
        """Indices this rank takes per epoch: ``n`` (``n // world_size`` with several
        ranks)."""
        return self.n // self.world_size

    def order(self, epoch: int | None = None) -> list[int]:
        """This rank's indices of ``epoch`` (default: the current one), in the order
        :meth:`take` hands them out. Shuffling takes about half a second per million
        records (computed once per epoch, and kept)."""
        epoch = self.epoch if epoch is None else _int("epoch", epoch, 0)
        if epoch == self._order_epoch:
            return self._order
        order = list(range(self.n))
        if self.shuffle:
            # A str seed is hashed (SHA-512): stable across runs, machines and versions.
            random.Random(f"cumulus.EpochSampler:{self.seed}:{epoch}").shuffle(order)
        if self.world_size > 1:
            order = order[self.rank :: self.world_size][: self.epoch_length]
        if epoch == self.epoch:
            self._order, self._order_epoch = order, epoch
        return order

    def take(self, k: int) -> list[int]:
        """The next ``k`` indices; when the epoch is used up, the next epoch starts (a
        batch may span the end of one epoch and the start of the next).

        :raises ValueError: ``k`` is not an int >= 1.
        """
        _int("k", k, 1)
        out: list[int] = []
        length = self.epoch_length
        while len(out) < k:
            if self.offset == length:
                self.epoch, self.offset = self.epoch + 1, 0
            order = self.order()
            m = min(k - len(out), length - self.offset)
            out.extend(order[self.offset : self.offset + m])
            self.offset += m
        self.taken += k
        return out

    def state(self) -> dict[str, Any]:
        """The position, as a JSON object (a few dozen bytes): ``epoch``, ``offset``,
        ``taken``, and what it is only valid for (``n``, ``seed``, ``shuffle``, ``rank``,
        ``world_size``)."""
        return {
            "format": _STATE_FORMAT,
            "n": self.n,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": self.epoch,
            "offset": self.offset,
            "taken": self.taken,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Moves to the position ``state`` (from :meth:`state`): the next :meth:`take`
        continues exactly where the saved sampler's would have.

        :raises ValueError: ``state`` is malformed, or was taken by a sampler over other
            records (another ``n``, ``seed``, ``shuffle``, ``rank`` or ``world_size``).
        """
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise ValueError(f"not an EpochSampler state: {state!r}")
        mine = self.state()
        keys = ("n", "seed", "shuffle", "rank", "world_size")
        theirs = {k: state.get(k) for k in keys}
        ours = {k: mine[k] for k in keys}
        if theirs != ours:
            raise ValueError(
                f"the EpochSampler state was taken over other records ({theirs}) than this "
                f"sampler's ({ours})"
            )
        epoch = _int("epoch", state.get("epoch"), 0)
        offset = _int("offset", state.get("offset"), 0)
        taken = _int("taken", state.get("taken"), 0)
        if offset > self.epoch_length:
            raise ValueError(f"offset {offset} is past the epoch's {self.epoch_length} indices")
        self.epoch, self.offset, self.taken = epoch, offset, taken

    def state_dict(self) -> dict[str, Any]:
        """:meth:`state`, under the name :mod:`cumulus.ckpt` (and PyTorch) look for."""
        return self.state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """:meth:`restore`, under the name :mod:`cumulus.ckpt` (and PyTorch) look for."""
        self.restore(state)
