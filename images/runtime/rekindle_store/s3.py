"""The few S3 calls a checkpoint store needs, signed with AWS Signature Version 4.

Standard library only (http.client, hmac), so the node agent's image carries no
SDK. Path-style addressing (https://ENDPOINT/BUCKET/KEY): what every
S3-compatible server (SeaweedFS, Ceph RGW, MinIO, cloud stores with a custom
endpoint) accepts. Each call opens its own connection, so one Bucket object can
be shared by many threads (the parallel ranged reads of a pull).

Signing follows the AWS documentation (Signature Version 4, "Create a signed
AWS API request"): canonical request, string to sign, a key derived per day,
region and service. Bodies are signed by their SHA-256 (never UNSIGNED-PAYLOAD,
so a plain-HTTP endpoint inside a cluster still has its bodies bound to the
signature).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import ssl
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_UNRESERVED = "-_.~"
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
RETRIES = 3


class S3Error(RuntimeError):
    """A call failed: status is the HTTP status (0: no answer), code S3's error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    @property
    def unreachable(self) -> bool:
        """No answer, or the server said it cannot answer now: worth a retry."""
        return self.status == 0 or self.status >= 500


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str = field(repr=False)

    @staticmethod
    def from_dir(path: Path) -> Credentials:
        """Read accessKeyID and secretAccessKey, the files a mounted Secret holds."""
        try:
            ak = (path / "accessKeyID").read_text().strip()
            sk = (path / "secretAccessKey").read_text().strip()
        except OSError as e:
            raise ValueError(
                f"{path}: the object store's Secret must hold keys accessKeyID and "
                f"secretAccessKey ({e.strerror or e})"
            ) from e
        if not ak or not sk:
            raise ValueError(f"{path}: accessKeyID and secretAccessKey must not be empty")
        return Credentials(ak, sk)


def quote(value: str, safe: str = "") -> str:
    """URI-encode as SigV4 wants it: every byte but A-Z a-z 0-9 - _ . ~ (and safe)."""
    return urllib.parse.quote(value, safe=_UNRESERVED + safe)


def signing_key(secret: str, day: str, region: str, service: str = "s3") -> bytes:
    k = hmac.new(("AWS4" + secret).encode(), day.encode(), hashlib.sha256).digest()
    for part in (region, service, "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    return k


def authorization(
    creds: Credentials,
    region: str,
    method: str,
    path: str,
    query: dict[str, str],
    headers: dict[str, str],
    payload_sha256: str,
    when: datetime,
) -> str:
    """The Authorization header for a request (headers: every header to sign, host
    and x-amz-date among them; path: already URI-encoded)."""
    amz_date = when.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    canon_query = "&".join(
        f"{quote(k)}={quote(v)}" for k, v in sorted(query.items(), key=lambda kv: kv[0])
    )
    names = sorted(h.lower() for h in headers)
    lower = {k.lower(): " ".join(str(v).split()) for k, v in headers.items()}
    canon_headers = "".join(f"{n}:{lower[n]}\n" for n in names)
    signed = ";".join(names)
    canonical = "\n".join([method, path, canon_query, canon_headers, signed, payload_sha256])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    sig = hmac.new(signing_key(creds.secret_key, day, region), to_sign.encode(), hashlib.sha256)
    return (
        f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
        f"SignedHeaders={signed}, Signature={sig.hexdigest()}"
    )


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str = ""  # as the store lists it, quotes removed (an MD5 for a single-part upload)


class _Answer(NamedTuple):
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes  # empty where the body was read into the caller's buffer
    filled: int = 0  # how many bytes went into that buffer


class Bucket:
    """One bucket of an S3-compatible endpoint."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        creds: Credentials,
        region: str = "us-east-1",
        ca_file: Path | None = None,
        timeout: float = 60.0,
    ) -> None:
        url = urllib.parse.urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{endpoint!r}: an endpoint is http(s)://HOST[:PORT]")
        if not bucket or "/" in bucket:
            raise ValueError(f"{bucket!r}: a bucket is a plain name")
        self.endpoint = endpoint
        self.scheme = url.scheme
        self.netloc = url.netloc
        self.bucket = bucket
        self.creds = creds
        self.region = region
        self.timeout = timeout
        self._tls = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)

    def __repr__(self) -> str:
        return f"Bucket({self.endpoint}/{self.bucket})"

    # -- the calls -----------------------------------------------------------------

    def create(self) -> None:
        """Create the bucket (an existing one of ours is fine)."""
        try:
            self._call("PUT", "", ok=(200,))
        except S3Error as e:
            if e.code != "BucketAlreadyOwnedByYou":
                raise

    def put(self, key: str, body: bytes) -> str:
        """Store body under key; its ETag."""
        return self._call("PUT", key, body=body, ok=(200,)).headers.get("etag", "")

    def get(self, key: str, start: int = 0, end: int | None = None, limit: int = 0) -> bytes:
        """Bytes [start, end) of key (end None: to its end). limit: refuse more than that."""
        headers = {}
        if start or end is not None:
            headers["range"] = f"bytes={start}-{'' if end is None else end - 1}"
        return self._call("GET", key, headers=headers, ok=(200, 206), limit=limit).body

    def get_into(self, key: str, start: int, buf: memoryview) -> int:
        """Read bytes [start, start + len(buf)) of key straight into buf; how many came
        (fewer: the object is shorter). No intermediate copy: a pull passes a slice of
        the staging file's mapping, so the bytes go from the socket to the page cache."""
        headers = {"range": f"bytes={start}-{start + len(buf) - 1}"}
        return self._call("GET", key, headers=headers, ok=(206, 200), into=buf).filled

    def head(self, key: str) -> ObjectInfo | None:
        """key's size (None: no such object)."""
        try:
            headers = self._call("HEAD", key, ok=(200,)).headers
        except S3Error as e:
            if e.status == 404:
                return None
            raise
        return ObjectInfo(key, int(headers.get("content-length", "0")))

    def delete(self, key: str) -> None:
        self._call("DELETE", key, ok=(200, 204))

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with prefix."""
        token = ""
        while True:
            query = {"list-type": "2", "prefix": prefix}
            if token:
                query["continuation-token"] = token
            body = self._call("GET", "", query=query, ok=(200,)).body
            root = ET.fromstring(body)
            for c in root.iter(f"{_NS}Contents"):
                yield ObjectInfo(
                    c.findtext(f"{_NS}Key", ""),
                    int(c.findtext(f"{_NS}Size", "0")),
                    c.findtext(f"{_NS}ETag", "").strip('"'),
                )
            token = root.findtext(f"{_NS}NextContinuationToken", "")
            if root.findtext(f"{_NS}IsTruncated", "false") != "true" or not token:
                return

    def start_upload(self, key: str) -> str:
        """A multipart upload's id (for files larger than one PUT should carry)."""
        body = self._call("POST", key, query={"uploads": ""}, ok=(200,)).body
        upload = ET.fromstring(body).findtext(f"{_NS}UploadId", "")
        if not upload:
            raise S3Error(200, "NoUploadId", f"{self}: {key}: no UploadId in the answer")
        return upload

    def put_part(self, key: str, upload: str, number: int, body: bytes) -> str:
        query = {"partNumber": str(number), "uploadId": upload}
        return self._call("PUT", key, query=query, body=body, ok=(200,)).headers.get("etag", "")

    def finish_upload(self, key: str, upload: str, etags: list[str]) -> None:
        parts = "".join(
            f"<Part><PartNumber>{i}</PartNumber><ETag>{etag}</ETag></Part>"
            for i, etag in enumerate(etags, start=1)
        )
        body = f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode()
        answer = self._call("POST", key, query={"uploadId": upload}, body=body, ok=(200,)).body
        # S3 may answer 200 with an error document once the parts are joined.
        if b"<Error>" in answer:
            code = ET.fromstring(answer).findtext("Code", "InternalError")
            raise S3Error(500, code, f"{self}: {key}: the upload did not complete ({code})")

    def abort_upload(self, key: str, upload: str) -> None:
        self._call("DELETE", key, query={"uploadId": upload}, ok=(200, 204))

    # -- one signed request ---------------------------------------------------------

    def _call(
        self,
        method: str,
        key: str,
        query: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        ok: tuple[int, ...] = (200,),
        limit: int = 0,
        into: memoryview | None = None,
    ) -> _Answer:
        """One call, retried (RETRIES times, backing off) while the server is unreachable
        or says 5xx. Raises S3Error for any other answer. With into, a successful
        answer's body is read into it (its length: filled)."""
        for attempt in range(RETRIES):
            try:
                return self._once(method, key, query or {}, headers or {}, body, ok, limit, into)
            except S3Error as e:
                if not e.unreachable or attempt == RETRIES - 1:
                    raise
                time.sleep(0.2 * 4**attempt)
        raise AssertionError("unreachable")

    def _once(
        self,
        method: str,
        key: str,
        query: dict[str, str],
        extra: dict[str, str],
        body: bytes,
        ok: tuple[int, ...],
        limit: int,
        into: memoryview | None = None,
    ) -> _Answer:
        path = "/" + quote(self.bucket) + ("/" + quote(key, safe="/") if key else "")
        payload = hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256
        when = datetime.now(UTC)
        headers = {
            "host": self.netloc,
            "x-amz-date": when.strftime("%Y%m%dT%H%M%SZ"),
            "x-amz-content-sha256": payload,
            **extra,
        }
        headers["authorization"] = authorization(
            self.creds, self.region, method, path, query, headers, payload, when
        )
        target = path + (
            "?" + "&".join(f"{quote(k)}={quote(v)}" for k, v in query.items()) if query else ""
        )
        conn = self._connection()
        try:
            conn.request(method, target, body=body or None, headers=headers)
            resp = conn.getresponse()
            length = int(resp.getheader("content-length") or 0)
            if limit and resp.status in ok and length > limit:
                raise S3Error(
                    resp.status, "TooLarge", f"{self}: {key}: {length} bytes, at most {limit} read"
                )
            data, filled = b"", 0
            if into is not None and resp.status in ok:
                if length > len(into):
                    raise S3Error(
                        resp.status, "TooLarge", f"{self}: {key}: {length} bytes, {len(into)} asked"
                    )
                filled = _read_into(resp, into[:length])
            else:
                data = resp.read()
            answer = {k.lower(): v for k, v in resp.getheaders()}
        except (OSError, http.client.HTTPException) as e:
            raise S3Error(0, "Unreachable", f"{self}: {method} {key or '/'}: {e}") from e
        finally:
            conn.close()
        if resp.status not in ok:
            raise S3Error(
                resp.status,
                _error_code(data, resp.status),
                _message(self, method, key, resp.status, data),
            )
        return _Answer(resp.status, answer, data, filled)

    def _connection(self) -> http.client.HTTPConnection:
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.netloc, timeout=self.timeout, context=self._tls)
        return http.client.HTTPConnection(self.netloc, timeout=self.timeout)


def _read_into(resp: http.client.HTTPResponse, buf: memoryview) -> int:
    """Fill buf from the body (it ends early only if the server stops early)."""
    got = 0
    while got < len(buf):
        n = resp.readinto(buf[got:])
        if not n:
            break
        got += n
    return got


def _error_code(body: bytes, status: int) -> str:
    try:
        return ET.fromstring(body).findtext("Code") or str(status)
    except ET.ParseError:
        return "NoSuchKey" if status == 404 else str(status)


def _message(bucket: Bucket, method: str, key: str, status: int, body: bytes) -> str:
    try:
        detail = ET.fromstring(body).findtext("Message") or ""
    except ET.ParseError:
        detail = body[:200].decode(errors="replace")
    code = _error_code(body, status)
    return f"{bucket}: {method} {key or '/'}: HTTP {status} {code} {detail}".strip()
