"""``cumulus.ckpt`` adapters for scikit-learn (skops), XGBoost, LightGBM and TensorFlow:
every one round-trips (model bytes or predictions identical), loads into the caller's
object, and a missing framework names the extra to install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cumulus import ckpt


def _data(n: int = 300, features: int = 8, classes: int = 3) -> tuple[Any, Any]:
    np = pytest.importorskip("numpy")
    rs = np.random.RandomState(0)
    x = rs.normal(size=(n, features))
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(int) + (x[:, 2] > 1).astype(int)
    return x, y % classes


# -- scikit-learn (skops) ----------------------------------------------------------------


def _sklearn() -> Any:
    pytest.importorskip(
        "skops.io", reason="skops is not installed (pip install -e './python[sklearn]')"
    )
    return pytest.importorskip(
        "sklearn", reason="scikit-learn is not installed (pip install -e './python[sklearn]')"
    )


def _doubler_class() -> type:
    """A user's own transformer: not defined in scikit-learn, so not trusted by default.
    Made here, not at import (scikit-learn is optional), and put in this module's
    namespace, where skops finds it by name."""
    from sklearn.base import BaseEstimator, TransformerMixin

    class DoublerEstimator(TransformerMixin, BaseEstimator):  # type: ignore[misc]
        def fit(self, x: Any, y: Any = None) -> DoublerEstimator:
            return self

        def transform(self, x: Any) -> Any:
            return x * 2

    DoublerEstimator.__module__ = __name__
    DoublerEstimator.__qualname__ = "DoublerEstimator"
    globals()["DoublerEstimator"] = DoublerEstimator  # importable by skops by name
    return DoublerEstimator


def test_sklearn_estimators_round_trip_with_identical_predictions(tmp_path: Path) -> None:
    _sklearn()
    import numpy as np
    from sklearn.ensemble import HistGradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = _data()
    pipe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=200)).fit(x, y)
    forest = RandomForestClassifier(n_estimators=5, random_state=0).fit(x, y)
    hgb = HistGradientBoostingClassifier(max_iter=5, random_state=0).fit(x, y)
    ckpt.save(tmp_path, pipe=pipe, forest=forest, hgb=hgb, step=4)
    index = ckpt.read_index(tmp_path)
    assert index["forest"]["kind"] == "sklearn" and index["forest"]["files"] == ["forest.skops"]
    assert index["forest"]["type"] == "sklearn.ensemble._forest.RandomForestClassifier"

    # Into fresh, unfitted estimators of the same classes: they become the saved ones.
    pipe2 = make_pipeline(StandardScaler(), LogisticRegression())
    forest2 = RandomForestClassifier()
    out = ckpt.load(tmp_path, pipe=pipe2, forest=forest2, hgb=None, step=None)
    assert out["pipe"] is pipe2 and out["forest"] is forest2 and out["step"] == 4
    # The forest's trees (sklearn.tree._tree.Tree) and the boosting predictors are classes
    # defined in scikit-learn: trusted without being named.
    for a, b in ((pipe, pipe2), (forest, forest2), (hgb, out["hgb"])):
        assert type(a) is type(b)
        assert np.array_equal(a.predict_proba(x), b.predict_proba(x))
    assert forest2.get_params()["n_estimators"] == 5

    with pytest.raises(TypeError, match=r"holds a sklearn\.pipeline\.Pipeline"):
        ckpt.load(tmp_path, pipe=LogisticRegression())


def test_sklearn_untrusted_types_are_refused_before_loading(tmp_path: Path) -> None:
    _sklearn()
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    doubler = _doubler_class()
    x, y = _data()
    pipe = make_pipeline(doubler(), LogisticRegression(max_iter=200)).fit(x, y)
    ckpt.save(tmp_path, pipe=pipe)
    name = f"{__name__}.DoublerEstimator"
    with pytest.raises(ckpt.UntrustedTypes, match="not trusted, so it was not loaded") as e:
        ckpt.load(tmp_path, pipe=None)
    assert e.value.types == [name]
    assert "cumulus.ckpt.Trusted(obj, " in str(e.value)
    # Trusted by name or by type; on the object passed.
    fresh = make_pipeline(doubler(), LogisticRegression())
    ckpt.load(tmp_path, pipe=ckpt.Trusted(fresh, name))
    assert np.array_equal(fresh.predict_proba(x), pipe.predict_proba(x))
    got = ckpt.load(tmp_path, pipe=ckpt.Trusted(None, doubler))["pipe"]
    assert np.array_equal(got.predict_proba(x), pipe.predict_proba(x))
    # The class of the object passed is trusted too (the caller made one).
    bare = doubler().fit(x)
    ckpt.save(tmp_path / "bare", t=bare)
    assert type(ckpt.load(tmp_path / "bare", t=doubler())["t"]) is doubler


def test_sklearn_functions_are_trusted_only_by_name(tmp_path: Path) -> None:
    _sklearn()
    from sklearn.preprocessing import FunctionTransformer
    from sklearn.utils import shuffle

    # A function of scikit-learn's own is not a class: loading it takes a Trusted name.
    ft = FunctionTransformer(func=shuffle)
    ckpt.save(tmp_path, ft=ft)
    with pytest.raises(ckpt.UntrustedTypes) as e:
        ckpt.load(tmp_path, ft=None)
    (name,) = e.value.types
    assert name.endswith(".shuffle")
    assert ckpt.load(tmp_path, ft=ckpt.Trusted(None, name))["ft"].func is shuffle


# -- XGBoost -------------------------------------------------------------------------------


def _xgboost() -> Any:
    return pytest.importorskip(
        "xgboost", reason="XGBoost is not installed (pip install -e './python[xgboost]')"
    )


def test_xgboost_boosters_round_trip_byte_identical(tmp_path: Path) -> None:
    xgb = _xgboost()
    import numpy as np

    x, y = _data()
    params = {"objective": "multi:softprob", "num_class": 3, "max_depth": 3, "nthread": 1}
    d = xgb.DMatrix(x, label=y, nthread=1)
    booster = xgb.train(params, d, num_boost_round=4)
    ckpt.save(tmp_path, model=booster)
    raw = bytes(booster.save_raw(raw_format="ubj"))
    assert (tmp_path / "model.ubj").read_bytes() == raw  # XGBoost's own format

    into = xgb.Booster()
    assert ckpt.load(tmp_path, model=into)["model"] is into
    fresh = ckpt.load(tmp_path, model=None)["model"]
    for b in (into, fresh):
        assert bytes(b.save_raw(raw_format="ubj")) == raw
        assert np.array_equal(b.predict(d), booster.predict(d))
    # Training goes on from the loaded booster exactly as from the original.
    a = xgb.train(params, d, num_boost_round=2, xgb_model=booster)
    b = xgb.train(params, xgb.DMatrix(x, label=y, nthread=1), num_boost_round=2, xgb_model=into)
    assert bytes(a.save_raw(raw_format="ubj")) == bytes(b.save_raw(raw_format="ubj"))


def test_xgboost_sklearn_wrappers_round_trip(tmp_path: Path) -> None:
    xgb = _xgboost()
    import numpy as np

    x, y = _data()
    clf = xgb.XGBClassifier(n_estimators=4, max_depth=3, n_jobs=1, random_state=0).fit(x, y)
    ckpt.save(tmp_path, clf=clf)
    assert ckpt.read_index(tmp_path)["clf"]["kind"] == "xgboost.model"
    into = xgb.XGBClassifier()
    ckpt.load(tmp_path, clf=into)
    fresh = ckpt.load(tmp_path, clf=None)["clf"]
    assert type(fresh) is xgb.XGBClassifier
    for c in (into, fresh):
        assert np.array_equal(c.predict_proba(x), clf.predict_proba(x))
        assert bytes(c.get_booster().save_raw(raw_format="ubj")) == bytes(
            clf.get_booster().save_raw(raw_format="ubj")
        )
    with pytest.raises(TypeError, match=r"saved as xgboost\.model"):
        ckpt.load(tmp_path, clf=xgb.Booster())


# -- LightGBM ------------------------------------------------------------------------------


def _lightgbm() -> Any:
    return pytest.importorskip(
        "lightgbm", reason="LightGBM is not installed (pip install -e './python[lightgbm]')"
    )


def test_lightgbm_boosters_round_trip_byte_identical(tmp_path: Path) -> None:
    lgb = _lightgbm()
    import numpy as np

    x, y = _data()
    params = {
        "objective": "multiclass",
        "num_class": 3,
        "num_leaves": 7,
        "num_threads": 1,
        "deterministic": True,
        "verbose": -1,
    }
    booster = lgb.train(params, lgb.Dataset(x, label=y), num_boost_round=5)
    text = booster.model_to_string(num_iteration=-1)
    ckpt.save(tmp_path, model=booster)
    assert (tmp_path / "model.txt").read_text() == text  # LightGBM's own format

    fresh = ckpt.load(tmp_path, model=None)["model"]
    # Into another booster (here: one trained for fewer rounds on other data).
    other = lgb.train(params, lgb.Dataset(x[:100], label=y[:100]), num_boost_round=2)
    assert ckpt.load(tmp_path, model=other)["model"] is other
    for b in (fresh, other):
        assert b.model_to_string(num_iteration=-1) == text
        assert b.current_iteration() == 5
        assert np.array_equal(b.predict(x), booster.predict(x))

    clf = lgb.LGBMClassifier(n_estimators=2, verbose=-1).fit(x, y)
    with pytest.raises(TypeError, match="checkpoint its booster_"):
        ckpt.save(tmp_path, clf=clf)
    ckpt.save(tmp_path / "clf", clf=clf.booster_)
    assert np.array_equal(
        ckpt.load(tmp_path / "clf", clf=None)["clf"].predict(x), clf.predict_proba(x)
    )


# -- TensorFlow ----------------------------------------------------------------------------


def test_tensorflow_checkpoints_round_trip(tmp_path: Path) -> None:
    tf = pytest.importorskip(
        "tensorflow",
        reason="TensorFlow is not installed (pip install -e './python[tensorflow]'; "
        "not in the [test] extra: too large for CI)",
    )
    import numpy as np

    x, y = _data(64)
    x = x.astype("float32")

    def model() -> Any:
        tf.keras.utils.set_random_seed(0)
        m = tf.keras.Sequential(
            [tf.keras.Input((8,)), tf.keras.layers.Dense(4, "relu"), tf.keras.layers.Dense(3)]
        )
        m.compile(
            optimizer=tf.keras.optimizers.Adam(0.01),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return m

    a = model()
    a.fit(x, y, epochs=2, batch_size=16, verbose=0)
    step = tf.Variable(7, dtype=tf.int64)
    ckpt.save(tmp_path, net=a, both=tf.train.Checkpoint(model=a, optimizer=a.optimizer, step=step))
    assert (tmp_path / "net.tf").is_dir()

    b = model()
    b.fit(x[:16], y[:16], epochs=1, verbose=0)  # other weights, optimizer slots built
    ckpt.load(tmp_path, net=b)
    assert np.array_equal(a.predict(x, verbose=0), b.predict(x, verbose=0))
    for wa, wb in zip(a.get_weights(), b.get_weights(), strict=True):
        assert np.array_equal(wa, wb)

    c = model()
    c.fit(x[:16], y[:16], epochs=1, verbose=0)
    step_c = tf.Variable(0, dtype=tf.int64)
    ckpt.load(tmp_path, both=tf.train.Checkpoint(model=c, optimizer=c.optimizer, step=step_c))
    assert int(step_c.numpy()) == 7
    for va, vc in zip(a.optimizer.variables, c.optimizer.variables, strict=True):
        assert np.array_equal(va.numpy(), vc.numpy())
    # Training goes on identically.
    a.fit(x, y, epochs=1, batch_size=16, verbose=0, shuffle=False)
    c.fit(x, y, epochs=1, batch_size=16, verbose=0, shuffle=False)
    for wa, wc in zip(a.get_weights(), c.get_weights(), strict=True):
        assert np.array_equal(wa, wc)
    with pytest.raises(TypeError, match=r"pass the tf\.train\.Checkpoint or the object"):
        ckpt.load(tmp_path, net=None)


# -- a missing framework -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "blocked", "extra"),
    [
        ("sklearn", "skops", "sklearn"),
        ("xgboost.booster", "xgboost", "xgboost"),
        ("lightgbm.booster", "lightgbm", "lightgbm"),
        ("tensorflow", "tensorflow", "tensorflow"),
    ],
)
def test_a_missing_framework_names_its_extra(
    tmp_path: Path, kind: str, blocked: str, extra: str
) -> None:
    index = {
        "format": ckpt.FORMAT_VERSION,
        "objects": {"model": {"kind": kind, "type": "x.Y", "files": ["model.bin"]}},
    }
    (tmp_path / ckpt.INDEX_FILE).write_text(json.dumps(index))
    script = (
        "import sys\n"
        f"sys.modules[{blocked!r}] = None  # as if not installed\n"
        "from cumulus import ckpt\n"
        "try:\n"
        f"    ckpt.load({str(tmp_path)!r}, model=None)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"pip install 'cumulus-train[{extra}]'" in r.stdout, r.stdout
