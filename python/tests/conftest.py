"""Fixtures: real local clusters (``cumulusctl local up`` in a temp dir) and data sets."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import cumulus
from localcluster import DIGITS, LocalCluster, binaries_missing

PROGRAMS = Path(__file__).resolve().parent / "programs"
#: The rank program of the integration tests, run by this interpreter (it has cumulus).
TRAINER = [sys.executable, str(PROGRAMS / "counting_trainer.py")]
#: A self-signed CA certificate (P-256, valid until 2126) that signed nothing a cluster
#: presents: a well-formed CA for the configuration tests, and the wrong CA for a real
#: cluster.
UNRELATED_CA_PEM = """\
-----BEGIN CERTIFICATE-----
MIIBjDCCATGgAwIBAgIUJ/QHw5TKMPv1qf832CwM3PoJDEwwCgYIKoZIzj0EAwIw
GjEYMBYGA1UEAwwPY3VtdWx1cyB0ZXN0IENBMCAXDTI2MTEyNjE2MjMxNloYDzIx
MjYxMTAyMTYyMzE2WjAaMRgwFgYDVQQDDA9jdW11bHVzIHRlc3QgQ0EwWTATBgcq
hkjOPQIBBggqhkjOPQMBBwNCAAQotvqWtZcC686FWz8tMz5j3Zu7Vwp59UBCc5oc
eMoOGEY0H1n5rMzJLXkoWOg3w9RTRBlxAYGoUBBmZyGBOdlGo1MwUTAdBgNVHQ4E
FgQUTNtku6wAiC1VjRbC1Xeb4EY7sBAwHwYDVR0jBBgwFoAUTNtku6wAiC1VjRbC
1Xeb4EY7sBAwDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNJADBGAiEAyd5f
eVyUpxlvysah4VHE6o4QTTzFNE7J4Zh/iTBQLAICIQDTHzF0QGQTvQlJeTZF596P
DWKoYxyBUKkcHE+KUCEt3Q==
-----END CERTIFICATE-----
"""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = binaries_missing()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One coordinator and one worker with 4 slots, shared by a test module."""
    with LocalCluster(tmp_path_factory.mktemp("cluster"), coordinators=1, workers=1) as c:
        yield c


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[cumulus.Client]:
    with cluster.client() as c:
        yield c


@pytest.fixture
def ha_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three coordinators and one worker, for one test (it kills coordinators)."""
    with LocalCluster(tmp_path_factory.mktemp("ha"), coordinators=3, workers=1) as c:
        yield c


@pytest.fixture
def ha_client(ha_cluster: LocalCluster) -> Iterator[cumulus.Client]:
    with ha_cluster.client() as c:
        yield c


SHARDS = 4
RECORDS_PER_SHARD = 20


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """4 CSV shards of 20 ``id,value`` records each (values 1..80)."""
    d = tmp_path / "dataset"
    d.mkdir()
    for s in range(SHARDS):
        rows = (
            f"{s * RECORDS_PER_SHARD + i},{s * RECORDS_PER_SHARD + i + 1}\n"
            for i in range(RECORDS_PER_SHARD)
        )
        (d / f"part-{s:02d}.csv").write_text("".join(rows))
    return d


@pytest.fixture
def digits_shards(cluster: LocalCluster, tmp_path: Path) -> Path:
    """The bundled digits data split into 4 shards by ``cumulusctl dataset split``."""
    out = tmp_path / "digits"
    r = cluster.cumulusctl("dataset", "split", str(DIGITS), "--shards", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr + r.stdout
    return out
