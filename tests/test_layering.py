"""The layers import only downwards, read from the source (AST; nothing imported, no server).

    fleet → api, flows;   api → flows.submit (start, cancel, read runs), flows.run_status, harvest;
    flows → tasks → harvest;   harvest → nothing of the service

An edge counts whether it is an `import` or a string that names a module for the machinery to
load later: an `importlib` argument, a `module:attr` string (uvicorn's app, a settings default),
a `python -m module` command (a string, or the word after `"-m"` in an argv list), a dotted
module path (a deployment entrypoint). Docstrings are prose and do not count.

And every module of the service that the code, the tests and the benchmarks import or run
exists: a module moved between packages leaves no import or `-m` of its old path behind.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LAYERS = ("harvest", "tasks", "flows", "api", "fleet")

# What each package must not name, as package prefixes; `ALLOWED` makes exceptions.
FORBIDDEN = {
    "harvest": ("api", "flows", "fleet", "tasks", "testbed", "tests"),
    "tasks": ("api", "flows", "fleet", "testbed", "tests"),
    "flows": ("api", "fleet", "testbed", "tests"),
    "api": ("fleet", "flows", "tasks", "testbed", "tests"),
    "fleet": ("testbed", "tests"),
    # The benches share the test bed with the tests (`testbed`), never the tests themselves.
    "bench": ("tests",),
    "testbed": ("tests",),
}
# The facade's doors into the orchestration layer: starting, cancelling and reading runs, and
# the one mapping of a run to a job's status (a light module: naming a status imports no Prefect).
ALLOWED = {"api": ("flows.submit", "flows.run_status")}

_MODULE = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_WHOLE = re.compile(rf"^\s*({_MODULE})(:[\w.]+)?\s*$")  # `a.b` or `a.b:attr` (or `a:attr`)
_DASH_M = re.compile(rf"(?:^|\s)-m\s+({_MODULE})")  # a command line with `-m module`


def _prose(tree: ast.AST) -> set[int]:
    """The string statements: docstrings of modules, classes and functions, and the string
    under an assignment that documents it."""
    return {
        id(stmt.value)
        for node in ast.walk(tree)
        for stmt in (getattr(node, "body", None) if isinstance(getattr(node, "body", None), list) else [])
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
    }


def _string_names(text: str, dotted: bool = True) -> list[str]:
    whole = _WHOLE.match(text)
    # One bare word ("api", "small") is a name of something else; a module path has a dot.
    # A dotted string without `:attr` may also be a file or logger name: `dotted` counts it.
    if whole and (whole.group(2) or (dotted and "." in whole.group(1))):
        return [whole.group(1)]
    return [m.group(1) for m in _DASH_M.finditer(text)]


def names(source: str, dotted: bool = True) -> list[tuple[int, str]]:
    """(line, module) for every module the source imports or names in a string (`dotted`:
    counting a plain `a.b` string as a module path too)."""
    tree = ast.parse(source)
    prose = _prose(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from flows import submit` is flows.submit: the names may be modules.
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            found += [(node.lineno, name) for name in _string_names(node.value, dotted)]
        elif isinstance(node, (ast.List, ast.Tuple)):  # [python, "-m", "module", ...]
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            found += [(node.lineno, m) for flag, m in zip(items, items[1:]) if flag == "-m" and isinstance(m, str)]
        elif isinstance(node, ast.JoinedStr) and node.values:  # f"tasks.{name}": its literal head
            head = node.values[0]
            if dotted and isinstance(head, ast.Constant) and isinstance(head.value, str) and re.fullmatch(rf"{_MODULE}\.", head.value):
                found.append((node.lineno, head.value.rstrip(".")))
    return found


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(root: Path, package: str) -> list[str]:
    """`path:line: module` for each name in `root/package` that its layer must not use."""
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        for line, module in names(path.read_text()):
            if any(_under(module, p) for p in FORBIDDEN[package]) and not any(_under(module, a) for a in ALLOWED.get(package, ())):
                bad.append(f"{path.relative_to(root)}:{line}: {module}")
    return bad


def _exists(root: Path, module: str) -> bool:
    """`module` is a module or package of the service under `root`, or a name in a module
    (`fleet.processes.free_port`, an entrypoint `flows.harvest.harvest`); a name in a package
    counts only if its `__init__` defines or imports it."""
    base = root.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
        return True
    parent, name = base.parent, base.name
    if parent.with_suffix(".py").is_file():
        return True
    init = parent / "__init__.py"
    return init.is_file() and re.search(rf"\b{re.escape(name)}\b", init.read_text()) is not None


def stale(root: Path) -> list[str]:
    """`path:line: module` for each module of the service imported, run with `-m` or named as
    `module:attr` anywhere in its Python (tests and benchmarks included) that does not exist:
    a reference a move left behind. (A plain `a.b` string may be a file or logger name.)"""
    bad = []
    for path in sorted(p for top in (*LAYERS, "tests", "bench", "testbed") for p in (root / top).rglob("*.py")):
        for line, module in names(path.read_text(), dotted=False):
            top = module.split(".")[0]
            if top in (*LAYERS, "tests", "testbed") and "." in module and not _exists(root, module):
                bad.append(f"{path.relative_to(root)}:{line}: {module}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_layer_names_one_above_it(package):
    assert violations(REPO, package) == []


def test_every_module_named_exists():
    """Tests, benchmarks and the service name modules that are there (a module moved between
    packages leaves no `python -m` or import of its old path behind)."""
    assert stale(REPO) == []


def test_the_scan_sees_every_kind_of_edge():
    """Each way of naming a module that the rule covers is seen; prose is not."""
    source = '''
"""Module docstring naming flows.stack and `python -m fleet.cli` (prose)."""
import api.app
from flows.submit import start_harvest_run
from flows import deploy
X = "api.runs:PrefectRuns"
"""An attribute docstring naming api.admin (prose)."""
COMMAND = "python -m fleet.run_starter --socket s"
ARGV = [PY, "-m", "flows.retention", "--flag"]
module = importlib.import_module("fleet.roles")
dynamic = importlib.import_module(f"tasks.{name}")
MESSAGE = "set PREFECT_API_URL to the control plane's (what `harvest server` printed)"
ROLE = "api"
'''
    assert {n for _, n in names(source)} == {
        "api.app", "flows.submit.start_harvest_run", "flows.deploy", "api.runs", "fleet.run_starter", "flows.retention",
        "fleet.roles", "tasks",
    }
    # Without plain dotted strings: imports, `-m` (in a string or an argv) and `module:attr` only.
    assert {n for _, n in names(source + 'LOG = "harvest.api.notify"\n', dotted=False)} == {
        "api.app", "flows.submit.start_harvest_run", "flows.deploy", "api.runs", "fleet.run_starter", "flows.retention",
    }


def test_every_layer_is_scanned():
    """A package added to the service gets a rule here, or this fails."""
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "client", "bench", "notebooks", "testbed"}
    assert packages == set(LAYERS), packages
    assert set(FORBIDDEN) == set(LAYERS) | {"bench", "testbed"}


CONVENTIONS = {"main", "upgrade", "downgrade"}
"""Names every entry point or migration defines, by convention."""


def test_each_class_and_function_has_one_home():
    """No two modules of the service define a class or a public function of one name: a concept
    (a job's `Timings`, once in the API's schemas and again in the pipeline) lives in one
    place, and every layer imports it from there."""
    homes: dict[str, list[str]] = {}
    for package in LAYERS:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                public_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")
                if isinstance(node, ast.ClassDef) or (public_function and node.name not in CONVENTIONS):
                    homes.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}


def test_a_shard_and_placement_each_have_one_home():
    """A shard's layout, file, record and writing are the package `harvest.shard` (before: five
    modules of harvest/ and tasks/), and the flow's tasks over it one thin module
    (`tasks.shards`). Placement decides in `harvest.placement` alone (before: how a job's
    shards split, and what a parent does about a helper, were decided in flows/), and flows/
    holds its Prefect side: modules that import Prefect."""
    harvest_modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "harvest").rglob("*.py"))
    shard_modules = [m for m in harvest_modules if "shard" in m]
    assert shard_modules and all(m.startswith("harvest/shard/") for m in shard_modules), shard_modules
    assert sorted(str(p.relative_to(REPO)) for p in (REPO / "tasks").rglob("*.py")) == ["tasks/__init__.py", "tasks/shards.py"]
    assert [m for m in harvest_modules if "placement" in m or "slot" in m] == ["harvest/placement.py"]
    for module in ("flows/placement.py", "flows/scale_out.py"):
        imported = [name for _, name in names((REPO / module).read_text())]
        assert any(name.startswith("prefect") for name in imported) and "harvest.placement" in {
            ".".join(n.split(".")[:2]) for n in imported}, module


def _module_of(root: Path, name: str) -> str | None:
    """The service module a name refers to (`harvest.registry.ModelInfo` → `harvest.registry`)."""
    parts = name.split(".")
    while parts:
        base = root.joinpath(*parts)
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return None


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the service modules it imports, at the top or inside a function (a lazy
    import is still a dependency; strings that name modules are not imports)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(p for top in LAYERS for p in (root / top).rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                found = _module_of(root, target) if target.split(".")[0] in LAYERS else None
                if found and found != module and not module.startswith(found + "."):  # a package's own __init__
                    edges.add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    """Before: harvest.engines.base imported hf and vllm (its children), and
    built_checkpoints named the builders that import it (gguf_checkpoint, tiny_model)."""
    graph = import_graph(REPO)
    assert {"harvest.registry", "harvest.engines.hf"} <= set(graph)  # the scan sees the tree
    assert "harvest.built_checkpoints" in graph["harvest.registry"]
    assert circles(graph) == []


def test_the_core_never_names_the_api_replica():
    """The core (`harvest/`) serves a worker host, a run and a notebook as much as the API: what
    only an API replica needs (its errors, inline engine processes, scheduling slice, settings)
    lives in `api/`, and the core's words name no replica (tensor-parallel "replicated" too:
    the word is the API's)."""
    named = [f"{path.relative_to(REPO)}:{number}" for path in sorted((REPO / "harvest").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if "replica" in line.lower()]
    assert named == []


def test_each_layer_owns_its_settings_section():
    """The core's settings hold no field of the API's or the fleet's, and each layer's section
    extends the one below it, so every variable keeps its one name (HARVEST_<FIELD>)."""
    from api.settings import ApiSettings
    from fleet.settings import FleetSettings
    from harvest.settings import Settings

    core, api, fleet = (set(section.model_fields) for section in (Settings, ApiSettings, FleetSettings))
    assert core < api < fleet
    assert {"database_url", "signing_secret", "admission_bytes", "rate_read_per_s"} <= api - core
    assert {"prefect_port", "restart_limit"} <= fleet - api


# The core and the orchestration layer read the process's settings only at their entry
# points, which build the configuration and hand it to what they make (`Storage`'s options,
# the engines' limits, the registry and the lanes): (module, top-level function).
ENTRY_POINTS = {
    ("harvest.cli", "_run"),  # `harvest run`
    ("harvest.parity", "main"),  # `harvest models check`
    ("harvest.warm.server", "main"),  # an engine server's process
    ("flows.harvest", "harvest"),  # the harvest flow, in its run's process
    ("flows.corpus_refresh", "corpus_refresh"),  # the scheduled corpus refresh flow
    ("flows.retention", "retention_sweep"), ("flows.retention", "main"),  # the sweep: flow and `harvest sweep`
    ("flows.schedule", "main"),  # `harvest schedule`
}


def test_nothing_caches_the_settings():
    """A cached configuration (before: `get_settings` kept the first read) is one that a test
    had to clear and a second configuration in the process could not differ from."""
    from harvest.settings import get_settings

    assert not hasattr(get_settings, "cache_clear")


def _settings_readers(root: Path, packages: tuple[str, ...]) -> set[tuple[str, str]]:
    """(module, top-level function or "<module>") of every `get_settings(...)` call."""
    readers = set()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            for top in ast.parse(path.read_text()).body:
                where = top.name if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else "<module>"
                if any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "get_settings"
                       for node in ast.walk(top)):
                    readers.add((module, where))
    return readers


def test_only_entry_points_of_the_core_and_the_flows_read_the_settings():
    """Before: `get_settings()` at 21 places of harvest/ and flows/, among them fallbacks
    (`settings or get_settings()`) in the storage, the engines, the lanes and the registry,
    so a configuration handed to `create_app` or a run did not reach them."""
    readers = _settings_readers(REPO, ("harvest", "flows", "tasks"))
    assert ("flows.harvest", "harvest") in readers  # the scan sees a flow's entry
    assert readers <= ENTRY_POINTS, sorted(readers - ENTRY_POINTS)


def test_the_settings_scan_sees_a_fallback_in_a_method(tmp_path):
    (tmp_path / "harvest").mkdir()
    (tmp_path / "harvest" / "store.py").write_text(
        "class Store:\n    def __init__(self, settings=None):\n        self.settings = settings or get_settings()\n")
    assert _settings_readers(tmp_path, ("harvest",)) == {("harvest.store", "Store")}


# Module state that the code changes after import: none, but what mirrors something that is the
# process's own in a library, so one owner per process is the truth, and one declaration table.
# (The metrics registry is prometheus_client's own, not a module global of ours.)
PROCESS_STATE = {
    ("harvest.placement", "_HELD"): "the slot this process claimed: CUDA reads its devices once per process",
    ("harvest.engines.vllm", "_IN_PROCESS"): "vLLM's parallel state is one per process (`VLLMEngine.close`)",
    ("harvest.engines.vllm", "_RETIRED"): "the same: engines kept until the process's last one closes",
    ("harvest.engines.hf_generate", "_DECODES"): "torch's intra-op thread count is the process's",
    ("api.openapi", "_components"): "the routes' schemas, declared with the routes at import and read after",
}
MUTATORS = {"append", "extend", "insert", "add", "update", "pop", "popitem", "clear", "discard", "remove", "setdefault"}


def mutable_module_state(source: str) -> dict[str, str]:
    """Module-level names the module's functions change: rebound (`global`), mutated in place
    (a mutating method, an item or attribute set), or an instance of a class of the module."""
    tree = ast.parse(source)
    top = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        top.update({t.id: node.value for t in targets if isinstance(t, ast.Name)})
    own_classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    found = {name: "an instance of a class of its module" for name, value in top.items()
             if isinstance(value, ast.Call) and getattr(value.func, "id", None) in own_classes}
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        params = {a.arg for a in function.args.args + function.args.kwonlyargs}
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                found.update({name: "rebound with `global`" for name in node.names})
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                  and node.func.attr in MUTATORS):
                name = node.func.value.id
                if name in top and name not in params:
                    found[name] = f"`.{node.func.attr}()`"
            elif (isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del))
                  and isinstance(node.value, ast.Name)):
                if node.value.id in top and node.value.id not in params:
                    found[node.value.id] = "an item or attribute set"
    return found


def test_no_module_keeps_state_of_its_own_but_the_processs():
    """Before: the SQLite store's listeners were the process's (`api.db.local_listeners`, so
    two stores heard each other) and so were the key queues an API replica had checked
    (`flows.key_queues._ensured`); both have owners now (the store's engine, the run store)."""
    found = {}
    for package in LAYERS:
        for path in sorted((REPO / package).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found.update({(module, name): why for name, why in mutable_module_state(path.read_text()).items()})
    assert {where: why for where, why in found.items() if where not in PROCESS_STATE} == {}
    assert set(PROCESS_STATE) <= set(found)  # each one listed is still there (else: drop it here)


def test_the_state_scan_sees_each_kind_of_change():
    source = (
        "class Pool:\n    pass\n"
        "POOL = Pool()\nSEEN = []\nBY_ID = {}\nHELD = None\nCONSTANT = {'a': 1}\n"
        "def f(SEEN_AS_PARAM):\n    global HELD\n    HELD = 1\n    SEEN.append(1)\n    BY_ID['k'] = 2\n"
        "    SEEN_AS_PARAM.append(3)\n    return CONSTANT['a']\n"
    )
    assert set(mutable_module_state(source)) == {"POOL", "SEEN", "BY_ID", "HELD"}


# Where the service writes its own process's environment: only variables a library reads from
# the environment alone, and a forked run taking the environment it was handed. Children are
# handed theirs (`env=`), never left to inherit a changed `os.environ`.
ENVIRONMENT_WRITERS = {
    "harvest.engines.vllm": "VLLM_*: vLLM reads its switches from the environment only",
    "harvest.placement": "CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER: CUDA reads them from the environment only",
    "api.app": "TOKENIZERS_PARALLELISM: the Rust tokenizers read it from the environment only",
    "flows.prefect_auth": "PREFECT_API_AUTH_STRING: Prefect's client reads it from its settings, made from the environment",
    "fleet.roles": "PREFECT_API_URL of a role's own process (its forwarder), for Prefect's client",
    "fleet.stack": "PREFECT_API_URL of `harvest up`'s own process, for Prefect's client",
    "fleet.run_fork": "a forked run takes the environment its worker handed it",
}


def environment_writes(source: str) -> list[int]:
    """Lines that change `os.environ` (an item set or deleted, a mutating method) or call `os.putenv`."""
    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ" and getattr(node.value, "id", None) == "os"

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)) and is_environ(node.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if (is_environ(node.func.value) and node.func.attr in MUTATORS) or (
                    node.func.attr == "putenv" and getattr(node.func.value, "id", None) == "os"):
                lines.append(node.lineno)
    return lines


def test_the_service_writes_its_environment_only_where_a_library_reads_nothing_else():
    writers = {}
    for package in LAYERS:
        for path in sorted((REPO / package).rglob("*.py")):
            if lines := environment_writes(path.read_text()):
                writers[".".join(path.relative_to(REPO).with_suffix("").parts)] = lines
    assert environment_writes("import os\nos.environ['A'] = '1'\nos.environ.setdefault('B', '2')\n") == [2, 3]
    assert {module: lines for module, lines in writers.items() if module not in ENVIRONMENT_WRITERS} == {}
    assert set(ENVIRONMENT_WRITERS) <= set(writers)  # each one listed still writes (else: drop it here)


def callables_into_the_core(source: str) -> list[str]:
    """`line: call` for each call of something imported from `harvest` that is handed a lambda
    or a function of the calling module: the core calling back into its caller's layer."""
    tree = ast.parse(source)
    from_core = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                 and (node.module or "").split(".")[0] == "harvest" for alias in node.names}
    own = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            handed = [*node.args, *(k.value for k in node.keywords)]
            if callee in from_core and any(isinstance(a, ast.Lambda) or getattr(a, "id", None) in own for a in handed):
                found.append(f"{node.lineno}: {callee}")
    return found


def test_the_tasks_hand_the_core_no_callables():
    """Before: `run_shards(forward=…, submit_write=…)` ran the tasks' forward and write from
    inside the core's loop. Now the tasks drive the loop and the core keeps its state
    (`harvest.shard.writing.ShardPass`)."""
    found = {str(path.relative_to(REPO)): lines for path in sorted((REPO / "tasks").rglob("*.py"))
             if (lines := callables_into_the_core(path.read_text()))}
    assert found == {}
    assert callables_into_the_core(
        "from harvest.pipeline import run_shards\ndef f(k): pass\nrun_shards(1, forward=f)\nrun_shards(2, g=lambda: 0)\n"
    ) == ["3: run_shards", "4: run_shards"]


# The API's settings reach its routes from the app (`create_app(settings=…)`, read as
# `api.deps.AppSettings` or `app.state.settings`). Only the factory's default, the job store's
# default URL, the `harvest keys` command and the replica process's entry (`python -m
# api.http_server`: its HTTP server's bounds) read the process's own.
SETTINGS_READERS = {"api.app", "api.db", "api.admin", "api.migrations.env", "api.http_server"}


def test_the_api_reads_settings_only_from_the_app_it_was_made_with():
    """Before: routes and their helpers called `get_settings()` at seven places (the submit,
    the inline admission, links, rates, the watcher), so two apps in one process could not differ."""
    import ast

    readers = set()
    for path in sorted((REPO / "api").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "get_settings"
               for node in ast.walk(tree)):
            readers.add(module)
    assert "api.app" in readers  # the scan sees the factory's default
    assert readers <= SETTINGS_READERS, sorted(readers - SETTINGS_READERS)


def test_two_apps_in_one_process_keep_their_own_settings(tmp_path):
    """Each app signs and points its links by the settings it was made with, not the process's."""
    from api.app import create_app
    from api.settings import ApiSettings

    made = []
    for url in ("https://one.example", "https://two.example"):
        settings = ApiSettings(home=tmp_path / url[8:11], public_base_url=url)
        made.append(create_app(settings=settings))
    for app, url in zip(made, ("https://one.example", "https://two.example")):
        assert app.state.settings.public_base_url == url
        assert app.state.link_signer.sign(url, "j", "shard_00000.safetensors", 1).startswith(f"{url}/v1/files/j/")
    assert made[0].state.link_signer.mac("j", "n", 1) != made[1].state.link_signer.mac("j", "n", 1)  # each home's secret


# The job store reaches the API the same way: `create_app(store=…)` (an `api.db.JobStore`, built
# from the app's settings when not given), read as `api.deps.Store` or `app.state.store`; the
# roles and the `harvest keys` command make their own. No module keeps one.
_STORE_TYPES = {"Engine", "JobStore"}


def _makes_store(node: ast.AST) -> bool:
    """Whether `node` makes an engine or a store: `make_engine(…)`, `create_engine(…)`,
    `JobStore(…)`, `JobStore.from_settings(…)` / `.from_url(…)`."""
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        func = call.func
        if getattr(func, "id", getattr(func, "attr", None)) in {"make_engine", "create_engine", "JobStore"}:
            return True
        if isinstance(func, ast.Attribute) and func.attr in {"from_settings", "from_url"} and "JobStore" in _named(func.value):
            return True
    return False


def _named(node: ast.AST | None) -> set[str]:
    return set() if node is None else {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(node)}


def store_globals(source: str) -> list[tuple[int, str]]:
    """(line, what) for each job store a module keeps for its whole process: a module-level name
    annotated `Engine` or `JobStore`, or assigned an engine or a store made there; a function
    that makes one into a `global`; a `get_…engine` function that hands it out."""
    tree = ast.parse(source)
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            if _named(getattr(node, "annotation", None)) & _STORE_TYPES or _makes_store(node):
                found.append((node.lineno, ast.unparse(node).split("=")[0].strip()))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if re.fullmatch(r"get_\w*engine", node.name):
                found.append((node.lineno, f"{node.name}()"))
            elif any(isinstance(n, ast.Global) for n in ast.walk(node)) and _makes_store(node):
                found.append((node.lineno, f"{node.name}() makes a global engine"))
    return found


def test_no_api_module_keeps_a_job_store_of_its_own():
    """Before: `api.db` kept the process's engine and the rates engine in two module globals,
    handed out by a getter each, every store function fell back to them, and tests reached the
    store by patching the global."""
    kept = [f"{path.relative_to(REPO)}:{line}: {what}"
            for path in sorted((REPO / "api").rglob("*.py")) for line, what in store_globals(path.read_text())]
    assert kept == []


def test_the_store_scan_sees_a_module_global_engine():
    """What the scan above must catch: the old `api.db` (each of its three shapes), and what it
    must not: an engine held by an object, a function's own engine, a dependency's alias,
    another part made from settings."""
    old = '''
_engine: Engine | None = None
_fast = None
ENGINE = make_engine("sqlite://")
STORE = JobStore.from_settings(settings)

def get_process_engine() -> Engine:
    global _engine
    _engine = _engine or make_engine(database_url())
    return _engine

def rates():
    global _fast
    _fast = make_engine(url, pool_size=5)
'''
    assert [what for _, what in store_globals(old)] == [
        "_engine: Engine | None", "ENGINE", "STORE", "get_process_engine()", "rates() makes a global engine",
    ]
    fine = '''
Store = Annotated[JobStore, Depends(store)]
SHARE = FairShare.from_settings(settings)

class JobStore:
    def __init__(self, engine: Engine):
        self.engine = engine

def migrate(url: str) -> None:
    engine = make_engine(url)
    upgrade(engine)
'''
    assert store_globals(fine) == []


def test_two_apps_in_one_process_keep_their_own_job_stores(tmp_path):
    """Each app answers from the job store it was made with: a key made in one store opens that
    app's keyed routes (GET /v1/harvest: 200) and not the other's (401), in one process. An app
    given no store gets the one its own settings name (`<home>/harvest.db`)."""
    import asyncio

    import httpx

    from api.app import create_app
    from api.auth import authenticate, create_key
    from api.db import JobStore
    from api.errors import Unauthorized
    from api.settings import ApiSettings

    stores = [JobStore.from_url(f"sqlite:///{tmp_path / name / 'harvest.db'}").migrate() for name in ("one", "two")]
    try:
        apps = [create_app(settings=ApiSettings(home=tmp_path / name), store=store)
                for name, store in zip(("one", "two"), stores)]
        assert [app.state.store for app in apps] == stores
        key, record = create_key("only-in-one", engine=stores[0].db)
        assert authenticate(f"Bearer {key}", apps[0].state.store.db).id == record.id
        with pytest.raises(Unauthorized):
            authenticate(f"Bearer {key}", apps[1].state.store.db)

        async def list_harvests(app) -> httpx.Response:  # in process, without the lifespan (the stores are migrated)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                return await client.get("/v1/harvest", headers={"Authorization": f"Bearer {key}"})

        mine, theirs = (asyncio.run(list_harvests(app)) for app in apps)
        assert mine.status_code == 200 and mine.json()["data"] == [], mine.text
        assert theirs.status_code == 401 and theirs.json()["error"]["code"] == "invalid_api_key", theirs.text
    finally:
        for store in stores:
            store.dispose()

    default = create_app(settings=ApiSettings(home=tmp_path / "three"))
    try:
        assert default.state.store.db.url.database == str(tmp_path / "three" / "harvest.db")
    finally:
        default.state.store.dispose()
