"""Two configurations in one process keep their own storage and engines: what an entry point
hands in is what its parts use, whatever the process's environment says.

Checked from outside the code under test: the bytes through boto and the disk, the forward
passes' shapes through a hook on the model."""

from __future__ import annotations

import pytest

from harvest.capture_spec import CaptureSpec
from harvest.engines.choice import load_engine
from harvest.engines.limits import EngineLimits
from harvest.registry import load_registry
from harvest.settings import get_settings
from harvest.storage import open_storage
from tests.s3_fixtures import BUCKET


@pytest.fixture
def two_configurations(on_s3, tmp_path):
    """One on local disk with small forward passes, one on S3 (an endpoint the environment
    does not name) with larger ones: both made from the session's own settings."""
    base = get_settings()
    return (
        base.model_copy(update={"storage_url": f"file://{tmp_path / 'disk'}", "engine_batch_tokens": 96}),
        base.model_copy(update={"storage_url": f"s3://{BUCKET}/service", "s3_endpoint_url": on_s3.endpoint,
                                "s3_part_bytes": 5 << 20, "staging_dir": tmp_path / "staging", "engine_batch_tokens": 512}),
    )


def test_each_configuration_writes_to_its_own_store(two_configurations, moto_s3, tmp_path):
    on_disk, on_s3 = two_configurations
    disk, s3 = open_storage(on_disk), open_storage(on_s3)
    disk.write_bytes("jobs/a/request.json", b"disk")
    s3.write_bytes("jobs/a/request.json", b"s3")
    assert (tmp_path / "disk" / "jobs" / "a" / "request.json").read_bytes() == b"disk"
    assert moto_s3.client.get_object(Bucket=BUCKET, Key="service/jobs/a/request.json")["Body"].read() == b"s3"
    # A shard staged for the S3 store is built in that configuration's staging folder.
    assert s3.staging_path("shard_00000.safetensors").startswith(str(tmp_path / "staging"))


def test_the_apps_of_two_configurations_keep_their_own_store(two_configurations, moto_s3):
    """`create_app(settings=…)` reaches the S3 endpoint its settings name, with no
    `HARVEST_S3_ENDPOINT_URL` in the environment."""
    from api.app import create_app
    from api.settings import ApiSettings

    on_disk, on_s3 = two_configurations
    apps = [create_app(settings=ApiSettings(**settings.model_dump())) for settings in (on_disk, on_s3)]
    apps[1].state.storage.write_bytes("probe", b"through the app")
    assert moto_s3.client.get_object(Bucket=BUCKET, Key="service/probe")["Body"].read() == b"through the app"
    assert apps[0].state.storage.is_local and not apps[0].state.storage.exists("probe")


def test_each_configurations_engine_keeps_its_own_bounds(two_configurations):
    on_disk, on_s3 = two_configurations
    tiny = load_registry(on_disk).get("llama-tiny")
    prompts = [[1] + [3 + (7 * p + t) % 400 for t in range(60)] for p in range(8)]
    tokens_per_pass = {}
    for settings in (on_disk, on_s3):
        engine = load_engine(tiny, "hf", EngineLimits.of(settings))
        shapes: list[int] = []
        hook = engine.hf_model.model.register_forward_pre_hook(
            lambda _m, _a, kwargs, shapes=shapes: shapes.append(kwargs["input_ids"].numel()), with_kwargs=True)
        try:
            engine.capture(prompts, CaptureSpec(layers=[0]))
        finally:
            hook.remove()
            engine.close()
        tokens_per_pass[settings.engine_batch_tokens] = shapes
    assert max(tokens_per_pass[96]) <= 96 and len(tokens_per_pass[96]) >= 5  # 488 tokens in passes of at most 96
    assert max(tokens_per_pass[512]) > 96 and len(tokens_per_pass[512]) < len(tokens_per_pass[96])
