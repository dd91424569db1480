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


@pytest.mark.parametrize("route, body", [
    ("/completions", '{"model": "llama-tiny", "prompt": "\\ud800 hello", "max_tokens": 1}'),
    ("/completions", '{"model": "llama-tiny", "prompt": ["ok \\udfff"], "max_tokens": 1}'),
    ("/chat/completions", '{"model": "llama-tiny", "messages": [{"role": "user", "content": "hi \\udc00"}], "max_tokens": 1}'),
], ids=["completion", "completion-list", "chat"])
def test_a_lone_surrogate_is_a_400_naming_its_field(client, route, body):
    """JSON's escapes can spell half a UTF-16 pair, which is no text: it was a 500 on the inline
    routes (the tokenizer's TypeError), while the same prompt on /harvest got a 400."""
    response = client.post(route, content=body, headers={"Content-Type": "application/json"})
    field = "messages" if route == "/chat/completions" else "prompt"
    message = _refused(response, "invalid_request", field)
    assert "surrogate" in message
    # A whole pair is one character, and fine.
    paired = body.replace("\\ud800", "\\ud83d\\ude00").replace("\\udfff", "\\ud83d\\ude00").replace("\\udc00", "\\ud83d\\ude00")
    assert client.post(route, content=paired, headers={"Content-Type": "application/json"}).status_code == 200


def test_a_long_path_and_a_long_number_come_back_cut(client):
    """A 60,000-character path got a 60,165-byte 404, and a max_tokens of 4,000 digits an
    8,290-byte 400: both echoes are cut to `echo`'s bound."""
    # A path as long as a request line may be (HARVEST_HTTP_LINE_BYTES, 8 KiB) reaches the app:
    response = client.get("/" + "p" * 8_000)
    assert response.status_code == 404 and len(response.content) < 1024, len(response.content)
    assert "(8,004 characters)" in response.json()["error"]["message"]  # "/v1/" and the 8,000
    # a longer one is refused by the server before it (`api.http_server`), as briefly.
    response = client.get("/" + "p" * 60_000)
    assert response.status_code == 414 and len(response.content) < 1024, len(response.content)
    assert response.json()["error"]["code"] == "request_line_too_long"
    body = '{"model": "llama-tiny", "prompt": "Hi", "max_tokens": ' + "9" * 4000 + "}"
    response = client.post("/completions", content=body, headers={"Content-Type": "application/json"})
    _refused(response, "context_length_exceeded", "max_tokens")


def test_a_trailing_slash_is_no_route_not_a_redirect(client):
    """A job id ending in `%2F` reached the API as a trailing slash and got a 307 to the path
    without it (Starlette's default), a status the OpenAPI does not document (bench/fuzz_unicode)."""
    for path in ("/harvest/", "/harvest/some-job/", "/models/"):
        response = client.get(path, follow_redirects=False)
        assert response.status_code == 404, (path, response.status_code, response.headers.get("location"))
        assert response.json()["error"]["code"] == "route_not_found"
