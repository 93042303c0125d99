"""The API key of the OpenAI face: where it comes from, the Bearer check, and which routes it guards."""
from __future__ import annotations

import pytest
from test_openai_server import FakeBackend, client_for, steps

from specdec_openai import auth
from specdec_openai.app import ServerConfig
from specdec_openai.auth import api_key_from, authorized

KEY = "sk-test-Zq8vN2"
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
V1 = [("get", "/v1/models", None), ("post", "/v1/completions", {"model": "ensemble", "prompt": "a"}),
      ("post", "/v1/chat/completions", {"model": "ensemble", "messages": [{"role": "user", "content": "a"}]}),
      ("get", "/v1/no-such-route", None)]  # fmt: skip


@pytest.mark.parametrize("flag, environ, expected", [
    (None, {}, (None, "none")),
    (None, {"VLLM_API_KEY": "v"}, ("v", "VLLM_API_KEY")),
    (None, {"VLLM_API_KEY": "v", "SPECDEC_OPENAI_API_KEY": "s"}, ("s", "SPECDEC_OPENAI_API_KEY")),
    (None, {"SPECDEC_OPENAI_API_KEY": "", "VLLM_API_KEY": "v"}, ("v", "VLLM_API_KEY")),  # empty: unset
    ("f", {"SPECDEC_OPENAI_API_KEY": "s"}, ("f", "--api-key")),
])  # fmt: skip
def test_the_key_comes_from_the_flag_then_ours_then_vllms_variable(flag, environ, expected):
    assert api_key_from(flag, environ) == expected


def test_an_empty_api_key_flag_is_refused_not_taken_for_no_key():
    with pytest.raises(ValueError, match="--api-key is empty"):
        api_key_from("  ", {"SPECDEC_OPENAI_API_KEY": "s"})


@pytest.mark.parametrize("header, ok", [
    (f"Bearer {KEY}", True), (f"bearer {KEY}", True), (f"Bearer  {KEY} ", True),
    (None, False), ("", False), (KEY, False), (f"Basic {KEY}", False), (f"Bearer {KEY[:-1]}", False),
    (f"Bearer {KEY}x", False), (f"Bearer {KEY.upper()}", False), ("Bearer ", False), ("Bearer ünï", False),
])  # fmt: skip
def test_bearer_check(header, ok):
    assert authorized(header, KEY) is ok


def test_keys_are_compared_in_constant_time(monkeypatch):
    compared = []
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or a == b)
    assert authorized(f"Bearer {KEY}", KEY) and not authorized("Bearer other", KEY)
    assert compared == [(KEY.encode(), KEY.encode()), (b"other", KEY.encode())]


def keyed_client(backend: FakeBackend):
    return client_for(backend, api_key=KEY, tokenizer_dir="models/tiny-target", chat_template=TEMPLATE)


@pytest.mark.parametrize("method, path, body", V1)
@pytest.mark.parametrize("header", [None, "Bearer wrong-key", KEY, f"Basic {KEY}"])
def test_every_v1_route_refuses_a_missing_or_wrong_key_with_openais_401(method, path, body, header):
    backend = FakeBackend(steps("x"))
    headers = {} if header is None else {"Authorization": header}
    response = keyed_client(backend).request(method, path, json=body, headers=headers)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert error["message"] == (auth.MISSING if header is None else auth.WRONG)
    assert KEY not in response.text and backend.requests == []  # refused before any route ran


@pytest.mark.parametrize("method, path, body", V1)
def test_every_v1_route_serves_the_right_key(method, path, body):
    backend = FakeBackend(steps("x"))
    response = keyed_client(backend).request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == (404 if "no-such" in path else 200), response.text
    assert len(backend.requests) == (1 if "completions" in path else 0)


def test_health_and_metrics_stay_open_and_no_key_means_no_check():
    keyed = keyed_client(FakeBackend(steps("x")))
    assert keyed.get("/health").status_code == 200 and keyed.get("/metrics").status_code == 200
    assert client_for(FakeBackend(steps("x"))).get("/v1/models").status_code == 200


def test_the_key_is_not_in_the_configs_repr():
    assert KEY not in repr(ServerConfig(api_key=KEY)) and KEY not in repr(auth.ApiKeyMiddleware(None, KEY))
