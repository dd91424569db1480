"""`api.idempotency` on the job store itself, SQLite and PostgreSQL (the `engine` fixture of
tests/test_api_store.py): concurrent submits with one Idempotency-Key admit one job, another
request with the key is a 409, and a refused submit frees the key. Counted in the jobs table."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select

from api.auth import create_key
from api.db import jobs
from api.idempotency import submit_once
from api.store import admit
from harvest.errors import ConcurrencyExceeded, IdempotencyConflict
from harvest.request import HarvestRequest
from tests.test_api_store import _job, engine  # noqa: F401 (a fixture)


def _count(engine, key_id: str) -> int:  # noqa: F811
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(jobs).where(jobs.c.key_id == key_id)).scalar_one()


def test_one_key_one_job_under_concurrent_submits_and_409_for_another_request(engine):  # noqa: F811
    key = create_key("idem", engine=engine)[1]
    request = HarvestRequest.model_validate({"model": "llama-tiny", "prompts": ["a", "b"]})
    idem = f"k-{uuid.uuid4()}"

    def submit() -> dict:
        return admit(key, _job(), capacity=100, engine=engine)

    with ThreadPoolExecutor(4) as pool:
        rows = list(pool.map(lambda _: submit_once(key.id, idem, request, submit, engine=engine), range(4)))
    assert len({row["id"] for row in rows}) == 1 and _count(engine, key.id) == 1
    with pytest.raises(IdempotencyConflict):
        submit_once(key.id, idem, HarvestRequest.model_validate({"model": "llama-tiny", "prompts": ["c"]}), submit, engine=engine)
    assert _count(engine, key.id) == 1


def test_a_refused_submit_frees_its_key(engine):  # noqa: F811
    key = create_key("idem-refused", engine=engine, small=0)[1]  # every small-lane submit refused
    request = HarvestRequest.model_validate({"model": "llama-tiny", "prompts": ["a"]})
    for _ in range(2):  # the second is refused by the cap again, not by a claim left behind
        with pytest.raises(ConcurrencyExceeded):
            submit_once(key.id, "same", request, lambda: admit(key, _job(), capacity=100, engine=engine), engine=engine)
    assert _count(engine, key.id) == 0
