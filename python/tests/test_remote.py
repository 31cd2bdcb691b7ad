"""``Client.run`` and uploads on a real local cluster (one coordinator, one worker, shared
by the module): functions run on the ranks with the worker's ``python3`` and the copies
of ``cumulus`` and ``cloudpickle`` the job carries (no package index), their values,
exceptions and artifacts come back, a Python version mismatch fails the job at once, a
killed rank resumes exactly, and ``runtime.list_checkpoints`` works inside a rank."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cumulus
from cumulus import _contract, _remote, _transfer, errors
from localcluster import LocalCluster, explain

#: uv, which the agent builds environments with (python[test] installs it beside this
#: interpreter).
UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")

pytestmark = pytest.mark.cluster

JOB_TIMEOUT_S = 180
#: Quick restarts: the resume test kills a rank once.
FAST_RESTARTS = {"backoff_initial_ms": 100, "backoff_max_ms": 500}


# -- functions the ranks run (pickled by value: this module is not on the worker) --------


def where_am_i(greeting: str, *, times: int = 1) -> dict[str, Any]:
    import cloudpickle

    from cumulus import runtime

    ctx = runtime.get_context()
    return {
        "cloudpickle": cloudpickle.__file__,
        "executable": sys.executable,
        "greeting": greeting * times,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "job_id": ctx.job_id,
        "python": list(sys.version_info[:2]),
        "cwd_files": sorted(os.listdir(".")),
    }


def fail_deep(depth: int) -> None:
    if depth == 0:
        raise KeyError(f"missing shard at depth {depth}")
    fail_deep(depth - 1)


def train(steps: int, kill_at: int | None, every: int) -> dict[str, Any]:
    """A deterministic "training" loop: weights updated from a PRNG seeded by the step,
    checkpointed every ``every`` steps; attempt 0 SIGKILLs itself at ``kill_at`` once the
    step before it is committed (``list_checkpoints``)."""
    import random
    import time

    from cumulus import runtime

    ctx = runtime.get_context()
    weights = [0.0] * 8
    start = 0
    resumed = runtime.resume()
    if resumed is not None:
        weights = json.loads((resumed.dir / "weights.json").read_text())
        start = resumed.step
    for step in range(start + 1, steps + 1):
        rng = random.Random(step)
        weights = [w * 0.9 + rng.uniform(-1, 1) for w in weights]
        runtime.report(step, steps)
        if runtime.time_to_checkpoint(step, every_steps=every):
            with runtime.checkpoint(step) as part:
                (part / "weights.json").write_text(json.dumps(weights))
        if kill_at is not None and step == kill_at and ctx.attempt == 0:
            committed = kill_at - kill_at % every
            deadline = time.monotonic() + 60
            while committed not in runtime.list_checkpoints():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"step {committed} never showed as committed")
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
    return {
        "weights": weights,
        "attempt": ctx.attempt,
        "resumed_from": resumed.step if resumed is not None else None,
        "committed": runtime.list_checkpoints(),
    }


def write_artifacts(size: int) -> str:
    from cumulus import runtime

    out = runtime.get_context().output_dir
    # No assert statement in a function sent by value: pytest rewrites them into calls
    # of its own module, which the worker does not have.
    if out is None:
        raise RuntimeError("no CUMULUS_OUTPUT_DIR")
    data = os.urandom(size)
    (out / "model").mkdir()
    (out / "model" / "weights.bin").write_bytes(data)
    (out / "notes.txt").write_text("trained\n")
    return hashlib.sha256(data).hexdigest()


def uses_the_demo_package() -> int:
    import h5demo  # type: ignore[import-not-found]

    return int(h5demo.VALUE) + 1


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """conftest's cluster (one coordinator, one worker), its agent finding uv on its
    PATH in a directory of its own, so the ranks' python3 is still the machine's."""
    root = tmp_path_factory.mktemp("cluster")
    env = {}
    if UV is not None:
        tools = root / "tools"
        tools.mkdir()
        (tools / "uv").symlink_to(UV)
        env["PATH"] = f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"
    with LocalCluster(root / "c", coordinators=1, workers=1, env=env) as c:
        yield c


def demo_wheel(directory: Path) -> Path:
    """A wheel of a one-module package ``h5demo`` 1.0, made here (no index, no build)."""
    files = {
        "h5demo/__init__.py": b"VALUE = 41\n",
        "h5demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: h5demo\nVersion: 1.0\n",
        "h5demo-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: cumulus-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(data)}")
    record.append("h5demo-1.0.dist-info/RECORD,,")
    files["h5demo-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "h5demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return wheel


@pytest.fixture(scope="module")
def other_user(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The token file of a second user (role ``submit``)."""
    token = tmp_path_factory.mktemp("other") / "token"
    r = cluster.cumulusctl("token", "create", "h5-other", "--role", "submit", "--out", str(token))
    assert r.returncode == 0, r.stderr + r.stdout
    return token


@pytest.fixture
def other(cluster: LocalCluster, other_user: Path) -> Iterator[cumulus.Client]:
    with cluster.client(token_file=other_user) as c:
        yield c


def project(root: Path) -> Path:
    """A directory to upload: a module, a gitignored file and .git."""
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("SCALE = 7\n")
    (root / "secret.env").write_text("TOKEN=do-not-send\n")
    (root / ".gitignore").write_text("*.env\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "show.py").write_text(
        textwrap.dedent(
            """\
            import json, os, pkg
            print(json.dumps({"files": sorted(os.listdir(".")), "scale": pkg.SCALE}))
            """
        )
    )
    return root


# -- tests --------------------------------------------------------------------------------


def test_run_returns_rank_0s_value_and_gathers_every_rank(
    cluster: LocalCluster, client: cumulus.Client
) -> None:
    single = client.run_async(where_am_i, "hi", times=2)
    both = client.run_async(where_am_i, "yo", world_size=2, gather=True)
    value = single.result(timeout=JOB_TIMEOUT_S)
    assert value["greeting"] == "hihi" and value["rank"] == 0, explain(single, cluster)
    assert value["job_id"] == single.id and value["python"] == list(sys.version_info[:2])
    # The copy of cloudpickle the job carries is the one loaded, whatever the worker has.
    assert f"/{_remote.RUN_DIR}/lib/cloudpickle/" in value["cloudpickle"], value
    # The rank runs in the job's working directory: the call's own files, nothing else.
    assert value["cwd_files"] == [_remote.RUN_DIR]
    values = both.result(timeout=JOB_TIMEOUT_S)
    assert [v["rank"] for v in values] == [0, 1] and {v["world_size"] for v in values} == {2}
    info = both.status()
    assert info.succeeded and info.restarts_used == 0
    assert info.command == ("python3", _remote.BOOTSTRAP, _remote.GATHER_FLAG)
    # A handle made from the id alone reads the same values (gather from the command).
    assert client.job(both.id).result() == values
    # The blocking form, with the product brief's spelling.
    assert client.run(func=where_am_i, greeting="ok", duration=600)["greeting"] == "ok"


def test_an_upload_is_the_ranks_directory_and_is_sent_once(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    root = project(tmp_path / "project")
    first = client.submit(["python3", "show.py"], upload=root, name="upload-1")
    assert first.upload is not None and first.upload.sent_bytes > 0
    assert first.upload.file_count == 3  # .gitignore, pkg/__init__.py, show.py
    again = client.submit(["python3", "show.py"], upload=root, name="upload-2")
    assert again.upload is not None and again.upload.sent_bytes == 0
    assert again.upload.blob == first.upload.blob
    for job in (first, again):
        info = job.wait(timeout_s=JOB_TIMEOUT_S)
        assert info.succeeded, explain(job, cluster)
        assert info.workdir == first.upload.blob
        lines = [x.line for x in job.logs(follow=False) if x.line.startswith("{")]
        seen = json.loads(lines[-1])
        assert seen == {"files": [".gitignore", "pkg", "show.py"], "scale": 7}, seen
    # A function run with the same upload imports from it.
    value = client.run(lambda: __import__("pkg").SCALE * 6, upload=root)
    assert value == 42


def test_a_remote_exception_is_raised_here_with_its_traceback(
    cluster: LocalCluster, client: cumulus.Client
) -> None:
    job = client.run_async(fail_deep, 3, max_restarts=0)
    with pytest.raises(errors.RemoteError) as e:
        job.result(timeout=JOB_TIMEOUT_S)
    err = e.value
    assert err.remote_type == "builtins.KeyError", explain(job, cluster)
    assert err.remote_message == "'missing shard at depth 0'" and err.rank == 0
    assert err.remote_traceback.count(", in fail_deep") == 4
    assert err.job is not None and err.job.state == "failed"
    assert "Remote traceback:" in str(err)


def test_a_python_version_mismatch_fails_the_job_once(
    cluster: LocalCluster, client: cumulus.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_remote, "client_python", lambda: "3.2")
    job = client.run_async(where_am_i, "never", max_restarts=3)
    with pytest.raises(errors.PythonVersionMismatch) as e:
        job.result(timeout=JOB_TIMEOUT_S)
    assert e.value.client == "3.2" and e.value.remote.startswith("3.")
    assert "pickled by Python 3.2" in str(e.value)
    info = job.status()
    assert info.state == "failed" and info.restarts_used == 0, explain(job, cluster)
    assert [r.attempt for r in info.ranks] == [0]


def test_a_killed_rank_resumes_exactly(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    faulty = client.run_async(
        train, 30, 17, 5, ckpt_dir=ckpt, max_restarts=2, options=FAST_RESTARTS
    )
    clean = client.run_async(train, 30, None, 5, ckpt_dir=ckpt, options=FAST_RESTARTS)
    killed = faulty.result(timeout=JOB_TIMEOUT_S)
    fault_free = clean.result(timeout=JOB_TIMEOUT_S)
    assert (killed["attempt"], killed["resumed_from"]) == (1, 15), explain(faulty, cluster)
    assert (fault_free["attempt"], fault_free["resumed_from"]) == (0, None)
    assert killed["weights"] == fault_free["weights"]  # bit for bit: floats compare exactly
    info = faulty.status()
    assert info.restarts_used == 1 and info.restarts[0].resume_step == 15
    assert "signal 9" in info.restarts[0].cause or "killed" in info.restarts[0].cause
    # list_checkpoints inside the rank saw the job's committed steps (ckpt_keep 3; the
    committed = killed["committed"]
    # last steps may still be committing when the function returns: the leader
    # finalizes a step after every part of it is in).
    assert committed == sorted(committed) and 15 <= committed[-1] <= 30, committed
    assert all(s % 5 == 0 for s in committed) and len(committed) <= 4
    # The job succeeds only once the last step its ranks completed is committed.
    assert faulty.checkpoints()[0].step == 30


def test_artifacts_round_trip_for_their_owner_only(
    cluster: LocalCluster, client: cumulus.Client, other: cumulus.Client, tmp_path: Path
) -> None:
    job = client.run_async(write_artifacts, 300_000)
    digest = job.result(timeout=JOB_TIMEOUT_S)
    files = {(a.rank, a.path): a.size_bytes for a in job.artifacts()}
    assert files == {
        (0, "model/weights.bin"): 300_000,
        (0, "notes.txt"): 8,
        (0, _contract.REMOTE_RESULT_FILE): files[(0, _contract.REMOTE_RESULT_FILE)],
    }
    written = job.download("model/weights.bin", tmp_path)
    assert written == tmp_path / "weights.bin"
    assert hashlib.sha256(written.read_bytes()).hexdigest() == digest
    with pytest.raises(FileNotFoundError, match=r"left no 'absent\.txt'"):
        job.download("absent.txt", tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="rank 3"):
        job.download("notes.txt", tmp_path / "x", rank=3)

    # Another user reads neither the job's artifacts nor their blob.
    (artifact,) = job.status().artifacts
    with pytest.raises((errors.Forbidden, errors.NotFound)):
        other.job(job.id).artifacts()
    with pytest.raises((errors.Forbidden, errors.NotFound)):
        _transfer.get_blob(other, artifact.blob)
    # Their own run works.
    assert other.run(where_am_i, "mine")["greeting"] == "mine"


def test_list_checkpoints_in_a_plain_rank(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    out = tmp_path / "steps.json"
    script = textwrap.dedent(
        f"""\
        import json, time
        from cumulus import runtime
        assert runtime.list_checkpoints() == []
        for step in range(1, 7):
            if runtime.time_to_checkpoint(step, every_steps=2):
                with runtime.checkpoint(step) as part:
                    (part / "w").write_text(str(step))
        deadline = time.monotonic() + 60
        while not (steps := runtime.list_checkpoints()) or steps[-1] != 6:
            assert time.monotonic() < deadline, steps
            time.sleep(0.05)
        open({str(out)!r}, "w").write(json.dumps(steps))
        """
    )
    job = client.submit(
        [sys.executable, "-c", script],
        ckpt_dir=tmp_path / "ckpt",
        ckpt_keep=2,
        name="list-checkpoints",
    )
    info = job.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded and info.restarts_used == 0, explain(job, cluster)
    # The leader may commit step 6 without 4 (a newer complete step supersedes an older
    # pending one), and prunes past ckpt_keep a little later.
    steps = json.loads(out.read_text())
    assert steps == sorted(steps) and steps[-1] == 6 and set(steps) <= {2, 4, 6}, steps
    assert info.committed_step == 6


@pytest.mark.skipif(UV is None, reason="uv is not installed (pip install -e './python[test]')")
def test_a_function_runs_in_an_environment_built_for_it(
    cluster: LocalCluster, client: cumulus.Client, tmp_path: Path
) -> None:
    wheels = demo_wheel(tmp_path / "wheels").parent
    options = {"find_links": [str(wheels)], "no_index": True}
    job = client.run_async(uses_the_demo_package, requirements=["h5demo==1.0"], options=options)
    assert job.result(timeout=JOB_TIMEOUT_S) == 42, explain(job, cluster)
    env = job.status().spec["environment"]
    # The environment's Python is the client's major.minor unless asked otherwise.
    assert env["python"] == _remote.client_python() and env["no_index"] is True
    # A second function with the same requirements runs in the same (cached) environment.
    first = client.run(where_am_i, "a", requirements=["h5demo==1.0"], options=options)
    again = client.run(where_am_i, "b", requirements=["h5demo==1.0"], options=options)
    assert first["executable"] == again["executable"] != sys.executable
    assert "/envs/" in first["executable"], first
