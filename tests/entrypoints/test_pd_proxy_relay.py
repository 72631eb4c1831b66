"""``atom pd-proxy``'s parts without servers: the relay of a decode instance's stream that
breaks mid-way (the instance died) and the refusal of what P/D cannot serve. The whole proxy
runs in tests/entrypoints/test_pd.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from atom.entrypoints.openai.api_server import _stream_events
from atom.entrypoints.pd_proxy import _relay, unsupported


def _relayed(chunks: list[bytes], *, breaks: bool) -> list[str]:
    """What the proxy's client receives when the upstream sends ``chunks`` (then breaks)."""
    async def body():
        for chunk in chunks:
            yield chunk
        if breaks:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete "
                                            "message body")

    async def run() -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            resp = await client.send(client.build_request("POST", "http://decode/v1/completions"),
                                     stream=True)
            rest = _relay(resp)
            return [event async for event in _stream_events(await anext(rest), rest)]

    return asyncio.run(run())


def test_a_stream_that_breaks_ends_with_an_error_event_and_no_partial_one():
    events = _relayed([b'data: {"i": 0}\n\ndata: {"i"', b': 1}\n\ndata: {"i": 2'], breaks=True)
    assert events[:2] == ['data: {"i": 0}\n\n', 'data: {"i": 1}\n\n']
    error = json.loads(events[2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error"
    assert "http://decode/v1/completions failed mid-stream" in error["message"]
    assert events[3:] == ["data: [DONE]\n\n"]


def test_a_whole_stream_is_relayed_as_it_came():
    chunks = [b'data: {"i": 0}\n', b'\ndata: [DONE]\n\n']
    assert "".join(_relayed(chunks, breaks=False)) == 'data: {"i": 0}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize("n, refused", [(2, True), (1, False), (None, False), (0, False),
                                        ("two", False), (True, False)])
def test_only_n_above_1_is_refused_here(n, refused):
    """A bad n (0, a string) is the instance's own 400, which names the field."""
    reason = unsupported("/v1/completions", {"prompt": "x", "n": n})
    assert (reason is not None) == refused, reason
