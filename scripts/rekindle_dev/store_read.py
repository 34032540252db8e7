"""A plain parallel reader: the yardstick a pull from an object store is held to.

It reads every object under a prefix with the pull's ranges (16 MiB) and number of
requests in flight, and drops the bytes: no file, no hash. What it takes is what the
store and the network give, the limit any pull meets. `rekindle-dev bench
scale-out` runs it inside the second node's network namespace, against the
checkpoint that node's pull fetches, beside each pull trial:

    ip netns exec rekindle-node-2 python -m rekindle_dev.store_read ENDPOINT BUCKET PREFIX

Credentials come from the environment (REKINDLE_S3_ACCESS_KEY,
REKINDLE_S3_SECRET_KEY), never the command line. Prints one JSON line: bytes,
seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from rekindle_store.object_copy import PART_BYTES
from rekindle_store.s3 import Bucket, Credentials

ACCESS_ENV, SECRET_ENV = "REKINDLE_S3_ACCESS_KEY", "REKINDLE_S3_SECRET_KEY"


def ranges(bucket: Bucket, prefix: str) -> list[tuple[str, int, int]]:
    """Every object under prefix in PART_BYTES ranges, the largest object first (as a
    pull orders them)."""
    objects = sorted(bucket.list_objects(prefix), key=lambda o: -o.size)
    return [
        (o.key, start, min(start + PART_BYTES, o.size))
        for o in objects
        for start in range(0, o.size, PART_BYTES)
    ]


def read(bucket: Bucket, jobs: list[tuple[str, int, int]], threads: int) -> int:
    """Fetch every range, threads in flight; the bytes received."""
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda j: len(bucket.get(j[0], j[1], j[2])), jobs))


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(f"usage: {__doc__}", file=sys.stderr)
        return 2
    endpoint, name, prefix = argv[:3]
    threads = int(argv[3]) if len(argv) == 4 else 8
    creds = Credentials(os.environ[ACCESS_ENV], os.environ[SECRET_ENV])
    bucket = Bucket(endpoint, name, creds)
    jobs = ranges(bucket, prefix)
    t0 = time.monotonic()
    got = read(bucket, jobs, threads)
    print(json.dumps({"bytes": got, "seconds": round(time.monotonic() - t0, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
