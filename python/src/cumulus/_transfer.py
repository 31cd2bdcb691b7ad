"""Blob transfers of the client SDK over the REST mirror of the blob store:
``HEAD /v1/blobs/{digest}`` (stored? its size as ``Content-Length``), ``PUT`` (the blob
streamed with its ``Content-Length``; 201 once a majority of the coordinators, or the S3
blob bucket, hold it) and ``GET`` (streamed). Every call follows the leader and rotates
like the JSON calls (:meth:`cumulus.Client._call`).

A downloaded blob is checked against its digest and size before anything reads it, and
kept in a temporary file (in memory while small), never unpacked onto a path.
"""

from __future__ import annotations

import os
import tempfile
from typing import IO, TYPE_CHECKING

import blake3
import httpx

from cumulus import _bundle, _contract, _upload_cache
from cumulus.errors import InvalidSpec, NotFound, ProtocolError, Unavailable
from cumulus.models import ArtifactRef, BlobRef, JobInfo, UploadInfo

if TYPE_CHECKING:
    from cumulus.client import Client

__all__ = [
    "BLOB_GET_TRIES",
    "BLOB_READ_TIMEOUT_S",
    "artifact_of",
    "get_blob",
    "put_blob",
    "read_artifact",
    "stat_blob",
    "upload_directory",
]

#: How long a blob ``PUT`` may wait for its answer, in seconds: the coordinator answers
#: once a majority of coordinators fsynced the blob.
BLOB_READ_TIMEOUT_S = 300.0
#: Tries of one blob download whose body broke off (a corrupt copy the coordinator
#: dropped mid-stream is fetched again by the next try).
BLOB_GET_TRIES = 3
#: Downloaded bytes kept in memory before they spill to a temporary file.
SPOOL_BYTES = 16 * 1024 * 1024


def _check_digest(digest: object) -> str:
    if (
        not isinstance(digest, str)
        or len(digest) != _contract.BLOB_DIGEST_HEX_LEN
        or any(c not in "0123456789abcdef" for c in digest)
    ):
        raise InvalidSpec(f"not a blob digest (64 lowercase hex digits): {digest!r}", status=None)
    return digest


def stat_blob(client: Client, digest: str) -> int | None:
    """The size of blob ``digest`` when the cluster holds it, else ``None``."""
    path = f"/v1/blobs/{_check_digest(digest)}"
    try:
        resp, base = client._call("HEAD", path, lambda base: client._http.head(base + path))
    except NotFound:
        return None
    length = resp.headers.get("content-length", "")
    if not length.isdigit():
        raise ProtocolError(f"HEAD {path}: no Content-Length in the answer", address=base)
    return int(length)


def put_blob(client: Client, packed: _bundle.PackedDir) -> BlobRef:
    """Stores ``packed`` in the cluster's blob store, streamed; returns its reference.

    :raises ApiError: the coordinators refused it (e.g. larger than they accept, a
        digest mismatch, the caller's quota)."""
    path = f"/v1/blobs/{packed.digest}"
    timeout = httpx.Timeout(
        client._timeout.read, connect=client._timeout.connect, read=BLOB_READ_TIMEOUT_S
    )
    headers = {
        "Content-Length": str(packed.size_bytes),
        "Content-Type": "application/octet-stream",
    }

    def send(base: str) -> httpx.Response:
        return client._http.put(
            base + path, content=packed.chunks(), headers=headers, timeout=timeout
        )

    resp, base = client._call("PUT", path, send)
    try:
        answer = resp.json()
    except ValueError as e:
        raise ProtocolError(f"PUT {path}: the answer is not JSON", address=base) from e
    ref = BlobRef.from_json(answer)
    if ref != BlobRef(packed.digest, packed.size_bytes):
        raise ProtocolError(f"PUT {path}: the coordinator stored {ref}", address=base)
    return ref


def upload_directory(
    client: Client,
    upload: str | os.PathLike[str] | _bundle.PackedDir,
    *,
    max_bytes: int = _contract.DEFAULT_MAX_WORKDIR_BYTES,
) -> UploadInfo:
    """Packs ``upload`` (unless it is packed already) and stores it unless the cluster
    has its digest (then nothing is sent).

    A directory whose tree is unchanged since its last pack (:mod:`cumulus._upload_cache`)
    is not packed again when the cluster still has that pack's digest.

    :raises WorkdirTooLarge: past ``max_bytes`` packed bytes (the largest files named).
    :raises BundleError: the directory cannot be packed."""
    if not isinstance(upload, _bundle.PackedDir) and _upload_cache.enabled():
        return _upload_cached(client, upload, max_bytes)
    owned = not isinstance(upload, _bundle.PackedDir)
    packed = (
        upload
        if isinstance(upload, _bundle.PackedDir)
        else _bundle.pack_directory(upload, max_bytes=max_bytes)
    )
    try:
        return _send(client, packed)
    finally:
        if owned:
            packed.close()


def _send(client: Client, packed: _bundle.PackedDir) -> UploadInfo:
    """Stores ``packed`` unless the cluster has its digest."""
    ref = BlobRef(packed.digest, packed.size_bytes)
    stored = stat_blob(client, packed.digest)
    sent = 0
    if stored != packed.size_bytes:
        put_blob(client, packed)
        sent = packed.size_bytes
    return UploadInfo(
        blob=ref,
        sent_bytes=sent,
        file_count=packed.file_count,
        unpacked_bytes=packed.unpacked_bytes,
    )


def _upload_cached(client: Client, root: str | os.PathLike[str], max_bytes: int) -> UploadInfo:
    """:func:`upload_directory` of a directory through the digest cache: a trusted entry
    whose blob the cluster holds sends and packs nothing; otherwise the directory is
    packed (and the entry refreshed) and sent as without the cache."""
    limit = min(max_bytes, _contract.MAX_UNPACKED_BYTES)
    listing = _upload_cache.list_directory(root, limit)
    hit = _upload_cache.lookup(listing)
    if hit is not None and stat_blob(client, hit.digest) == hit.size_bytes:
        return UploadInfo(
            blob=BlobRef(hit.digest, hit.size_bytes),
            sent_bytes=0,
            file_count=hit.file_count,
            unpacked_bytes=hit.unpacked_bytes,
        )
    hash_files = _upload_cache.hash_files_for(listing)
    with _bundle.pack_selection(
        listing.selection, max_bytes=max_bytes, hash_files=hash_files or frozenset()
    ) as packed:
        if hash_files is not None:
            _upload_cache.record(listing, packed)
        return _send(client, packed)


def _receive(resp: httpx.Response, ref: BlobRef, sink: IO[bytes]) -> str | None:
    """Copies a blob's body into ``sink``; ``None`` when it is whole and verifies, else
    what is wrong."""
    hasher = blake3.blake3()
    got = 0
    for chunk in resp.iter_bytes():
        got += len(chunk)
        if got > ref.size_bytes:
            return f"the body is longer than the blob's {ref.size_bytes} bytes"
        hasher.update(chunk)
        sink.write(chunk)
    if got != ref.size_bytes:
        return f"the body broke off after {got} of {ref.size_bytes} bytes"
    if hasher.hexdigest() != ref.digest:
        return "the bytes do not match the digest"
    return None


def get_blob(client: Client, ref: BlobRef) -> IO[bytes]:
    """Blob ``ref``'s bytes in a temporary file (close it when done), checked against its
    size and digest.

    :raises NotFound: no such blob (or not the caller's to read, where the cluster hides
        it).
    :raises Forbidden: the blob is not the caller's to read.
    :raises Unavailable: every try broke off or did not verify."""
    path = f"/v1/blobs/{_check_digest(ref.digest)}"
    if not 0 <= ref.size_bytes <= _contract.MAX_BLOB_BYTES:
        raise ProtocolError(f"blob {ref.digest} has a size of {ref.size_bytes} bytes")
    problem = "no try made"
    for _ in range(BLOB_GET_TRIES):
        sink: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115
        try:
            resp, _base = client._call(
                "GET",
                path,
                lambda base: client._http.send(
                    client._http.build_request("GET", base + path), stream=True
                ),
            )
            try:
                problem = _receive(resp, ref, sink) or ""
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}"
            finally:
                resp.close()
            if not problem:
                sink.seek(0)
                return sink
        except BaseException:
            sink.close()
            raise
        sink.close()
    raise Unavailable(f"GET {path}: {problem} ({BLOB_GET_TRIES} tries)", status=None)


def read_artifact(
    client: Client,
    artifact: ArtifactRef,
    *,
    want: str | frozenset[str] | None = None,
    read_all: bool = False,
) -> list[_bundle.ArchiveFile]:
    """The files of one rank attempt's artifacts (see :func:`cumulus._bundle.read_archive`)."""
    blob = get_blob(client, artifact.blob)
    with blob:
        return _bundle.read_archive(
            blob,
            artifact.blob.size_bytes,
            what=f"the artifacts of rank {artifact.rank} attempt {artifact.attempt}",
            want=want,
            read_all=read_all,
        )


def artifact_of(info: JobInfo, rank: int) -> ArtifactRef | None:
    """Rank ``rank``'s newest artifacts in ``info``, ``None`` when it left none."""
    found = [a for a in info.artifacts if a.rank == rank]
    return max(found, key=lambda a: a.attempt) if found else None
