"""Elastic world size: a job submitted with ``world_size=(MIN, MAX)`` (``cumulusctl
submit --world-size MIN:MAX``) may run with fewer ranks after a worker is lost and
grow back at a checkpoint boundary. Each change restarts every rank from the committed
step with a new ``WORLD_SIZE``; the records no rank had consumed at that step are dealt
over the new ranks exactly once by the leader's planner, and every rank learns its share
from its *data plan* (``CUMULUS_DATA_PLAN``, :func:`data_plan`).

:class:`ElasticData` follows the plan: it hands out this rank's records epoch by epoch
(a :class:`~cumulus.runtime.ShardReader` per epoch), and :meth:`ElasticData.state` is
the position the leader needs, to put in every checkpoint's ``state`` under
``"cumulus_data"``. A ``carry`` saved with it (a running count or digest of the records
consumed, at most 1 KiB of JSON) is handed, after a resize, to the rank that takes over
those records (:attr:`ElasticData.carried`).

A job with a fixed world size has no plan: :class:`ElasticData` then reads the rank's
shards every epoch, and its state resumes the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cumulus._contract import (
    RANK_DATA_STATE_KEY,
    RANK_ENV_DATA_PLAN,
    RANK_MAX_DATA_CARRY_BYTES,
)
from cumulus.errors import RankEnvironmentError
from cumulus.runtime._shards import ShardFormat, ShardReader

__all__ = ["DATA_STATE_KEY", "DataPlan", "ElasticData", "data_plan"]

#: The key of the data position in a checkpoint's ``state`` (the rank contract's).
DATA_STATE_KEY: str = RANK_DATA_STATE_KEY

#: Largest plan file read, in bytes.
_MAX_PLAN_BYTES = 64 << 20


@dataclass(frozen=True)
class DataPlan:
    """This rank's data plan (``CUMULUS_DATA_PLAN``), as the leader wrote it."""

    #: Ranks the job runs with now (``WORLD_SIZE``).
    world_size: int
    #: Ranks before the latest resize (``world_size`` when there was none).
    previous_world_size: int
    #: The committed step the current ranks started from (``None``: the job's start).
    from_step: int | None
    #: The epoch the plan's ranks start in.
    start_epoch: int
    #: This rank's segments, ``(shard path, first record)``, for the epochs listed; every
    #: other epoch reads the rank's shards file whole.
    epochs: Mapping[int, tuple[tuple[Path, int], ...]] = field(default_factory=dict)
    #: The ``carry`` values of the old ranks whose records this rank took over.
    carry: tuple[Any, ...] = ()

    @property
    def resized(self) -> bool:
        """Whether the job's world size changed at its latest resize."""
        return self.world_size != self.previous_world_size


def _int(doc: Mapping[str, Any], key: str, path: str) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RankEnvironmentError(f"data plan {path}: {key} is not an int >= 0: {value!r}")
    return value


def data_plan(env: Mapping[str, str] | None = None) -> DataPlan | None:
    """This rank's data plan, or ``None`` for a job without one (a fixed world size, or
    outside a Cumulus rank).

    :raises RankEnvironmentError: the plan file cannot be read or is malformed.
    """
    path = (os.environ if env is None else env).get(RANK_ENV_DATA_PLAN)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_PLAN_BYTES + 1)
        doc = json.loads(raw)
    except (OSError, ValueError) as e:
        raise RankEnvironmentError(f"cannot read the data plan {path}: {e}") from e
    if len(raw) > _MAX_PLAN_BYTES or not isinstance(doc, dict):
        raise RankEnvironmentError(f"data plan {path} is not a JSON object of at most 64 MiB")
    epochs: dict[int, tuple[tuple[Path, int], ...]] = {}
    for key, segments in (doc.get("epochs") or {}).items():
        if not str(key).isdigit() or not isinstance(segments, list):
            raise RankEnvironmentError(f"data plan {path}: bad epoch {key!r}")
        epochs[int(key)] = tuple(
            (Path(str(s["shard"])), _int(s, "first_record", path)) for s in segments
        )
    from_step = doc.get("from_step")
    return DataPlan(
        world_size=_int(doc, "world_size", path),
        previous_world_size=_int(doc, "previous_world_size", path),
        from_step=None if from_step is None else _int(doc, "from_step", path),
        start_epoch=_int(doc, "start_epoch", path),
        epochs=epochs,
        carry=tuple(doc.get("carry") or ()),
    )


class ElasticData:
    """This rank's records, epoch by epoch, as its job's data plan deals them.

    ::

        data = ElasticData()
        point = runtime.resume()
        data.restore(point.state if point else None, resume_step=point and point.step)
        while data.epoch < epochs:
            for record in data.reader():      # the rest of this epoch's records
                ...                            # data.state() after each step
            data.next_epoch()

    :param shard_paths: the rank's shards (default: its context's, ``CUMULUS_SHARDS_FILE``);
        the epochs the plan does not list read them whole.
    :param plan: the data plan (default: :func:`data_plan`).
    :param format: as :class:`ShardReader`'s.
    :param csv_header: as :class:`ShardReader`'s.
    """

    def __init__(
        self,
        shard_paths: tuple[Path, ...] | None = None,
        *,
        plan: DataPlan | None = None,
        format: ShardFormat | None = None,
        csv_header: bool = False,
    ) -> None:
        if shard_paths is None:
            from cumulus.runtime._env import get_context

            shard_paths = get_context(standalone=True).shard_paths
        self._shards = tuple(shard_paths)
        self.plan: DataPlan | None = plan if plan is not None else data_plan()
        self._format = format
        self._csv_header = csv_header
        #: The current epoch (0-based).
        self.epoch = 0
        #: The ``carry`` values this attempt took over from the ranks before a resize
        #: (empty unless :meth:`restore` started a new plan).
        self.carried: tuple[Any, ...] = ()
        #: Whether this attempt started a new data plan (the job was resized at the step
        #: it resumed from).
        self.started_plan = False
        self._reader: ShardReader | None = None
        self._position: Mapping[str, Any] | None = None

    def restore(self, state: Mapping[str, Any] | None, resume_step: int | None = None) -> None:
        """Moves to where this attempt starts: the plan's start (its first epoch,
        with the old ranks' carry in :attr:`carried`) when the job was resized at
        ``resume_step``, else the position saved in ``state`` (a checkpoint's state with
        :meth:`state` under ``"cumulus_data"``), else the beginning.

        :raises ValueError: the saved position is malformed.
        """
        plan = self.plan
        if plan is not None and plan.from_step is not None and plan.from_step == resume_step:
            self.epoch = plan.start_epoch
            self.carried = plan.carry
            self.started_plan = True
            self._position = None
            self._reader = None
            return
        data = (state or {}).get(DATA_STATE_KEY)
        if data is None:
            return
        if not isinstance(data, Mapping):
            raise ValueError(f"{DATA_STATE_KEY} is not an object: {data!r}")
        self.epoch = int(data["epoch"])
        self._position = {"shard": int(data["segment"]), "record": int(data["record"])}
        self._reader = None

    def segments(self, epoch: int | None = None) -> tuple[tuple[Path, int], ...]:
        """This rank's segments of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self.plan is not None and epoch in self.plan.epochs:
            return self.plan.epochs[epoch]
        return tuple((p, 0) for p in self._shards)

    def reader(self) -> ShardReader:
        """The current epoch's records from the current position (the same reader until
        :meth:`next_epoch`)."""
        if self._reader is None:
            segments = self.segments()
            reader = ShardReader(
                [p for p, _ in segments],
                format=self._format,
                csv_header=self._csv_header,
                first_records=[n for _, n in segments],
            )
            if self._position is not None:
                reader.restore(self._position)
                self._position = None
            self._reader = reader
        return self._reader

    def next_epoch(self) -> None:
        """Moves to the start of the next epoch."""
        if self._reader is not None:
            self._reader.close()
        self.epoch += 1
        self._reader = None
        self._position = None

    def state(self, carry: Any = None) -> dict[str, Any]:
        """The position for a checkpoint's ``state["cumulus_data"]``: ``epoch``,
        ``segment``, ``record`` (the next record), and ``carry`` (any JSON value of at most
        1 KiB, handed on at a resize; ``None`` to leave it out).

        :raises ValueError: ``carry`` is larger than 1 KiB of JSON.
        """
        if self._reader is not None:
            pos = self._reader.state()
            segment, record = int(pos["shard"]), int(pos["record"])
        elif self._position is not None:
            segment, record = int(self._position["shard"]), int(self._position["record"])
        else:
            segment, record = 0, 0
        out: dict[str, Any] = {"epoch": self.epoch, "segment": segment, "record": record}
        if carry is not None:
            size = len(json.dumps(carry, separators=(",", ":")))
            if size > RANK_MAX_DATA_CARRY_BYTES:
                raise ValueError(
                    f"carry is {size} bytes of JSON, more than {RANK_MAX_DATA_CARRY_BYTES}"
                )
            out["carry"] = carry
        return out
