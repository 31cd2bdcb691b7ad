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
#: A self-signed user certificate naming ``cumulus://user/test`` (P-256, valid until
#: 2126), and its key: a well-formed client certificate for the configuration tests.
USER_CERT_PEM = """\
-----BEGIN CERTIFICATE-----
MIIBnDCCAUKgAwIBAgIUcAUtEW1IjWkrI3krkKLpgeiJc0QwCgYIKoZIzj0EAwIw
FDESMBAGA1UEAwwJdXNlciB0ZXN0MCAXDTI2MTEyNzA3NDE1MloYDzIxMjYxMTAz
MDc0MTUyWjAUMRIwEAYDVQQDDAl1c2VyIHRlc3QwWTATBgcqhkjOPQIBBggqhkjO
PQMBBwNCAATI/w1p+Ortn9MkM+DQqsZpxexu6Hb9j4R5rxmYuL+A+f/OS2hAt0ko
+hs58CKvg3GtlPNbC+L/hOG2uTfQgVT+o3AwbjAdBgNVHQ4EFgQUph17fYGame0R
S/e7UtKxCeDWdOUwHwYDVR0jBBgwFoAUph17fYGame0RS/e7UtKxCeDWdOUwHgYD
VR0RBBcwFYYTY3VtdWx1czovL3VzZXIvdGVzdDAMBgNVHRMBAf8EAjAAMAoGCCqG
SM49BAMCA0gAMEUCIHHMVWQiU+JYrF7AajZJJU95cyPCCfxDxn0NC8LeGCiNAiEA
l/LD13Jb+/DbCfHbno8KGu5C3CJs43CdzS0lYpIShqg=
-----END CERTIFICATE-----
"""
USER_KEY_PEM = """\
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgUzKRXxjfVe5IlTQ/
U6rbnD8VT8CLzcUAy2WEj7C/dIChRANCAATI/w1p+Ortn9MkM+DQqsZpxexu6Hb9
j4R5rxmYuL+A+f/OS2hAt0ko+hs58CKvg3GtlPNbC+L/hOG2uTfQgVT+
-----END PRIVATE KEY-----
"""
#: ``USER_KEY_PEM`` encrypted with a passphrase (``x``).
ENCRYPTED_USER_KEY_PEM = """\
-----BEGIN ENCRYPTED PRIVATE KEY-----
MIHsMFcGCSqGSIb3DQEFDTBKMCkGCSqGSIb3DQEFDDAcBAjVCNsUBUbb0wICCAAw
DAYIKoZIhvcNAgkFADAdBglghkgBZQMEASoEEPEpH1HwloXajDNrQ8ZbemIEgZAN
NLXItgr3QxFCX0FbMhqZT3Jt0sX08vehN48wM6M1ZVijq9zczdmmJfdSLmv864sR
oRHRWkV6+fCbV6RYIwDi7TZmItgEQZeyu/sVEahtJNrbUtB0qnSXLrFu75j3JE+s
sSCzIDZ2cYgdg0vSZ0kRtvXyA7U0qcmcrX8+RkJSV/B9Fusw/iZFZS+CZCqpers=
-----END ENCRYPTED PRIVATE KEY-----
"""
#: A P-256 key that matches no certificate here.
OTHER_KEY_PEM = """\
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgcV7owyZjXo9H6Fc/
sDuoVm97IhMPPAnV9cXrniCt1GuhRANCAATPduj7rJsp7Uy77jmbAMLfANNu+cId
TnvhFqqL/oS8EOHHM1jqAN2Z+e7ZnkiPEhZuQmrNgYJ0liZD/wVjUSiA
-----END PRIVATE KEY-----
"""
#: A self-signed certificate naming ``cumulus://worker/w1``: not a user's.
WORKER_CERT_PEM = """\
-----BEGIN CERTIFICATE-----
MIIBnzCCAUWgAwIBAgIUPpnpf3ixUFmQ4A12Sl9dsNiYH2UwCgYIKoZIzj0EAwIw
FDESMBAGA1UEAwwJd29ya2VyIHcxMCAXDTI2MTEyNzA3NDE1MloYDzIxMjYxMTAz
MDc0MTUyWjAUMRIwEAYDVQQDDAl3b3JrZXIgdzEwWTATBgcqhkjOPQIBBggqhkjO
PQMBBwNCAAQLfrSJZB723fP9hURFOpn27818ESS9toY+p9fxv3gLHsRdNaqTwRfh
o+AER8IQYKyaaqJJ/zTTp/U17XRzCCQ5o3MwcTAdBgNVHQ4EFgQUQm/I0JjQpcOt
ZfgRrXX8xgjpjbcwHwYDVR0jBBgwFoAUQm/I0JjQpcOtZfgRrXX8xgjpjbcwDwYD
VR0TAQH/BAUwAwEB/zAeBgNVHREEFzAVhhNjdW11bHVzOi8vd29ya2VyL3cxMAoG
CCqGSM49BAMCA0gAMEUCICquK4nBayCOgjjkRdpGnCHO7FuC/IIUR14vfU42FvC8
AiEAs8g3YYAHQto9EXNReiHrVQcKiqqIoJkpsXgrVVjjtkk=
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


@pytest.fixture(autouse=True)
def _own_upload_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test's client-side upload digest cache in a directory of its own, never the
    user's ``~/.cache``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    monkeypatch.delenv("CUMULUS_NO_UPLOAD_CACHE", raising=False)


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
