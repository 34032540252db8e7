"""Signature Version 4 as the AWS documentation's worked examples sign them.

The vectors (keys, dates, requests and signatures) are the ones AWS publishes
for S3's header-based authentication ("Examples of signature calculations"):
if the canonical request, the string to sign or the key derivation is wrong
in any byte, the signature differs.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from rekindle_store.s3 import EMPTY_SHA256, Bucket, Credentials, authorization, quote

CREDS = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
WHEN = datetime(2013, 5, 24, tzinfo=UTC)
HOST = "examplebucket.s3.amazonaws.com"


def _signature(header: str) -> str:
    return header.rsplit("Signature=", 1)[1]


def test_a_ranged_get_signs_as_the_aws_example() -> None:
    headers = {
        "host": HOST,
        "range": "bytes=0-9",
        "x-amz-content-sha256": EMPTY_SHA256,
        "x-amz-date": "20130524T000000Z",
    }
    auth = authorization(CREDS, "us-east-1", "GET", "/test.txt", {}, headers, EMPTY_SHA256, WHEN)
    assert auth.startswith(
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
    )
    assert _signature(auth) == "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"


def test_a_listing_signs_its_query_sorted_as_the_aws_example() -> None:
    headers = {"host": HOST, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": "20130524T000000Z"}
    # Given in the other order: the canonical query sorts them.
    query = {"prefix": "J", "max-keys": "2"}
    auth = authorization(CREDS, "us-east-1", "GET", "/", query, headers, EMPTY_SHA256, WHEN)
    assert _signature(auth) == "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"


def test_keys_are_encoded_per_byte_keeping_slashes_in_paths_only() -> None:
    assert quote("ns/ckpt a+b~c", safe="/") == "ns/ckpt%20a%2Bb~c"
    assert quote("a/b") == "a%2Fb"


def test_credentials_come_from_a_mounted_secret_and_say_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "accessKeyID").write_text("AK\n")
    with pytest.raises(ValueError, match="accessKeyID and secretAccessKey"):
        Credentials.from_dir(tmp_path)
    (tmp_path / "secretAccessKey").write_text("SK\n")
    creds = Credentials.from_dir(tmp_path)
    assert (creds.access_key, creds.secret_key) == ("AK", "SK")
    assert "SK" not in repr(creds)


@pytest.mark.parametrize(
    ("endpoint", "bucket"), [("s3.local:8333", "b"), ("ftp://h", "b"), ("http://h", "a/b")]
)
def test_a_bad_endpoint_or_bucket_is_refused_with_its_form(endpoint: str, bucket: str) -> None:
    with pytest.raises(ValueError, match=r"http\(s\)://HOST|plain name"):
        Bucket(endpoint, bucket, CREDS)
