"""What the service leaves open on a host and in its recipe (issue #36, item 6): job files,
logs and the SQLite job store owner-only; secrets still holding the example's placeholder
refused at start-up; `infra/compose.env` kept out of git; schedule names that cannot leave the
storage root. (`/health` without a key: tests/test_keyless_limits.py; expired Idempotency-Keys:
tests/test_api_idempotency.py.)

Modes are read from real files after real writes, under the usual umask 022 (with which an
ordinary `open` makes 0644 files and 0755 folders).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_deploy_recipe import _by_role, _env

REPO = Path(__file__).resolve().parent.parent


def _mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def usual_umask():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


# --- owner-only files -------------------------------------------------------------------------

def test_local_job_files_are_0600_in_0700_folders(tmp_path, usual_umask):
    from harvest.jobfiles import JobFiles
    from harvest.storage import Storage

    storage = Storage(f"file://{tmp_path / 'storage'}")
    files = JobFiles.for_job("job-1", storage)
    files.storage.write_bytes("request.json", b'{"prompts": ["secret prompt"]}')
    files.storage.staging_path("shards/shard-00000.safetensors")  # its folder (the shard's writer makes it 0600)
    files.storage.write_bytes("manifest.json", b"{}")
    root = tmp_path / "storage"
    written = [p for p in root.rglob("*") if p.is_file()]
    assert {p.name for p in written} == {"request.json", "manifest.json"}, written
    for path in written:
        assert _mode(path) == 0o600, f"{path}: {_mode(path):o}"
    folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
    assert len(folders) >= 3
    for folder in folders:
        assert _mode(folder) == 0o700, f"{folder}: {_mode(folder):o}"


def test_role_logs_are_0600_in_a_0700_folder_and_an_old_wide_log_is_narrowed(tmp_path, usual_umask):
    from fleet.processes import Managed

    logs = tmp_path / "home" / "logs"
    child = Managed("probe", [sys.executable, "-c", "print('hello from the child')"], dict(os.environ), logs / "probe.log")
    child.proc.wait(30)
    assert _mode(logs) == 0o700 and _mode(logs.parent) == 0o700
    assert _mode(logs / "probe.log") == 0o600
    old = logs / "old.log"
    old.write_text("written by an earlier version\n")
    os.chmod(old, 0o644)
    again = Managed("probe", [sys.executable, "-c", "print('again')"], dict(os.environ), old)
    again.proc.wait(30)
    assert _mode(old) == 0o600
    for managed in (child, again):
        managed._log.close()
        Managed.started.remove(managed)


def test_the_sqlite_job_store_is_0600(tmp_path, usual_umask):
    from api.auth import create_key
    from api.db import make_engine, upgrade

    path = tmp_path / "home" / "harvest.db"
    engine = make_engine(f"sqlite:///{path}")
    try:
        upgrade(engine)
        create_key("mode", engine=engine)
    finally:
        engine.dispose()
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert not [p for p in path.parent.iterdir() if p != path and _mode(p) & 0o077], list(path.parent.iterdir())


# --- placeholder secrets ------------------------------------------------------------------------

def test_every_placeholder_the_recipe_hands_a_role_is_refused():
    """compose.env.example's `change-me-…` values reach the roles as these variables (with the
    example's values, as a careless bring-up would): the start-up check names every one."""
    from fleet.placeholders import PLACEHOLDER, placeholder_secrets

    checked = 0
    for role in ("server", "api", "worker"):
        for name, service in _by_role(role).items():
            env = {k: str(v) for k, v in _env(service).items()}
            holding = {k for k, v in env.items() if PLACEHOLDER in v}
            assert holding, f"{name}: no placeholder reaches it (the example changed?)"
            assert holding <= set(placeholder_secrets(env)), f"{name}: {holding - set(placeholder_secrets(env))} not checked"
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("role", ["api", "server", "worker"])
def test_a_role_with_a_placeholder_secret_exits_at_once_naming_it(tmp_path, role):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_AUTH", "PREFECT_SERVER_API_AUTH"))}
    env.update({
        "HARVEST_HOME": str(tmp_path / "home"),
        "PREFECT_API_URL": "http://127.0.0.1:9/api",  # nothing listens: the role must stop before
        "PREFECT_API_AUTH_STRING": "harvest:change-me-prefect",
        "AWS_SECRET_ACCESS_KEY": "change-me-harvest-s3",
        "PYTHONPATH": str(REPO),
    })
    argv = {"api": ["api", "--port", "9"], "server": ["server", "--port", "9"], "worker": ["worker", "--lane", "small"]}[role]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fleet.cli", *argv], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout
    assert "PREFECT_API_AUTH_STRING, AWS_SECRET_ACCESS_KEY still hold the example's placeholder" in done.stderr, done.stderr
    assert "infra/compose.env" in done.stderr
    assert not (tmp_path / "home" / "logs").exists(), "the role started something before refusing"
    assert time.monotonic() - started < 60


def test_real_secrets_pass():
    from fleet.placeholders import placeholder_secrets

    assert placeholder_secrets({"PREFECT_API_AUTH_STRING": "harvest:3f9a0c", "AWS_SECRET_ACCESS_KEY": "k9",
                                "HARVEST_DATABASE_URL": "postgresql+psycopg://harvest:x7@postgres:5432/jobs"}) == []


def test_compose_env_is_kept_out_of_git():
    ignored = subprocess.run(["git", "check-ignore", "-q", "infra/compose.env"], cwd=REPO)
    assert ignored.returncode == 0, "infra/compose.env (the recipe's secrets) is not git-ignored"
    assert subprocess.run(["git", "check-ignore", "-q", "infra/compose.env.example"], cwd=REPO).returncode == 1


# --- schedule names -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".hidden", "", "-flag", "x" * 65, "name with space"])
def test_a_schedule_name_that_could_leave_the_storage_root_is_refused(name, capsys):
    from flows.corpus_refresh import refresh_prefix
    from flows.schedule import main as schedule
    from harvest.errors import InvalidRequest

    argv = ["schedule", "create", "--corpus", "/nonexistent/c.jsonl", "--model", "llama-tiny", "--cron", "0 3 * * *", f"--name={name}"]
    with pytest.raises(SystemExit) as exit_:
        schedule(argv)
    assert exit_.value.code == 2
    assert "cannot name a corpus refresh" in capsys.readouterr().err
    with pytest.raises(InvalidRequest, match="cannot name a corpus refresh"):
        refresh_prefix(name)  # the flow refuses it too (a deployment made before this check)


def test_safe_schedule_names_pass():
    from flows.corpus_refresh import refresh_prefix
    from flows.schedule import _name_from

    assert refresh_prefix("nightly_en-2").startswith("corpus/nightly_en-2/")
    assert _name_from("s3://bucket/" + "Long.Name " * 20 + ".parquet") == "long"
    assert len(_name_from("file:///data/" + "a" * 100 + ".jsonl")) == 64
