"""The agent's HTTP protocol closes a connection whose request does not arrive whole in time
(slowloris), on a real uvicorn server on loopback with a trivial app and a short deadline."""
from __future__ import annotations

import socket
import threading

import pytest
import uvicorn

from agent.serve.request_deadline import RequestDeadline

WAIT_S = 30.0   # far above the deadline: only a connection the server never closes reaches it


class Short(RequestDeadline):
    request_timeout_s = 0.5
    arriving = {}


class Few(RequestDeadline):
    request_timeout_s = WAIT_S * 10      # only the bound closes connections here
    max_arriving = 3
    arriving = {}


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def server(request):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    protocol = getattr(request, "param", Short)
    config = uvicorn.Config(app, log_config=None, http=protocol, timeout_keep_alive=3600, lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        threading.Event().wait(0.01)
    yield sock.getsockname()
    srv.should_exit = True
    thread.join(WAIT_S)


def connect(address, sent: bytes) -> socket.socket:
    conn = socket.create_connection(address, timeout=WAIT_S)
    conn.sendall(sent)
    return conn


def read_to_close(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes (a socket timeout if it never does); a server that
    closes before reading what was sent resets the connection."""
    got = b""
    try:
        while chunk := conn.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return got


GET = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.mark.parametrize("sent", [b"", b"GET / HTTP/1.1\r\nHost: 127", b"POST / HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Length: 100\r\n\r\n" + b"x" * 10, GET + b"GET / HT"])
def test_a_request_that_never_arrives_whole_has_its_connection_closed(server, sent):
    with connect(server, sent) as conn:
        got = read_to_close(conn)        # before the deadline, uvicorn held such a connection for ever
    assert got.count(b"200 OK") == sent.count(GET)


def test_whole_requests_are_answered_pipelined_and_the_connection_then_closed(server):
    with connect(server, GET + GET) as conn:
        conn.shutdown(socket.SHUT_WR)
        assert read_to_close(conn).count(b"200 OK") == 2


@pytest.mark.parametrize("server", [Few], indirect=True)
def test_a_flood_of_unfinished_requests_closes_the_oldest_and_a_prompt_client_is_served(server):
    flood = [connect(server, b"GET / HTTP/1.1\r\nHost: 127") for _ in range(6)]
    try:
        for oldest in flood[:3]:
            assert read_to_close(oldest) == b""          # closed to make room, oldest first
        with connect(server, GET) as prompt:
            prompt.shutdown(socket.SHUT_WR)
            assert b"200 OK" in read_to_close(prompt)
    finally:
        for conn in flood:
            conn.close()
