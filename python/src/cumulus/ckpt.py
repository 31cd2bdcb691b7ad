"""Framework checkpoints: ``save(dir, **objects)`` writes named objects into a directory
(a checkpoint part's staging dir), ``load(dir, **objects)`` restores them into the objects
the caller passes (so a model on a GPU stays on it).

::

    from cumulus import ckpt, runtime

    g = torch.Generator().manual_seed(seed)               # e.g. the data order
    if ckpt.load_checkpoint(model=model, optimizer=opt, rng=ckpt.RNG(g)) is not None:
        ...                                              # resumed, bit for bit
    for step in ...:
        ...
        if step % 100 == 0 and runtime.checkpoints_enabled():
            ckpt.save_checkpoint(step, model=model, optimizer=opt, rng=ckpt.RNG(g))

:func:`save_checkpoint_async` blocks the loop only while it copies the state to host
memory, then writes and commits that snapshot in the background (the same files, byte
for byte); :func:`wait_pending` or :meth:`PendingCheckpoint.wait` wait for the commit.

The adapter is chosen by the object's type:

* a PyTorch module (``DistributedDataParallel``/``DataParallel``/``torch.compile``
  wrappers are unwrapped, so a checkpoint loads into the bare model and back), an
  optimizer, an LR scheduler, a ``GradScaler`` — anything with ``state_dict()`` and
  ``load_state_dict()``: the state dict's tensors go to ``<name>.safetensors`` (copied to
  the CPU), the rest to JSON in the index. A state dict with values neither JSON nor
  tensors is written with ``torch.save`` to ``<name>.pt`` and read back with
  ``torch.load(weights_only=True)``: loading never runs arbitrary pickle code;
* a ``torch.Tensor``: ``<name>.safetensors``, copied back in place;
* :class:`RNG`: the state of every random number generator (Python, NumPy, torch CPU,
  every CUDA device, and the generators it holds) as JSON, see
  :func:`cumulus.runtime.rng_state`. Restored through CPU tensors whatever device the
  generators live on, so the ``map_location`` bug cannot happen;
* a NumPy array: ``<name>.npy`` (no pickle), copied back in place;
* a scikit-learn estimator (a pipeline too): ``<name>.skops``, written with
  ``skops.io.dump``. Loading never runs arbitrary pickle code: every type in the file that
  skops does not trust itself must be a class defined in scikit-learn, the class of the
  object passed to :func:`load`, or a type named with :class:`Trusted`; anything else
  raises :class:`UntrustedTypes` before the file is loaded. The loaded state replaces the
  passed estimator's (same class);
* an XGBoost ``Booster``, or one of its scikit-learn wrappers (``XGBClassifier``...):
  ``<name>.ubj``, XGBoost's own model format (UBJSON), loaded back with ``load_model``;
* a LightGBM ``Booster``: ``<name>.txt``, LightGBM's own text model format (every
  iteration), loaded back with ``model_from_string``. (Its scikit-learn wrappers: save
  their ``booster_``.);
* a TensorFlow ``tf.train.Checkpoint``, or a trackable object (a Keras model, an
  optimizer, a ``tf.Module``, a variable), wrapped in ``tf.train.Checkpoint(root=obj)``:
  written with ``write()`` under ``<name>.tf/`` and restored with ``read()`` into the object
  passed (every variable it has must be in the checkpoint);
* a JSON value (``None``, bool, int, float, str, lists and dicts of them): in the index;
  :func:`load` returns it.

Pass ``None`` to :func:`load` for a name to get what was saved without restoring it into
anything (tensors on the CPU): ``load(part, model=None)["model"]`` is the model's state
dict. The index, ``cumulus-ckpt.json``, names every object, its kind and its files.

Only the standard library is imported here; each framework is imported when an object
needs it, and a missing one names the extra to install: ``pip install
'cumulus-train[torch]'`` (PyTorch, safetensors, NumPy), ``[sklearn]`` (scikit-learn,
skops), ``[xgboost]``, ``[lightgbm]``, ``[tensorflow]``. An object's type is recognized
only when its framework is already imported (by the caller, who made the object).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

from cumulus import runtime
from cumulus.runtime import CommittedPart, PendingCheckpoint, ResumePoint

__all__ = [
    "FORMAT_VERSION",
    "INDEX_FILE",
    "RNG",
    "PendingCheckpoint",
    "StaleObject",
    "Trusted",
    "UntrustedTypes",
    "load",
    "load_checkpoint",
    "read_index",
    "release_async_buffers",
    "save",
    "save_checkpoint",
    "save_checkpoint_async",
    "wait_pending",
]

#: The index of a framework checkpoint, in its directory.
INDEX_FILE = "cumulus-ckpt.json"
#: ``format`` of the index.
FORMAT_VERSION = 1

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}")
_EXTRA = {
    "torch": "torch",
    "safetensors": "torch",
    "numpy": "torch",
    "sklearn": "sklearn",
    "skops": "sklearn",
    "xgboost": "xgboost",
    "lightgbm": "lightgbm",
    "tensorflow": "tensorflow",
}


class RNG:
    """Stands for the state of every random number generator of this process in
    :func:`save` and :func:`load`, plus ``generators`` (``torch.Generator``, NumPy
    ``Generator``/``RandomState``, ``random.Random``) in order: pass the same ones, in the
    same order, to both."""

    def __init__(self, *generators: Any, strict: bool = True) -> None:
        self.generators = generators
        #: See :func:`cumulus.runtime.set_rng_state`.
        self.strict = strict

    def __repr__(self) -> str:
        return f"RNG({len(self.generators)} generator(s))"


class Trusted:
    """Wraps an object passed to :func:`load` with the extra types its skops file may hold
    (fully qualified names, as :class:`UntrustedTypes` lists them, or the types
    themselves): ``load(part, model=Trusted(model, "mylib.MyTransformer"))``. Only
    scikit-learn estimators read it. :func:`save` accepts it too (it saves ``obj``)."""

    def __init__(self, obj: Any, *types: str | type) -> None:
        self.obj = obj
        self.types = frozenset(t if isinstance(t, str) else _qualname(t) for t in types)

    def __repr__(self) -> str:
        return f"Trusted({type(self.obj).__qualname__}, {sorted(self.types)})"


class UntrustedTypes(Exception):
    """A skops file holds types that are not trusted (see :class:`Trusted`); nothing was
    loaded. ``types``: their fully qualified names."""

    def __init__(self, path: Path, types: list[str]) -> None:
        self.types = types
        super().__init__(
            f"{path} holds types that are not trusted, so it was not loaded: "
            f"{', '.join(types)}. If you trust them, pass the object as "
            f"cumulus.ckpt.Trusted(obj, {', '.join(repr(t) for t in types)})"
        )


class StaleObject(ValueError):
    """A tensor or array passed to a save under a name is not what the calling code's
    variable of that name holds now: the variable was rebound (``perm =
    torch.randperm(...)``) after the object was collected, e.g. into a dict of objects
    made once, so the checkpoint would hold the old value and a resume would silently
    diverge. Nothing was saved. Pass the objects at each call (``perm=perm``), or update
    the collected one in place (``perm.copy_(...)``). ``name``: the object's name."""

    def __init__(self, name: str, where: str, saved: str, current: str) -> None:
        self.name = name
        super().__init__(
            f"{name!r} passed to the checkpoint ({saved}) is not what the variable {name!r} "
            f"holds now at {where} ({current}, other values): it was rebound after the "
            f"object was collected, and the checkpoint would hold the old one. Pass "
            f"{name}={name} at each save, or update the collected object in place "
            f"({name}.copy_(...) / {name}[...] = ...)"
        )


def _qualname(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = _EXTRA.get(module.split(".")[0], module)
        raise ImportError(
            f"this checkpoint needs {module}, which is not installed: "
            f"pip install 'cumulus-train[{extra}]'"
        ) from e


# -- kinds -------------------------------------------------------------------------------


def _unwrap_module(m: Any) -> Any:
    """The model inside DDP / DataParallel / ``torch.compile`` wrappers."""
    torch = sys.modules["torch"]
    while True:
        if isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) or (
            type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod")
        ):
            m = m.module if hasattr(m, "module") else m._orig_mod
        else:
            return m


def _kind(obj: Any) -> str:
    if isinstance(obj, RNG):
        return "rng"
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(obj, torch.nn.Module):
            return "torch.module"
        if isinstance(obj, torch.Tensor):
            return "torch.tensor"
        if isinstance(obj, torch.optim.Optimizer):
            return "torch.optimizer"
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return "numpy.ndarray"
    # The boosting libraries first: their scikit-learn wrappers are estimators too.
    xgb = sys.modules.get("xgboost")
    if xgb is not None:
        if isinstance(obj, xgb.Booster):
            return "xgboost.booster"
        if isinstance(obj, xgb.XGBModel):
            return "xgboost.model"
    lgb = sys.modules.get("lightgbm")
    if lgb is not None:
        if isinstance(obj, lgb.Booster):
            return "lightgbm.booster"
        if isinstance(obj, lgb.LGBMModel):
            raise TypeError(
                f"cannot checkpoint a {_qualname(type(obj))}: checkpoint its booster_ "
                "(a lightgbm.Booster, in LightGBM's own model format) instead"
            )
    tf = sys.modules.get("tensorflow")
    # A Checkpoint, or anything it can track: Keras models and optimizers, tf.Module...
    if tf is not None and isinstance(
        obj, (tf.train.Checkpoint, tf.__internal__.tracking.Trackable)
    ):
        return "tensorflow"
    skl = sys.modules.get("sklearn.base")
    if skl is not None and isinstance(obj, skl.BaseEstimator):
        return "sklearn"
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        # LR schedulers, GradScaler, torchmetrics, anything with the protocol.
        return "state_dict"
    if _is_json(obj):
        return "json"
    raise TypeError(
        f"cannot checkpoint a {type(obj).__module__}.{type(obj).__qualname__}: supported are "
        "PyTorch modules, optimizers, tensors and objects with state_dict()/"
        "load_state_dict(), cumulus.ckpt.RNG, NumPy arrays, scikit-learn estimators, "
        "XGBoost and LightGBM boosters, TensorFlow checkpoints and trackables (Keras "
        "models), and JSON values"
    )


def _is_json(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, str)):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, (list, tuple)):
        return all(_is_json(x) for x in v)
    if isinstance(v, Mapping):
        return all(isinstance(k, str) and _is_json(x) for k, x in v.items())
    return False


# -- nested state dicts: JSON tree + tensors ------------------------------------------------


class _NotEncodable(Exception):
    pass


def _encode(v: Any, tensors: dict[str, Any]) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        if v.is_sparse or v.is_quantized or v.layout != torch.strided:
            raise _NotEncodable(f"a {v.layout} tensor")
        key = str(len(tensors))
        tensors[key] = v
        return {"__tensor__": key}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"__float__": repr(v)}
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x, tensors) for x in v]}
    if isinstance(v, list):
        return [_encode(x, tensors) for x in v]
    if isinstance(v, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in v):
            return {k: _encode(x, tensors) for k, x in v.items()}
        return {"__dict__": [[_encode(k, tensors), _encode(x, tensors)] for k, x in v.items()]}
    raise _NotEncodable(f"a {type(v).__module__}.{type(v).__qualname__}")


def _decode(v: Any, tensors: Mapping[str, Any]) -> Any:
    if isinstance(v, list):
        return [_decode(x, tensors) for x in v]
    if isinstance(v, dict):
        if "__tensor__" in v:
            return tensors[v["__tensor__"]]
        if "__float__" in v:
            return float(v["__float__"])
        if "__tuple__" in v:
            return tuple(_decode(x, tensors) for x in v["__tuple__"])
        if "__dict__" in v:
            return {_decode(k, tensors): _decode(x, tensors) for k, x in v["__dict__"]}
        return {k: _decode(x, tensors) for k, x in v.items()}
    return v


def _cpu_tensors(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Contiguous CPU tensors sharing no storage (what safetensors accepts)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for key, t in tensors.items():
        t = t.detach().to("cpu")
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or not t.is_contiguous():
            t = t.clone(memory_format=sys.modules["torch"].contiguous_format)
        elif t.numel() > 0:
            seen.add(ptr)
        out[key] = t
    return out


class _State:
    """A state dict (or tensor) as :func:`save` writes it: a JSON ``tree`` and the
    ``tensors`` it refers to (``<name>.safetensors``), or, when it holds values neither
    JSON nor tensors, the value itself (``pickled``, written with ``torch.save``)."""

    __slots__ = ("pickled", "tensors", "tree")

    def __init__(
        self, tree: Any = None, tensors: dict[str, Any] | None = None, pickled: Any = None
    ) -> None:
        self.tree = tree
        self.tensors = tensors
        self.pickled = pickled


def _capture_state(state: Any, staging: _Staging | None, name: str) -> _State:
    """``state`` as it will be written; with ``staging``, a snapshot that later training
    cannot change (tensors copied into host buffers, a pickled value deep-copied)."""
    tensors: dict[str, Any] = {}
    try:
        tree = _encode(state, tensors)  # a new tree: JSON values and tensor references
    except _NotEncodable:
        return _State(pickled=copy.deepcopy(state) if staging is not None else state)
    if staging is not None:
        tensors = {key: staging.copy(name, key, t) for key, t in tensors.items()}
    return _State(tree=tree, tensors=tensors)


def _write_state(directory: Path, name: str, state: _State) -> dict[str, Any]:
    if state.tensors is None:
        torch = _import("torch")
        torch.save(state.pickled, directory / f"{name}.pt")
        return {"files": [f"{name}.pt"], "encoding": "torch.save"}
    entry: dict[str, Any] = {"tree": state.tree, "encoding": "safetensors"}
    if state.tensors:
        st = _import("safetensors.torch")
        st.save_file(_cpu_tensors(state.tensors), str(directory / f"{name}.safetensors"))
        entry["files"] = [f"{name}.safetensors"]
    else:
        entry["files"] = []
    return entry


def _load_state(directory: Path, name: str, entry: Mapping[str, Any]) -> Any:
    if entry.get("encoding") == "torch.save":
        torch = _import("torch")
        return torch.load(directory / f"{name}.pt", map_location="cpu", weights_only=True)
    tensors: dict[str, Any] = {}
    if entry.get("files"):
        st = _import("safetensors.torch")
        tensors = st.load_file(str(directory / f"{name}.safetensors"), device="cpu")
    return _decode(entry["tree"], tensors)


# -- scikit-learn, XGBoost, LightGBM, TensorFlow ----------------------------------------------

_FRAMEWORKS = ("sklearn", "xgboost.booster", "xgboost.model", "lightgbm.booster", "tensorflow")


def _save_framework(d: Path, name: str, kind: str, obj: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": _qualname(type(obj))}
    if kind == "sklearn":
        sio = _import("skops.io")
        sio.dump(obj, d / f"{name}.skops")
        entry["files"] = [f"{name}.skops"]
    elif kind == "xgboost.booster":
        (d / f"{name}.ubj").write_bytes(bytes(obj.save_raw(raw_format="ubj")))
        entry["files"] = [f"{name}.ubj"]
    elif kind == "xgboost.model":
        obj.save_model(str(d / f"{name}.ubj"))  # the format follows the extension
        entry["files"] = [f"{name}.ubj"]
    elif kind == "lightgbm.booster":
        text = obj.model_to_string(num_iteration=-1)  # every iteration, not the best
        (d / f"{name}.txt").write_text(text, encoding="utf-8")
        entry["files"] = [f"{name}.txt"]
    else:  # tensorflow
        tf = sys.modules["tensorflow"]
        ck = obj if isinstance(obj, tf.train.Checkpoint) else tf.train.Checkpoint(root=obj)
        entry["wrapped"] = ck is not obj
        ck.write(str(d / f"{name}.tf" / "ckpt"))
        entry["files"] = [f"{name}.tf"]
    return entry


def _trusted_sklearn_class(name: str) -> bool:
    """``name`` is a class defined in scikit-learn (not a function: a function is trusted
    only by name, with :class:`Trusted`)."""
    module, _, attr = name.rpartition(".")
    if not (module == "sklearn" or module.startswith("sklearn.")):
        return False
    try:
        value = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return False
    return isinstance(value, type) and value.__module__ == module


def _load_sklearn(path: Path, obj: Any, extra: frozenset[str]) -> Any:
    sio = _import("skops.io")
    _import("sklearn")
    found = sio.get_untrusted_types(file=path)
    allowed = set(extra)
    if obj is not None:
        allowed.add(_qualname(type(obj)))
    untrusted = sorted(t for t in found if t not in allowed and not _trusted_sklearn_class(t))
    if untrusted:
        raise UntrustedTypes(path, untrusted)
    value = sio.load(path, trusted=sorted(found))
    if obj is None:
        return value
    if type(value) is not type(obj):
        raise TypeError(
            f"{path} holds a {_qualname(type(value))}, but a {_qualname(type(obj))} was passed"
        )
    # In place: the caller's estimator becomes the saved one (fitted attributes included).
    vars(obj).clear()
    vars(obj).update(vars(value))
    return obj


def _load_framework(d: Path, name: str, entry: Mapping[str, Any], obj: Any) -> Any:
    kind = entry["kind"]
    extra: frozenset[str] = frozenset()
    if isinstance(obj, Trusted):
        obj, extra = obj.obj, obj.types
    if obj is not None and _kind(obj) != kind:
        raise TypeError(
            f"{name!r} was saved as {kind}, but a {type(obj).__qualname__} ({_kind(obj)}) "
            "was passed"
        )
    if kind == "sklearn":
        return _load_sklearn(d / f"{name}.skops", obj, extra)
    if kind in ("xgboost.booster", "xgboost.model"):
        xgb = _import("xgboost")
        path = d / f"{name}.ubj"
        if obj is None:
            if kind == "xgboost.booster":
                obj = xgb.Booster()
            else:
                cls = _resolve(entry.get("type", ""), "xgboost", xgb.XGBModel)
                obj = cls()
        if kind == "xgboost.booster":
            obj.load_model(bytearray(path.read_bytes()))
        else:
            obj.load_model(str(path))
        return obj
    if kind == "lightgbm.booster":
        lgb = _import("lightgbm")
        text = (d / f"{name}.txt").read_text(encoding="utf-8")
        if obj is None:
            return lgb.Booster(model_str=text)
        obj.model_from_string(text)
        return obj
    # tensorflow
    tf = _import("tensorflow")
    if obj is None:
        raise TypeError(
            f"{name!r} is a TensorFlow checkpoint: pass the tf.train.Checkpoint or the "
            "object (a Keras model...) to restore it into"
        )
    if isinstance(obj, tf.train.Checkpoint):
        ck = obj
    elif entry.get("wrapped", True):
        ck = tf.train.Checkpoint(root=obj)
    else:
        raise TypeError(
            f"{name!r} was saved as a tf.train.Checkpoint: pass a tf.train.Checkpoint "
            "with the same structure"
        )
    ck.read(str(d / f"{name}.tf" / "ckpt")).assert_existing_objects_matched()
    return obj


def _resolve(name: str, package: str, base: type) -> type:
    """The class ``name`` if it is defined in ``package`` and a subclass of ``base``, else
    ``base``."""
    module, _, attr = name.rpartition(".")
    if module == package or module.startswith(package + "."):
        try:
            value = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            value = None
        if isinstance(value, type) and issubclass(value, base):
            return value
    return base


# -- save / load -------------------------------------------------------------------------


def _check_names(objects: Mapping[str, Any]) -> None:
    if not objects:
        raise ValueError("nothing to checkpoint: pass objects by name, e.g. model=model")
    for name in objects:
        if not _NAME.fullmatch(name):
            raise ValueError(f"invalid object name {name!r}: letters, digits, _ . - only")


_MISSING = object()


def _caller_variables() -> tuple[Mapping[str, Any], str] | None:
    """The variables of the innermost frame outside this package (the code that called
    the save), with its ``file:line``; ``None`` when there is none."""
    frame = sys._getframe(1)
    try:
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if not (module == "cumulus" or module.startswith("cumulus.")):
                return frame.f_locals, f"{frame.f_code.co_filename}:{frame.f_lineno}"
            frame = frame.f_back  # type: ignore[assignment]
        return None
    finally:
        del frame


def _describe(v: Any) -> str:
    return f"{type(v).__qualname__} of shape {tuple(v.shape)}, {v.dtype}"


def _same_layout_other_values(saved: Any, current: Any) -> bool:
    """Both are tensors (or both NumPy arrays) of the same shape and dtype whose values
    differ: ``current`` replaced ``saved``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(saved, torch.Tensor):
        if not isinstance(current, torch.Tensor):
            return False
        if (saved.shape, saved.dtype) != (current.shape, current.dtype):
            return False
        with torch.no_grad():
            other = current.detach().to(saved.device)
            if saved.is_floating_point() or saved.is_complex():
                same = torch.allclose(saved.detach(), other, rtol=0, atol=0, equal_nan=True)
            else:
                same = torch.equal(saved.detach(), other)
        return not same
    np = sys.modules.get("numpy")
    if np is not None and isinstance(saved, np.ndarray):
        if not isinstance(current, np.ndarray):
            return False
        if (saved.shape, saved.dtype) != (current.shape, current.dtype):
            return False
        nan = saved.dtype.kind in "fc"
        return not bool(np.array_equal(saved, current, equal_nan=nan))
    return False


def _is_array(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    return (torch is not None and isinstance(obj, torch.Tensor)) or (
        np is not None and isinstance(obj, np.ndarray)
    )


def _check_not_stale(objects: Mapping[str, Any]) -> None:
    """Raises :class:`StaleObject` for a tensor or array passed under a name whose
    variable in the calling code now holds another one of the same shape and dtype with
    other values (a rebinding the caller's collected objects missed). An object passed
    as the variable itself, an expression of another shape or dtype (``perm[:k]``,
    ``w.half()``), or equal values are fine."""
    arrays = {name: obj for name, obj in objects.items() if _is_array(obj)}
    if not arrays:
        return
    found = _caller_variables()
    if found is None:
        return
    variables, where = found
    for name, obj in arrays.items():
        current = variables.get(name, _MISSING)
        if current is obj or current is _MISSING:
            continue
        if _same_layout_other_values(obj, current):
            raise StaleObject(name, where, _describe(obj), _describe(current))


def save(directory: str | os.PathLike[str], /, **objects: Any) -> Path:
    """Writes ``objects`` (by name) into ``directory`` (created if missing) and its index
    ``cumulus-ckpt.json``; returns the directory. See the module doc for what each type
    becomes. Files are not fsynced here: the worker agent fsyncs a part when it commits.

    Each object is taken as it is at the call. A tensor or array passed under a name is
    checked against the calling code's variable of that name: when the variable now
    holds another one of the same shape and dtype with other values (it was rebound
    after the object was collected, e.g. in a dict of objects made once), the call
    raises :class:`StaleObject` and writes nothing.

    :raises TypeError: an object of a type no adapter handles.
    :raises StaleObject: an object passed is not what its name's variable holds now.
    :raises ImportError: a framework this needs is not installed (names the extra).
    """
    _check_names(objects)
    _check_not_stale(objects)
    return _save(directory, objects)


def _save(directory: str | os.PathLike[str], objects: Mapping[str, Any]) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _write_all(d, {name: _capture(name, obj, None) for name, obj in objects.items()})
    return d


class _Captured:
    """One object as :func:`save` writes it: its ``kind``, ``value`` (by kind: a
    :class:`_State`, an RNG state tree, an array, a JSON value, or the framework object
    itself) and, for an object with the state-dict protocol, its ``type`` name."""

    __slots__ = ("kind", "type", "value")

    def __init__(self, kind: str, value: Any, type_name: str | None = None) -> None:
        self.kind = kind
        self.value = value
        self.type = type_name


def _capture(name: str, obj: Any, staging: _Staging | None) -> _Captured:
    """What :func:`save` writes for ``obj``, taken now: the state dict, RNG state...
    Without ``staging`` it may share memory with ``obj`` (written at once); with it, it is
    a snapshot that later training cannot change.

    :raises TypeError: no adapter handles ``obj``; or, with ``staging``, its adapter
        cannot snapshot it (scikit-learn, XGBoost, LightGBM, TensorFlow).
    """
    if isinstance(obj, Trusted):
        obj = obj.obj
    kind = _kind(obj)
    if kind in _FRAMEWORKS:
        if staging is not None:
            raise TypeError(
                f"{name!r}: save_checkpoint_async cannot snapshot a "
                f"{_qualname(type(obj))} ({kind}) by copying it; checkpoint it with "
                "cumulus.ckpt.save_checkpoint, which writes it before it returns"
            )
        return _Captured(kind, obj)
    if kind == "torch.module":
        return _Captured(kind, _capture_state(_unwrap_module(obj).state_dict(), staging, name))
    if kind == "torch.optimizer":
        return _Captured(kind, _capture_state(obj.state_dict(), staging, name))
    if kind == "state_dict":
        state = _capture_state(obj.state_dict(), staging, name)
        return _Captured(kind, state, f"{type(obj).__module__}.{type(obj).__qualname__}")
    if kind == "torch.tensor":
        return _Captured(kind, _capture_state(obj, staging, name))
    if kind == "rng":
        return _Captured(kind, runtime.rng_state(*obj.generators))  # a new JSON tree
    if kind == "numpy.ndarray":
        return _Captured(kind, obj if staging is None else _copy_array(obj))
    return _Captured(kind, obj if staging is None else copy.deepcopy(obj))  # json


def _copy_array(a: Any) -> Any:
    """A copy of ``a`` that ``np.save`` writes to the same bytes (the same memory order:
    Fortran-only-contiguous stays so; anything else is written in C order)."""
    if a.dtype.hasobject:
        raise ValueError("Object arrays cannot be saved when allow_pickle=False")
    return a.copy(order="F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C")


def _write_all(d: Path, captured: Mapping[str, _Captured]) -> None:
    """Writes captured objects and the index into ``d`` (which exists)."""
    index: dict[str, Any] = {}
    for name, c in captured.items():
        kind = c.kind
        entry: dict[str, Any]
        if kind in _FRAMEWORKS:
            entry = _save_framework(d, name, kind, c.value)
        elif kind in ("torch.module", "torch.optimizer", "state_dict", "torch.tensor"):
            entry = _write_state(d, name, c.value)
            if c.type is not None:
                entry["type"] = c.type
        elif kind == "numpy.ndarray":
            np = _import("numpy")
            np.save(d / f"{name}.npy", c.value, allow_pickle=False)
            entry = {"files": [f"{name}.npy"]}
        else:  # rng, json
            entry = {"tree": c.value, "files": []}
        entry["kind"] = kind
        index[name] = entry
    data = json.dumps(
        {"format": FORMAT_VERSION, "objects": index}, separators=(",", ":"), allow_nan=False
    )
    (d / INDEX_FILE).write_text(data, encoding="utf-8")


def read_index(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The objects of the checkpoint in ``directory``: name → its index entry (``kind``,
    ``files``...).

    :raises FileNotFoundError: ``directory`` holds no framework checkpoint.
    """
    path = Path(directory) / INDEX_FILE
    try:
        parsed = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} not found: {directory} holds no checkpoint written by cumulus.ckpt.save"
        ) from None
    if not isinstance(parsed, dict) or parsed.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: not a cumulus.ckpt index of format {FORMAT_VERSION}")
    objects: dict[str, Any] = parsed["objects"]
    return objects


def load(directory: str | os.PathLike[str], /, **objects: Any) -> dict[str, Any]:
    """Restores the named objects from the checkpoint in ``directory`` (written by
    :func:`save`) into the objects passed, and returns them by name: a module's,
    optimizer's or scheduler's ``load_state_dict`` is called (tensors are read onto the
    CPU and copied to wherever the object's own tensors live), a tensor or array is
    copied into in place, an :class:`RNG` restores the generators, an estimator, booster
    or TensorFlow object gets the saved state. For a JSON value, or when ``None`` is
    passed, the saved value is returned (a state dict with CPU tensors; a new estimator or
    booster; TensorFlow needs an object to restore into).

    :raises KeyError: a name is not in the checkpoint.
    :raises TypeError: an object is not of the kind that was saved under its name.
    :raises UntrustedTypes: a scikit-learn estimator's file holds types not trusted
        (nothing was loaded; see :class:`Trusted`).
    :raises ImportError: a framework this needs is not installed (names the extra).
    """
    _check_names(objects)
    d = Path(directory)
    index = read_index(d)
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        entry = index.get(name)
        if entry is None:
            raise KeyError(
                f"no object {name!r} in the checkpoint {d} (it has: {', '.join(sorted(index))})"
            )
        saved_kind = entry["kind"]
        if saved_kind in _FRAMEWORKS:
            out[name] = _load_framework(d, name, entry, obj)
            continue

        def read(name: str = name, entry: Mapping[str, Any] = entry) -> Any:
            kind = entry["kind"]
            if kind in ("rng", "json"):
                return entry["tree"]
            if kind == "numpy.ndarray":
                return _import("numpy").load(d / f"{name}.npy", allow_pickle=False)
            if kind.startswith("torch."):
                _import("torch")
            return _load_state(d, name, entry)

        out[name] = _restore(name, saved_kind, obj, read)
    return out


def _restore(name: str, saved_kind: str, obj: Any, read: Callable[[], Any]) -> Any:
    """Restores ``obj`` (``None``: nothing) from the value saved under ``name`` as
    ``saved_kind``, which ``read()`` returns (an RNG state tree, a state dict, an array, a
    JSON value); returns what :func:`load` returns for it."""
    if saved_kind == "rng":
        if obj is None:
            return read()
        if not isinstance(obj, RNG):
            raise TypeError(f"{name!r} was saved as an RNG state: pass a cumulus.ckpt.RNG")
        runtime.set_rng_state(read(), *obj.generators, strict=obj.strict)
        return obj
    if isinstance(obj, Trusted):
        obj = obj.obj
    value = read()
    if obj is None or saved_kind == "json":
        return value
    kind = _kind(obj)
    if kind != saved_kind:
        raise TypeError(
            f"{name!r} was saved as {saved_kind}, but a {type(obj).__qualname__} "
            f"({kind}) was passed"
        )
    if kind == "torch.module":
        _unwrap_module(obj).load_state_dict(value)
    elif kind in ("torch.optimizer", "state_dict"):
        obj.load_state_dict(value)
    elif kind == "torch.tensor":
        torch = sys.modules["torch"]
        with torch.no_grad():
            obj.copy_(value)
    elif kind == "numpy.ndarray":
        np = sys.modules["numpy"]
        np.copyto(obj, value, casting="no")
    return obj


# -- through the runtime -------------------------------------------------------------------


def save_checkpoint(
    step: int, /, state: Mapping[str, Any] | None = None, **objects: Any
) -> CommittedPart | None:
    """Writes ``objects`` with :func:`save` into this rank's staging dir and commits it as
    checkpoint ``step`` with the JSON ``state`` (see
    :func:`cumulus.runtime.save_checkpoint`: written again before every retry). The name
    ``state`` is taken by the JSON state; name objects otherwise. Returns the part once
    it is committed (``None`` when it was refused because this rank was asked to stop,
    e.g. its job was cancelled: just exit 0); first waits for a commit
    :func:`save_checkpoint_async` left in flight (raising its error if
    :meth:`PendingCheckpoint.wait` did not).

    Pass the objects at each call: a tensor or array that is no longer what its name's
    variable holds in the calling code raises :class:`StaleObject` before anything is
    written (see :func:`save`).

    :raises: as :func:`cumulus.runtime.checkpoint` and :func:`save`.
    """
    _check_names(objects)
    _check_not_stale(objects)
    return runtime.save_checkpoint(step, lambda d: _save_quiet(d, objects), state)


def _save_quiet(d: Path, objects: Mapping[str, Any]) -> None:
    _save(d, objects)


class _Staging:
    """The host buffers one snapshot copies tensors into, by (object name, tensor key).
    A buffer of the previous snapshot with the same dtype and shape is reused (its
    commit has ended): only the first checkpoint allocates, later ones just copy. Tensors
    on a CUDA device are copied into pinned memory, asynchronously, then waited for."""

    def __init__(self, reuse: Mapping[tuple[str, str], tuple[Any, bool]]) -> None:
        self._reuse = reuse
        #: The buffers of this snapshot (kept for the next one), with whether pinned.
        self.buffers: dict[tuple[str, str], tuple[Any, bool]] = {}
        self._cuda: set[Any] = set()

    def copy(self, name: str, key: str, t: Any) -> Any:
        torch = sys.modules["torch"]
        t = t.detach()
        pinned = t.device.type == "cuda"
        old = self._reuse.get((name, key))
        if old is not None and (old[0].dtype, old[0].shape, old[1]) == (t.dtype, t.shape, pinned):
            buf = old[0]
        else:
            try:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
            except RuntimeError:  # no pinned memory to be had: pageable, copied at once
                pinned = False
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        buf.copy_(t, non_blocking=pinned)
        if pinned:
            self._cuda.add(t.device)
        self.buffers[(name, key)] = (buf, pinned)
        return buf

    def synchronize(self) -> None:
        """Waits for the asynchronous copies from CUDA devices."""
        for device in self._cuda:
            sys.modules["torch"].cuda.synchronize(device)


#: The staging buffers of the latest snapshot and the commit that writes them: reused by
#: the next snapshot once that commit has ended.
_buffers: tuple[PendingCheckpoint, dict[tuple[str, str], tuple[Any, bool]]] | None = None
_async_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class _HostCopy:
    """The latest snapshot :func:`save_checkpoint_async` took in this process, as it was
    written (the host buffers hold it until the next snapshot copies into them): after an
    in-process restart, :func:`load_checkpoint` restores from it instead of reading the
    part back when it is the very part the new attempt resumes from."""

    #: The commit that wrote it.
    pending: PendingCheckpoint
    #: The objects, by name, as :func:`_write_all` wrote them.
    captured: Mapping[str, _Captured]
    #: The job and rank that took it.
    job_id: str
    rank: int


#: The latest snapshot (``None`` while a snapshot is being taken, or after one failed:
#: the buffers may hold parts of two).
_host_copy: _HostCopy | None = None


def save_checkpoint_async(
    step: int, /, state: Mapping[str, Any] | None = None, **objects: Any
) -> PendingCheckpoint:
    """:func:`save_checkpoint` that blocks only while it copies: takes a snapshot of
    ``objects`` on the caller's thread, then one background thread writes it with
    :func:`save` into the staging dir and commits it, with the same retries, the same
    files (byte for byte) and the same outcome as :func:`save_checkpoint` called now.
    Returns the handle: :meth:`PendingCheckpoint.wait` returns the
    :class:`~cumulus.runtime.CommittedPart` or raises the commit's error
    (:class:`~cumulus.errors.StaleAttempt`...); see also :func:`wait_pending`.

    The snapshot is independent of later training: every tensor of a state dict
    (modules, optimizers with their nested state, schedulers...) and every tensor passed
    is copied into host memory (from a GPU into pinned memory), NumPy arrays and JSON
    values are copied, the RNG states and ``state`` are captured now. The host buffers
    are kept and reused by the next call when the names, dtypes and shapes are the same,
    so only the first call allocates (one copy of the state stays in host memory between
    checkpoints: :func:`release_async_buffers` frees it). A state dict with values
    neither JSON nor tensors (written with ``torch.save``) is deep-copied instead,
    tensors staying on their device.

    One commit at a time: a call first waits for the previous one and raises its error if
    :meth:`PendingCheckpoint.wait` did not (so does :func:`save_checkpoint`). At
    interpreter exit, and in :meth:`cumulus.runtime.Runtime.close`, the commit in flight
    is waited for (within its commit deadline plus one request's time limit) and an error
    nobody raised is logged on stderr; a rank that stops (``should_stop()``) or ends should
    still call :func:`wait_pending` (or commit its stop checkpoint with
    :func:`save_checkpoint`, which waits) before it exits, to handle that error.

    Scikit-learn estimators, XGBoost and LightGBM models and TensorFlow objects cannot be
    snapshotted by copying: pass them to :func:`save_checkpoint` instead.

    :raises TypeError: an object no adapter handles, or one that cannot be snapshotted
        (names :func:`save_checkpoint`); nothing was started.
    :raises StaleObject: a tensor or array passed is not what its name's variable holds
        now (see :func:`save`); nothing was started.
    :raises: the previous asynchronous commit's error (see above); as
        :func:`cumulus.runtime.checkpoint` for what is checked before anything is copied
        (:class:`~cumulus.errors.NotInCumulusRank`,
        :class:`~cumulus.errors.CheckpointsDisabled`, :class:`~cumulus.errors.InvalidStep`,
        :class:`~cumulus.errors.InvalidState`); the commit's own errors come from
        :meth:`PendingCheckpoint.wait`.
    """
    global _buffers, _host_copy
    _check_names(objects)
    _check_not_stale(objects)
    rt = runtime.get_runtime()
    checkpointer = rt.checkpointer
    with _async_lock:
        stagings: list[_Staging] = []
        snapshots: list[dict[str, _Captured]] = []

        def snapshot() -> Callable[[Path], None]:
            # Called once the previous commit has ended: its buffers are free to reuse
            # (unless they belong to another runtime's commit still in flight).
            previous = _buffers
            reuse = previous[1] if previous is not None and previous[0].done() else {}
            staging = _Staging(reuse)
            stagings.append(staging)
            captured = {name: _capture(name, obj, staging) for name, obj in objects.items()}
            staging.synchronize()
            snapshots.append(captured)

            def write(d: Path) -> None:
                _write_all(d, captured)

            return write

        # The buffers the host copy lies in may be copied into from here on.
        _host_copy = None
        pending = checkpointer.save_async(step, snapshot, state)
        _buffers = (pending, stagings[0].buffers) if stagings[0].buffers else None
        ctx = rt.context
        _host_copy = _HostCopy(pending, snapshots[0], ctx.job_id or "", ctx.rank)
        return pending


def wait_pending(timeout_s: float | None = None) -> CommittedPart | None:
    """Waits for the latest :func:`save_checkpoint_async` commit of this process and
    returns its part (again if it was waited for already); ``None`` when none was
    started. Call it before exiting, e.g. after a stop request.

    :raises TimeoutError: still in flight after ``timeout_s`` seconds (it goes on).
    :raises: the commit's error, as :meth:`PendingCheckpoint.wait`.
    """
    return runtime.get_runtime().checkpointer.wait_pending(timeout_s)


def release_async_buffers() -> None:
    """Frees the host buffers :func:`save_checkpoint_async` keeps for its next snapshot
    (once the commit writing them ends), and the snapshot :func:`load_checkpoint` would
    restore from after an in-process restart; the next call allocates them again."""
    global _buffers, _host_copy
    with _async_lock:
        _buffers = None
        _host_copy = None


def load_checkpoint(**objects: Any) -> ResumePoint | None:
    """When this attempt resumes, restores ``objects`` from this rank's committed part with
    :func:`load` and returns the resume point: its ``step``, ``state``, and ``objects``,
    what :func:`load` returned by name (the objects passed, restored in place; for a
    name passed as ``None``, and for a JSON value, the saved value: a state dict, a
    tensor on the CPU, a new booster...). Else returns ``None`` and leaves the objects
    alone.

    After an in-process restart (``cumulus.runtime.run``) the objects come from the host
    copy of this process's last :func:`save_checkpoint_async` snapshot when that snapshot
    is the very part resumed from (committed by this process's previous attempt, not
    copied into since): nothing is read back from disk, and the result is the same.
    ``point.source`` says which: ``"memory"`` or ``"disk"``.

    ::

        point = ckpt.load_checkpoint(model=model, optimizer=opt, perm=None)
        if point is not None:
            perm = point.objects["perm"]          # rebind what the checkpoint held
        booster = ckpt.load_checkpoint(model=None).objects["model"]   # XGBoost

    :raises: as :func:`cumulus.runtime.resume` and :func:`load`.
    """
    point = runtime.resume()
    if point is None:
        return None
    captured = _host_copy_of(point)
    if captured is None:
        loaded = load(point.dir, **objects)
        return dataclasses.replace(point, objects=MappingProxyType(loaded), source="disk")
    _check_names(objects)
    loaded = {}
    for name, obj in objects.items():
        c = captured.get(name)
        if c is None:
            raise KeyError(
                f"no object {name!r} in the checkpoint {point.dir} (it has: "
                f"{', '.join(sorted(captured))})"
            )
        loaded[name] = _restore(name, c.kind, obj, partial(_captured_value, c))
    print(
        f"cumulus: step {point.step} restored from the host copy of its asynchronous "
        f"checkpoint (memory), not from {point.dir}",
        file=sys.stderr,
        flush=True,
    )
    return dataclasses.replace(point, objects=MappingProxyType(loaded), source="memory")


def _host_copy_of(point: ResumePoint) -> Mapping[str, _Captured] | None:
    """The objects of this rank's part ``point`` as this process's latest asynchronous
    snapshot holds them, when that snapshot is still in its host buffers and is the very
    part ``point`` names: committed (by the attempt this process ran before an in-process
    restart), of the same job, rank and step, in the directory ``point.dir`` ends with.
    ``None`` otherwise (read the part from disk)."""
    copy_ = _host_copy
    part = None if copy_ is None else copy_.pending.committed_part()
    if copy_ is None or part is None or part.step != point.step:
        return None
    ctx = runtime.get_runtime().context
    if (copy_.job_id, copy_.rank) != (ctx.job_id or "", ctx.rank):
        return None
    rel = Path(part.dir).parts
    if not rel or point.dir.parts[-len(rel) :] != rel:
        return None
    if any(c.kind in _FRAMEWORKS for c in copy_.captured.values()):
        return None
    return copy_.captured


def _captured_value(c: _Captured) -> Any:
    """What reading ``c``'s files back would give (see :func:`load`), sharing no memory
    with the snapshot: its host buffers are copied into by the next snapshot, and an
    optimizer keeps the tensors its ``load_state_dict`` is given."""
    if c.kind in ("torch.module", "torch.optimizer", "state_dict", "torch.tensor"):
        state: _State = c.value
        if state.tensors is None:
            return copy.deepcopy(state.pickled)
        return _decode(state.tree, {k: t.clone() for k, t in state.tensors.items()})
    if c.kind == "numpy.ndarray":
        return c.value.copy()
    return copy.deepcopy(c.value)  # rng, json
