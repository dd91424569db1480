"""One error vocabulary: every error code is a documented class of `harvest.errors` (the
core's) or `api.errors` (the API replica's own), no code is used twice, no raise site invents one, and pydantic's errors become the same 400 message through the bulk
route, the inline route and the CLI (`invalid_from_pydantic`)."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import api.errors
import harvest.errors as errors

from testbed import http_calls

REPO = Path(__file__).resolve().parent.parent
VOCABULARY = (errors, api.errors)


def _classes(only=None) -> list[type]:
    """The error classes defined in `only`, or in both modules of the vocabulary."""
    return [c for module in ([only] if only else VOCABULARY) for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, errors.HarvestError) and c.__module__ == module.__name__]


@pytest.mark.parametrize("module", VOCABULARY, ids=lambda m: m.__name__)
def test_the_docstring_tree_names_every_class_with_its_status_and_code(module):
    tree = module.__doc__
    rows = {m.group(1): (int(m.group(2)), m.group(3)) for m in re.finditer(r"(\w+)\s+(\d{3}) (\w+)", tree)}
    classes = _classes(module)
    assert {c.__name__ for c in classes} == set(rows), set(rows) ^ {c.__name__ for c in classes}
    for cls in classes:
        assert rows[cls.__name__] == (cls.status, cls.code), cls
        assert cls.__doc__ and cls.__doc__ is not errors.HarvestError.__doc__ or cls is errors.HarvestError, cls
        assert cls.__name__ in module.__all__


def test_no_two_classes_share_a_code():
    codes = [c.code for c in _classes()]
    assert len(codes) == len(set(codes)), sorted(codes)  # one class per code, across both trees


def test_no_raise_site_invents_a_code():
    with pytest.raises(TypeError):
        errors.HarvestError("x", code="made_up")  # type: ignore[call-arg]
    names = {c.__name__ for c in _classes()}
    offenders = []
    for folder in ("api", "harvest", "flows", "tasks"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in names:
                    if any(k.arg == "code" for k in node.keywords):
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders


def test_pydantic_errors_read_the_same_through_both_routes_and_the_cli(harvest_api, tmp_path):
    key = harvest_api.make_key(name="vocabulary")
    auth = {"Authorization": f"Bearer {key}"}

    def post(path, body):
        response = http_calls.post(f"{harvest_api.base_url}{path}", headers=auth, json=body, timeout=60)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    # The same kind of mistake reads the same on both routes.
    for harvest_error, inline_error in (
        (post("/harvest", {"prompts": ["x"]}), post("/completions", {"prompt": "x"})),
        (post("/harvest", {"model": "llama-tiny", "prompts": ["x"], "colour": 1}),
         post("/completions", {"model": "llama-tiny", "prompt": "x", "colour": 1})),
    ):
        assert harvest_error == inline_error, (harvest_error, inline_error)
    assert post("/harvest", {"prompts": ["x"]})["message"] == "Missing required parameter: 'model'."

    # The CLI says what the API says for the same field.
    api = post("/harvest", {"model": "llama-tiny", "prompts": ["x"], "shard_size": 0})
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    out = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "run", "--model", "llama-tiny", "--prompts", str(prompts),
         "--out", str(tmp_path / "out"), "--shard-size", "0"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == f"harvest run: {api['message']}"
