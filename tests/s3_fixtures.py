"""moto's S3 server for the modules that store on S3, as production stores on a real one.
Loaded for every test by `tests/conftest.py`.

``moto_s3`` → ``testbed.topology.MotoS3``
    one server per module that asks (module-scoped), in its own process, with the bucket
    `BUCKET` made; ``.endpoint``, ``.client`` (boto's), stopped after the module.
``on_s3`` → the same server, with boto's own credential variables (`CREDENTIALS`) set for the
    test: what code that opens S3 through the environment, as a worker does, reads.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testbed.topology import CREDENTIALS, MotoS3

__all__ = ["BUCKET", "CREDENTIALS", "moto_s3", "on_s3"]

BUCKET = "harvest-test"


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[MotoS3]:
    # Never moto's in-process ThreadedMotoServer: it imports Flask into the test process, and
    # vLLM's start-up scan of every loaded module trips over Flask's context proxies, so a
    # vLLM engine started later in the same session would fail.
    with MotoS3("127.0.0.1", BUCKET) as s3:
        yield s3


@pytest.fixture
def on_s3(moto_s3: MotoS3, monkeypatch) -> MotoS3:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    return moto_s3
