"""Cache keys of the Python side (controlplane/cache/key.py): what changes an exact key
or a namespace and what does not. That the Lua edge computes the same keys is checked in
tests/parity/test_cache_keys.py."""

from __future__ import annotations

import pytest

from controlplane.cache.key import keys_for

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def k(body: dict, path: str = CHAT, tenant: str = "default"):
    return keys_for(path, body, tenant)


BASE = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is Redis?"}]}


@pytest.mark.parametrize("change", [
    {"model": "other"},
    {"temperature": 0.5},
    {"max_tokens": 10},
    {"seed": 1},
    {"stop": ["x"]},
    {"response_format": {"type": "json_object"}},
    {"some_new_param": True},
    {"messages": [{"role": "system", "content": "Be verbose."}, BASE["messages"][1]]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                  *BASE["messages"]]},
])
def test_answer_changing_fields_change_the_exact_key(change) -> None:
    assert k({**BASE, **change}).exact != k(BASE).exact


def test_tenant_and_path_change_the_key() -> None:
    assert k(BASE, tenant="t2").exact != k(BASE).exact
    assert k(BASE, tenant="t2").namespace != k(BASE).namespace
    assert k({"model": "m", "prompt": "p"}, COMP).exact != k({"model": "m", "prompt": "p"}, CHAT).exact


def test_stream_and_user_do_not_change_the_key() -> None:
    streamed = {**BASE, "stream": True, "stream_options": {"include_usage": True}, "user": "bob"}
    assert k(streamed) == k(BASE)


def test_namespace_ignores_only_the_last_user_text() -> None:
    other = {**BASE, "messages": [BASE["messages"][0], {"role": "user", "content": "Explain Redis"}]}
    assert k(other).exact != k(BASE).exact
    assert k(other).namespace == k(BASE).namespace
    assert k(other).semantic_text == "Explain Redis"
    sys2 = {**BASE, "messages": [{"role": "system", "content": "Be verbose."}, BASE["messages"][1]]}
    assert k(sys2).namespace != k(BASE).namespace
    assert k({**BASE, "temperature": 0}).namespace != k(BASE).namespace


def test_no_namespace_without_a_last_user_text() -> None:
    assert k({"model": "m", "messages": [{"role": "user", "content": "q"},
                                          {"role": "assistant", "content": "a"}]}).namespace is None
    assert k({"model": "m", "messages": [{"role": "user", "content": " \n"}]}).namespace is None
    assert k({"model": "m", "prompt": [1, 2]}, COMP).namespace is None
    assert k({"model": "m", "prompt": "go on"}, COMP).semantic_text == "go on"


def test_nfc_precomposed_and_decomposed_share_the_keys() -> None:
    pre = {"model": "m", "messages": [{"role": "user", "content": "caf\u00e9"}]}
    dec = {"model": "m", "messages": [{"role": "user", "content": "cafe\u0301"}]}
    assert k(pre).exact == k(dec).exact
    assert k(pre).namespace == k(dec).namespace
    hangul = {"model": "m", "messages": [{"role": "user", "content": "\u1100\u1161"}]}
    assert k(hangul).exact == k({**hangul, "messages": [{"role": "user", "content": "\uac00"}]}).exact
    # NFC, not NFKC: compatibility characters stay distinct
    assert k({**pre, "messages": [{"role": "user", "content": "\ufb01"}]}).exact != \
        k({**pre, "messages": [{"role": "user", "content": "fi"}]}).exact


def test_integral_floats_equal_integers() -> None:
    assert k({**BASE, "temperature": 1}).exact == k({**BASE, "temperature": 1.0}).exact
    assert k({**BASE, "temperature": 0}).exact != k({**BASE, "temperature": 0.0001}).exact
