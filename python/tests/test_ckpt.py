"""``cumulus.ckpt`` and ``cumulus.runtime.rng_state``: framework checkpoints round-trip,
and training resumed from one continues bit for bit."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cumulus import ckpt, runtime


def test_importing_ckpt_loads_no_framework() -> None:
    script = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import cumulus.ckpt\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(sorted(new - set(sys.stdlib_module_names) - {'cumulus'}))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_python_rng_and_json_values_round_trip(tmp_path: Path) -> None:
    mine = random.Random(7)
    random.seed(3)
    ckpt.save(tmp_path, rng=ckpt.RNG(mine), meta={"epoch": 2, "names": ["a", "b"]})
    expected = ([random.random() for _ in range(5)], [mine.random() for _ in range(5)])
    random.seed(99)
    mine.seed(99)
    out = ckpt.load(tmp_path, rng=ckpt.RNG(mine), meta=None)
    assert out["meta"] == {"epoch": 2, "names": ["a", "b"]}
    assert ([random.random() for _ in range(5)], [mine.random() for _ in range(5)]) == expected
    index = json.loads((tmp_path / ckpt.INDEX_FILE).read_text())
    assert index["objects"]["rng"]["kind"] == "rng"


def test_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"cannot checkpoint a builtins\.object"):
        ckpt.save(tmp_path, thing=object())
    with pytest.raises(ValueError, match="nothing to checkpoint"):
        ckpt.save(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint written by cumulus\.ckpt\.save"):
        ckpt.load(tmp_path, meta=None)
    ckpt.save(tmp_path, meta=[1, 2])
    with pytest.raises(KeyError, match=r"no object .model. .*it has: meta"):
        ckpt.load(tmp_path, model=None)
    with pytest.raises(ValueError, match="same generators"):
        runtime.set_rng_state(runtime.rng_state(random.Random(1)))
    with pytest.raises(ValueError, match="not an RNG state"):
        runtime.set_rng_state({"python": []})


def test_a_missing_framework_names_the_extra(tmp_path: Path) -> None:
    index = {
        "format": ckpt.FORMAT_VERSION,
        "objects": {"model": {"kind": "torch.module", "tree": {}, "files": ["model.st"]}},
    }
    (tmp_path / ckpt.INDEX_FILE).write_text(json.dumps(index))
    script = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if not installed\n"
        "from cumulus import ckpt\n"
        "try:\n"
        f"    ckpt.load({str(tmp_path)!r}, model=None)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pip install 'cumulus-train[torch]'" in r.stdout


# -- PyTorch -----------------------------------------------------------------------------


def _torch() -> Any:
    return pytest.importorskip(
        "torch", reason="PyTorch is not installed (pip install -e './python[torch]')"
    )


class _Net:
    """A model, optimizer, scheduler and data generator, trained one step at a time
    (dropout uses torch's global generator, the data the generator passed)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3)
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.data = torch.Generator().manual_seed(5)

    def step(self) -> None:
        import numpy as np

        x = self.torch.randn(16, 6, generator=self.data)
        noise = random.random() + float(np.random.rand())  # Python's and NumPy's RNGs
        loss = self.model(x).pow(2).mean() * (1 + noise)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()

    def objects(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.opt,
            "scheduler": self.sched,
            "rng": ckpt.RNG(self.data),
        }

    def weights(self) -> dict[str, Any]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


@pytest.mark.torch
def test_a_resumed_torch_run_is_bit_identical(tmp_path: Path) -> None:
    torch = _torch()
    import numpy as np

    random.seed(1)
    np.random.seed(1)
    a = _Net(torch)
    for _ in range(3):
        a.step()
    ckpt.save(tmp_path, **a.objects(), step=3)
    for _ in range(4):
        a.step()
    expected = a.weights()

    # Another process state: other seeds everywhere, fresh objects.
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    b = _Net(torch)
    b.data.manual_seed(9)
    out = ckpt.load(tmp_path, **b.objects(), step=None)
    assert out["step"] == 3 and out["model"] is b.model
    for _ in range(4):
        b.step()
    got = b.weights()
    assert expected.keys() == got.keys()
    for k in expected:
        assert torch.equal(expected[k], got[k]), k
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["cumulus-ckpt.json", "model.safetensors", "optimizer.safetensors"]


@pytest.mark.torch
def test_tensors_arrays_and_raw_state(tmp_path: Path) -> None:
    torch = _torch()
    import numpy as np

    t = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    arr = np.linspace(0, 1, 5)
    model = torch.nn.Linear(3, 2)
    ckpt.save(tmp_path, t=t.t(), arr=arr, model=model)  # a non-contiguous view
    t2 = torch.zeros(3, 2, dtype=torch.float64)
    arr2 = np.zeros(5)
    out = ckpt.load(tmp_path, t=t2, arr=arr2, model=None)
    assert torch.equal(t2, t.t()) and np.array_equal(arr2, arr)
    raw = out["model"]
    assert set(raw) == {"weight", "bias"} and raw["weight"].device.type == "cpu"
    assert torch.equal(raw["weight"], model.weight.detach())
    with pytest.raises(TypeError, match=r"saved as torch\.module"):
        ckpt.load(tmp_path, model=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.torch
def test_state_dicts_with_other_values_fall_back_to_safe_torch_load(tmp_path: Path) -> None:
    torch = _torch()

    class Custom:
        def __init__(self) -> None:
            self.state: dict[str, Any] = {"dtype": torch.float16, "w": torch.ones(2)}

        def state_dict(self) -> dict[str, Any]:
            return dict(self.state)

        def load_state_dict(self, s: dict[str, Any]) -> None:
            self.state = dict(s)

    ckpt.save(tmp_path, custom=Custom())
    assert (tmp_path / "custom.pt").exists()
    c = Custom()
    c.state = {}
    ckpt.load(tmp_path, custom=c)
    assert c.state["dtype"] == torch.float16 and torch.equal(c.state["w"], torch.ones(2))


@pytest.mark.torch
def test_rng_state_is_json_and_restores_through_cpu_tensors() -> None:
    torch = _torch()
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(4)
    state = runtime.rng_state(g)
    json.dumps(state)  # plain JSON: nothing for map_location to move
    expected = (torch.rand(3), torch.rand(3, generator=g))
    torch.manual_seed(0)
    g.manual_seed(0)
    runtime.set_rng_state(json.loads(json.dumps(state)), g)
    assert torch.equal(torch.rand(3), expected[0])
    assert torch.equal(torch.rand(3, generator=g), expected[1])

    # A state holding tensors (as a hand-written checkpoint saved with torch.save and
    # loaded with map_location=...) is copied to the CPU as a ByteTensor, not refused.
    torch.manual_seed(4)
    legacy = dict(state, torch=torch.get_rng_state().to(torch.int64))
    torch.manual_seed(0)
    g.manual_seed(0)
    runtime.set_rng_state(legacy, g)
    assert torch.equal(torch.rand(3), expected[0])
    assert torch.equal(torch.rand(3, generator=g), expected[1])


@pytest.mark.torch
def test_a_rebound_tensor_collected_before_is_refused_not_saved_stale(tmp_path: Path) -> None:
    torch = _torch()
    import numpy as np

    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(8, generator=g)
    order = np.arange(4)
    objects = {"perm": perm, "order": order}  # collected once...
    ckpt.save(tmp_path, **objects)
    perm.copy_(torch.randperm(8, generator=g))  # updated in place: still what it names
    ckpt.save(tmp_path, **objects)
    perm = torch.randperm(8, generator=g)  # ...then rebound: the dict holds the old one
    with pytest.raises(ckpt.StaleObject, match=r"'perm' passed to the checkpoint") as e:
        ckpt.save(tmp_path / "never", **objects)
    assert e.value.name == "perm" and "test_ckpt.py:" in str(e.value)
    assert not (tmp_path / "never").exists()
    order = order[::-1].copy()
    with pytest.raises(ckpt.StaleObject, match=r"'order'"):
        ckpt.save(tmp_path, perm=perm, order=objects["order"])
    # Passed at the call, or an expression of another shape or dtype, or equal values:
    # what the variable holds is what is saved.
    ckpt.save(tmp_path, perm=perm, order=order)
    ckpt.save(tmp_path, perm=perm[:3], order=order.astype(np.float32))
    ckpt.save(tmp_path, perm=perm.clone(), order=order.copy())
    assert torch.equal(ckpt.load(tmp_path, perm=None)["perm"], perm)
