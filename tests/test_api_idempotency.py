"""`api.idempotency` on the job store itself, SQLite and PostgreSQL (the `engine` fixture of
tests/test_api_store.py): concurrent submits with one Idempotency-Key admit one job, another
request with the key is a 409, a refused submit frees the key, and a key past its window
(`HARVEST_IDEMPOTENCY_WINDOW_S`) is new again and its record deleted. Counted in the jobs table."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from sqlalchemy import func, insert, select, update

from api.auth import create_key
from api.db import idempotency_keys, jobs, utcnow
from api.errors import ConcurrencyExceeded, IdempotencyConflict
from api.idempotency import prune_expired, submit_once
from harvest.request import HarvestRequest
from tests.test_api_store import _job, admit_on, engine, store  # noqa: F401 (fixtures)


def _count(engine, key_id: str) -> int:  # noqa: F811
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(jobs).where(jobs.c.key_id == key_id)).scalar_one()


def test_one_key_one_job_under_concurrent_submits_and_409_for_another_request(engine):  # noqa: F811
    key = create_key("idem", engine=engine)[1]
    request = HarvestRequest.model_validate({"model": "llama-tiny", "prompts": ["a", "b"]})
    idem = f"k-{uuid.uuid4()}"

    def submit() -> dict:
        return admit_on(key, _job(), 100, engine)

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
            submit_once(key.id, "same", request, lambda: admit_on(key, _job(), 100, engine), engine=engine)
    assert _count(engine, key.id) == 0


def _age(engine, key_id: str, seconds: float) -> None:  # noqa: F811
    """Make the key's records `seconds` old, in the store itself (no sleeping)."""
    with engine.begin() as conn:
        conn.execute(update(idempotency_keys).where(idempotency_keys.c.key_id == key_id)
                     .values(created_at=utcnow() - timedelta(seconds=seconds)))


def _records(engine, key_id: str) -> int:  # noqa: F811
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(idempotency_keys)
                            .where(idempotency_keys.c.key_id == key_id)).scalar_one()


def test_a_key_past_its_window_is_new_again_and_its_records_are_deleted(engine):  # noqa: F811
    """Before, the window was fixed at 24 hours, and the records of keys nobody sent again
    stayed forever."""
    key = create_key("idem-window", engine=engine, small=10)[1]
    request = HarvestRequest.model_validate({"model": "llama-tiny", "prompts": ["a"]})

    def submit() -> dict:
        return admit_on(key, _job(), 100, engine)

    first = submit_once(key.id, "nightly", request, submit, engine=engine, window_s=60)
    assert submit_once(key.id, "nightly", request, submit, engine=engine, window_s=60)["id"] == first["id"]
    submit_once(key.id, "other", request, submit, engine=engine, window_s=60)
    _age(engine, key.id, 120)
    again = submit_once(key.id, "nightly", request, submit, engine=engine, window_s=60)
    assert again["id"] != first["id"] and _count(engine, key.id) == 3
    assert _records(engine, key.id) == 1, "the key's expired records ('other' too) are deleted"
    _age(engine, key.id, 120)  # and another request with the key is no conflict once it expired
    other = HarvestRequest.model_validate({"model": "llama-tiny", "prompts": ["b"]})
    assert submit_once(key.id, "nightly", other, submit, engine=engine, window_s=60)["id"] not in (first["id"], again["id"])


def test_prune_deletes_every_expired_record_and_keeps_the_rest(engine):  # noqa: F811
    quiet = create_key("idem-quiet", engine=engine)[1]
    busy = create_key("idem-busy", engine=engine)[1]
    with engine.begin() as conn:
        for key_id, age in ((quiet.id, 3 * 3600), (quiet.id, 2 * 3600), (busy.id, 60)):
            conn.execute(insert(idempotency_keys).values(
                key_id=key_id, idempotency_key=f"k-{uuid.uuid4()}", request_sha256="0" * 64, job_id=None,
                created_at=utcnow() - timedelta(seconds=age),
            ))
    assert prune_expired(3600, engine=engine) == 2
    assert _records(engine, quiet.id) == 0 and _records(engine, busy.id) == 1
