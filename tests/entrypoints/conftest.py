"""The module-scoped servers of the HTTP tests (one-rank, DP=2, both)."""

from __future__ import annotations

import pytest

from tests.entrypoints.remote_server import API_KEY, RemoteServer


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(api_key=API_KEY)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def dp2_server():
    srv = RemoteServer(api_key=API_KEY, data_parallel_size=2)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def any_server(request):
    """The one-rank server, then the DP=2 one: for the client tests that run on both."""
    return request.getfixturevalue("server" if request.param == 1 else "dp2_server")
