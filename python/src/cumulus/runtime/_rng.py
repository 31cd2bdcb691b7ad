"""The random number generators' state: capture it with a checkpoint, restore it on
resume, so that a resumed rank draws exactly the numbers the fault-free run drew.

Standard library only: NumPy and PyTorch are looked up in ``sys.modules``, never imported,
so :func:`rng_state` captures the generators of the frameworks the trainer itself
imported. :func:`set_rng_state` imports the ones the state holds.

The state is plain JSON (a generator's bytes are base64 text), never a tensor. That makes
the classic restore bug impossible: a ``torch.Generator`` state loaded with
``torch.load(..., map_location="cuda")`` is a CUDA tensor, which ``torch.set_rng_state``
refuses, so every resume fails the same way. Here nothing goes through ``map_location``,
and :func:`set_rng_state` builds the CPU ``ByteTensor`` torch asks for itself (it also
accepts tensors on any device, copied to the CPU first).
"""

from __future__ import annotations

import base64
import importlib
import random
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["RNG_STATE_VERSION", "rng_state", "set_rng_state"]

#: ``version`` of the state :func:`rng_state` returns.
RNG_STATE_VERSION = 1


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _tensor_bytes(t: Any) -> bytes:
    """The bytes of a ``uint8`` tensor on any device (copied to the CPU)."""
    return bytes(t.detach().to("cpu").contiguous().view(-1).tolist())


def _generator_device(g: Any) -> str:
    return str(g.device)


def _python_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def rng_state(*generators: Any) -> dict[str, Any]:
    """The state of every random number generator this process uses, as a JSON object
    (about 20 KiB; most of it the Mersenne Twisters'):

    * ``python``: the ``random`` module's;
    * ``numpy``: NumPy's global (legacy ``np.random``) generator, when NumPy is imported;
    * ``torch``: PyTorch's CPU generator, when torch is imported;
    * ``cuda``: every CUDA device's default generator, when CUDA is available;
    * ``generators``: the state and device of each ``torch.Generator`` (or NumPy
      ``Generator``/``RandomState``) passed in, in order.

    Save it with the checkpoint (``cumulus.ckpt.save(part, rng=cumulus.ckpt.RNG(g))``
    does) and restore it with :func:`set_rng_state` after loading the model.
    """
    state: dict[str, Any] = {"version": RNG_STATE_VERSION, "python": _python_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = _numpy_legacy(np.random)
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = _b64(_tensor_bytes(torch.get_rng_state()))
        if torch.cuda.is_available():
            state["cuda"] = [_b64(_tensor_bytes(s)) for s in torch.cuda.get_rng_state_all()]
    state["generators"] = [_generator_state(g) for g in generators]
    return state


def _numpy_legacy(rs: Any) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = rs.get_state(legacy=True)
    return {
        "name": str(name),
        "keys": [int(k) for k in keys],
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _generator_state(g: Any) -> dict[str, Any]:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(g, torch.Generator):
        return {
            "kind": "torch",
            "device": _generator_device(g),
            "state": _b64(_tensor_bytes(g.get_state())),
        }
    np = sys.modules.get("numpy")
    if np is not None and isinstance(g, np.random.Generator):
        return {"kind": "numpy.Generator", "state": _jsonable(g.bit_generator.state)}
    if np is not None and isinstance(g, np.random.RandomState):
        return {"kind": "numpy.RandomState", "state": _numpy_legacy(g)}
    if isinstance(g, random.Random):
        version, internal, gauss = g.getstate()
        return {"kind": "python", "state": [version, list(internal), gauss]}
    raise TypeError(
        f"cannot capture the state of a {type(g).__module__}.{type(g).__qualname__}: pass "
        "torch.Generator, numpy.random.Generator, numpy.random.RandomState or random.Random "
        "objects"
    )


def _jsonable(value: Any) -> Any:
    """NumPy's bit generator state (ints, dicts, arrays) as JSON values."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        return {"__array__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):  # a NumPy scalar
        return value.item()
    return value


def _unjsonable(value: Any, np: Any) -> Any:
    if isinstance(value, Mapping):
        if "__array__" in value:
            return np.array(value["__array__"], dtype=value["dtype"])
        return {k: _unjsonable(v, np) for k, v in value.items()}
    if isinstance(value, list):
        return [_unjsonable(v, np) for v in value]
    return value


def _byte_tensor(torch: Any, value: Any) -> Any:
    """A CPU ``ByteTensor`` from base64 text, bytes, or a tensor on any device."""
    if isinstance(value, str):
        data = base64.b64decode(value, validate=True)
    elif isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif hasattr(value, "detach"):
        # A tensor: e.g. a state saved with torch.save and loaded with map_location="cuda".
        return value.detach().to(device="cpu", dtype=torch.uint8).contiguous()
    else:
        raise TypeError(f"expected a generator state (base64 text), got {type(value).__name__}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def _numpy_tuple(np: Any, s: Mapping[str, Any]) -> tuple[Any, ...]:
    return (
        s["name"],
        np.array(s["keys"], dtype=np.uint32),
        int(s["pos"]),
        int(s["has_gauss"]),
        float(s["cached_gaussian"]),
    )


def set_rng_state(state: Mapping[str, Any], *generators: Any, strict: bool = True) -> None:
    """Restores what :func:`rng_state` captured, and each generator passed in from the
    state of the generator passed to :func:`rng_state` at the same position.

    Generator states are always restored through CPU tensors, whatever device (or
    ``map_location``) the state went through; a CUDA generator gets its own device's
    state.

    :param strict: raise when the state and this process differ (another number of CUDA
        devices or of generators, a generator on another device type). With
        ``strict=False`` what matches is restored and the rest left alone (the resume is
        then not exact).
    :raises ValueError: the state is not one :func:`rng_state` made, or (``strict``) it
        does not match this process.
    :raises TypeError: a generator is of an unsupported type.
    """
    if not isinstance(state, Mapping) or state.get("version") != RNG_STATE_VERSION:
        raise ValueError(
            f"not an RNG state made by cumulus.runtime.rng_state() (version {RNG_STATE_VERSION})"
        )
    saved = list(state.get("generators") or [])
    if strict and len(saved) != len(generators):
        raise ValueError(
            f"the RNG state holds {len(saved)} generator(s) but {len(generators)} were "
            "passed: pass the same generators, in the same order, as to rng_state()"
        )

    # Check everything before changing anything.
    torch: Any = None
    if "torch" in state or "cuda" in state or any(s.get("kind") == "torch" for s in saved):
        torch = importlib.import_module("torch")
    cuda_states: list[Any] = []
    if "cuda" in state:
        n_saved = len(state["cuda"])
        n_here = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if strict and n_saved != n_here:
            raise ValueError(
                f"the RNG state holds {n_saved} CUDA device(s), this process sees {n_here}: "
                "an exact resume needs the same devices (strict=False restores what matches)"
            )
        cuda_states = [_byte_tensor(torch, s) for s in state["cuda"][:n_here]]
    for i, (g, s) in enumerate(zip(generators, saved, strict=False)):
        if s.get("kind") == "torch":
            here = _generator_device(g).split(":")[0]
            there = str(s.get("device", "cpu")).split(":")[0]
            if here != there and strict:
                raise ValueError(
                    f"generator {i} is on {_generator_device(g)} but its state was saved "
                    f"from one on {s.get('device')}"
                )

    py = state.get("python")
    if py is not None:
        random.setstate((int(py[0]), tuple(int(x) for x in py[1]), py[2]))
    if "numpy" in state:
        np = importlib.import_module("numpy")
        np.random.set_state(_numpy_tuple(np, state["numpy"]))
    if torch is not None and "torch" in state:
        torch.set_rng_state(_byte_tensor(torch, state["torch"]))
    if cuda_states:
        torch.cuda.set_rng_state_all(cuda_states)
    for g, s in zip(generators, saved, strict=False):
        kind = s.get("kind")
        if kind == "torch":
            g.set_state(_byte_tensor(torch, s["state"]))
        elif kind == "numpy.Generator":
            np = importlib.import_module("numpy")
            g.bit_generator.state = _unjsonable(s["state"], np)
        elif kind == "numpy.RandomState":
            np = importlib.import_module("numpy")
            g.set_state(_numpy_tuple(np, s["state"]))
        elif kind == "python":
            py = s["state"]
            g.setstate((int(py[0]), tuple(int(x) for x in py[1]), py[2]))
        else:
            raise ValueError(f"unknown generator kind {kind!r} in the RNG state")
