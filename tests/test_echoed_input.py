"""A refusal repeats what the request sent only as a short printable excerpt
(`harvest.errors.echo`): a megabyte-long model name, field name, compression or shape comes
back in an error body under 1 KB that still names the field. Against the harvest tests' API
replica (real app under uvicorn), on the inline routes and the submit route."""

from __future__ import annotations

import json

import httpx
import pytest

from harvest.errors import ECHO_CHARS, echo

MB = 1 << 20


@pytest.fixture(scope="module")
def client(harvest_api):
    key = harvest_api.make_key(name="echo", small=5)
    with httpx.Client(base_url=harvest_api.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=300) as client:
        yield client


def _refused(response: httpx.Response, code: str, param: str) -> str:
    assert response.status_code == 400, response.text[:500]
    assert len(response.content) < 1024, f"a {len(response.content):,}-byte error body"
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == param, error
    return error["message"]


DIRECTIONS = {"data": "AAAA", "dtype": "float32", "shape": [1, 64]}


@pytest.mark.parametrize("name", ["m" * MB, "\x00" * MB, "\u200b" * MB], ids=["letters", "nul", "zero-width"])
def test_a_megabyte_model_name_comes_back_as_a_short_excerpt(client, name):
    for route, body in (("/completions", {"model": name, "prompt": "Hi"}),
                        ("/chat/completions", {"model": name, "messages": [{"role": "user", "content": "Hi"}]}),
                        ("/harvest", {"model": name, "prompts": ["Hi"]})):
        message = _refused(client.post(route, json=body), "model_not_found", "model")
        assert f"({MB:,} characters)" in message, message
        assert message.isprintable()


def test_a_megabyte_unknown_field_comes_back_as_a_short_excerpt_naming_it(client):
    field = "colour" + "u" * MB
    for route, body in (("/completions", {"model": "llama-tiny", "prompt": "Hi", field: 1}),
                        ("/harvest", {"model": "llama-tiny", "prompts": ["Hi"], field: 1})):
        response = client.post(route, json=body)
        _refused(response, "invalid_request", echo(field, quote=False))
        assert response.json()["error"]["param"].startswith("colouruuu")


@pytest.mark.parametrize("field, value", [("compression", "z" * MB), ("shape", [1] * (MB // 3))])
def test_a_megabyte_projection_value_comes_back_as_a_short_excerpt(client, field, value):
    body = json.dumps({"model": "llama-tiny", "prompts": ["Hi"], "project_onto": {**DIRECTIONS, field: value}})
    assert len(body) > MB // 2
    message = _refused(client.post("/harvest", content=body, headers={"Content-Type": "application/json"}),
                       "invalid_request", "project_onto")
    assert f"project_onto.{field}" in message, message


def test_echo_is_printable_bounded_and_says_how_long_the_value_was():
    assert echo("llama-tiny") == "'llama-tiny'"
    for value in ("x" * 10_000, "\x00\x01" * 5_000, "é" * 10_000, "\U0010ffff" * 10_000):
        shown = echo(value)
        assert shown.isprintable() and len(shown) < 2 * ECHO_CHARS + 32, shown
        assert shown.endswith(f"… ({len(value):,} characters)")
    assert echo([1] * 1_000_000) == "[1, 1, 1, 1, ...]"
