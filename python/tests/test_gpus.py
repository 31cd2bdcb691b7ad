"""GPUs through the SDK on a machine without GPUs: a real local cluster whose worker's
``--gpus`` (``CUMULUS_GPUS``) names a JSON inventory of one fake GPU. The agent never
touches the GPU: it names it in each rank's ``CUDA_VISIBLE_DEVICES``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import cumulus
from localcluster import LocalCluster, explain, wait_for

pytestmark = pytest.mark.cluster

JOB_TIMEOUT_S = 60
UUID = "GPU-fake-0"
#: The worker's inventory (``memory_used_bytes``, ``utilization_percent``: what its
#: heartbeats report, as NVML would).
INVENTORY = [
    {
        "index": 0,
        "uuid": UUID,
        "name": "Fake GPU 80GB",
        "memory_total_bytes": 80 << 30,
        "memory_used_bytes": 3 << 30,
        "utilization_percent": 7,
    }
]
#: A rank that writes ``CUDA_VISIBLE_DEVICES|CUMULUS_GPU_MEMORY_FRACTION`` to ``$OUT``.
WRITE_GPU_ENV = [
    "sh",
    "-c",
    'printf "%s|%s" "$CUDA_VISIBLE_DEVICES" "${CUMULUS_GPU_MEMORY_FRACTION:-}" > "$OUT"',
]


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One coordinator and one worker with 4 slots and the fake GPU."""
    base = tmp_path_factory.mktemp("gpu-cluster")
    inventory = base / "gpus.json"
    inventory.write_text(json.dumps(INVENTORY))
    with LocalCluster(base / "cluster", env={"CUMULUS_GPUS": str(inventory)}) as c:
        yield c


@pytest.fixture
def gpu_client(gpu_cluster: LocalCluster) -> Iterator[cumulus.Client]:
    with gpu_cluster.client() as c:
        yield c


def test_the_cluster_lists_the_workers_gpu(gpu_client: cumulus.Client) -> None:
    def gpu_with_status() -> cumulus.GpuInfo | None:
        (worker,) = gpu_client.cluster().workers
        return next((g for g in worker.gpus if g.healthy is not None), None)

    gpu = wait_for(gpu_with_status, 30, "the GPU's first heartbeat reading")
    assert (gpu.index, gpu.uuid, gpu.name) == (0, UUID, "Fake GPU 80GB")
    assert gpu.memory_total_bytes == 80 << 30
    assert (gpu.memory_used_bytes, gpu.utilization_percent) == (3 << 30, 7)
    assert gpu.healthy is True and gpu.error == ""
    assert 0.0 <= gpu.allocated <= 1.0


def test_a_rank_gets_its_gpu_in_cuda_visible_devices(
    gpu_cluster: LocalCluster, gpu_client: cumulus.Client, tmp_path: Path
) -> None:
    out = tmp_path / "whole"
    job = gpu_client.submit(WRITE_GPU_ENV, env={"OUT": str(out)}, gpus_per_rank=1)
    info = job.wait(timeout_s=JOB_TIMEOUT_S)
    assert info.succeeded, explain(job, gpu_cluster)
    assert out.read_text() == f"{UUID}|"
    assert (info.gpus_per_rank, info.gpu_memory_fraction) == (1, None)
    assert job.status().ranks[0].gpus == (UUID,)
    assert info.pending_reason == ""


def test_a_rank_gets_its_gpu_memory_fraction(
    gpu_cluster: LocalCluster, gpu_client: cumulus.Client, tmp_path: Path
) -> None:
    out = tmp_path / "half"
    info = gpu_client.run(
        WRITE_GPU_ENV, env={"OUT": str(out)}, gpu_memory_fraction=0.5, timeout_s=JOB_TIMEOUT_S
    )
    assert out.read_text() == f"{UUID}|0.5"
    assert (info.gpus_per_rank, info.gpu_memory_fraction) == (1, 0.5)
    assert info.ranks[0].gpus == (UUID,)


def test_a_job_needing_more_gpus_than_exist_stays_pending_with_the_reason(
    gpu_client: cumulus.Client, tmp_path: Path
) -> None:
    with pytest.raises(cumulus.InvalidSpec, match="larger than the cluster"):
        gpu_client.submit(WRITE_GPU_ENV, gpus_per_rank=2)
    job = gpu_client.submit(
        WRITE_GPU_ENV, env={"OUT": str(tmp_path / "never")}, gpus_per_rank=2, allow_pending=True
    )
    try:

        def with_reason() -> cumulus.JobInfo | None:
            info = job.status()
            return info if info.pending_reason else None

        info = wait_for(with_reason, 30, f"{job.id} to show a pending reason")
        assert info.state == "pending", info
        assert "cannot be placed" in info.pending_reason, info.pending_reason
        assert all(r.gpus == () for r in info.ranks), info.ranks
    finally:
        assert job.cancel().state == "cancelled"
    assert not (tmp_path / "never").exists()
