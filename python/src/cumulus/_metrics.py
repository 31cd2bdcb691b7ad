"""Metric values on JSON wires (``cumulus_api::metric_json``): JSON has no NaN or
infinities, yet a diverging run reports them. A finite value is a JSON number; NaN is the
string :data:`~cumulus._contract.METRIC_JSON_NAN` (``"NaN"``), +inf
:data:`~cumulus._contract.METRIC_JSON_INFINITY` (``"Infinity"``) and -inf
:data:`~cumulus._contract.METRIC_JSON_NEG_INFINITY` (``"-Infinity"``). The rank runtime
writes this form in its progress reports; :mod:`cumulus.models` reads it from the
coordinator's answers. Standard library only.
"""

from __future__ import annotations

import math

from cumulus import _contract

__all__ = ["decode", "encode"]

_SPELLINGS: dict[str, float] = {
    _contract.METRIC_JSON_NAN: math.nan,
    _contract.METRIC_JSON_INFINITY: math.inf,
    _contract.METRIC_JSON_NEG_INFINITY: -math.inf,
}


def encode(value: float) -> float | str:
    """``value`` as the JSON wire carries it: itself when finite, else its string."""
    if math.isnan(value):
        return _contract.METRIC_JSON_NAN
    if math.isinf(value):
        return _contract.METRIC_JSON_INFINITY if value > 0 else _contract.METRIC_JSON_NEG_INFINITY
    return value


def decode(value: object) -> float | None:
    """The float a JSON metric value stands for: a number (``bool`` is not one), one of
    the three strings exactly, or ``null`` (what a JSON writer without this convention,
    serde_json, writes for a non-finite value) as NaN; ``None`` for anything else."""
    if value is None:
        return math.nan
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return _SPELLINGS.get(value)
    return None
