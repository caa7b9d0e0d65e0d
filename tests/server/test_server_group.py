"""`ServerGroup`: servers joined through /weight_info under one deadline, one sender kept while the
live servers stay the same, a server that fails a push dropped (with why), a `to=` push through a
sender of its own, and a closed group that refuses."""

from __future__ import annotations

import threading
import time

import pytest
from safetensors.torch import load_file

from tests.server.conftest import live_server
from weightsync.client import ServerGroup
from weightsync.errors import ConfigError, ResourceError, ServerError, SyncFailed

DEAD = "http://127.0.0.1:9"


def test_a_group_pushes_to_the_servers_that_are_up_and_reuses_its_sender(tiny_models) -> None:
    model = tiny_models["qwen2"]
    tensors = load_file(model / "model.safetensors")
    heard: list[tuple[str, float]] = []
    with live_server(model) as server, ServerGroup(timeout=10.0) as group:
        started = time.monotonic()
        infos, errors = group.join([server.url, DEAD], lambda url, wait_s, why: heard.append((url, wait_s)))
        assert time.monotonic() - started < 15, "one deadline for the whole join"
        assert list(infos) == [server.url] and list(errors) == [DEAD] and errors[DEAD].status == 0
        assert [url for url, _ in heard] == [DEAD] and 0 < heard[0][1] <= 10.0
        assert [client.base_url for client in group.live] == [server.url]
        first = group.push(tensors, 1)
        sender = group._sender
        second = group.push(tensors, 2)
        assert first.ok and second.ok and group._sender is sender, "same servers: the same sender"
        assert server.client.weight_info()["version"] == 2
        catch_up = group.push(tensors, 3, to=[server.url])
        assert [o.address for o in catch_up.outcomes] == infos[server.url]["addresses"]
        assert group._sender is sender
        group.drop(server.url, "failed a request")
        assert group.live == [] and group.failed == {server.url: "failed a request"}
        with pytest.raises(ResourceError, match="no rollout server left"):
            group.push(tensors, 4)
        group.join([server.url])  # taken back, on the same receivers: the same sender
        assert group.push(tensors, 4).ok and group._sender is sender and group.failed == {}
    with pytest.raises(ResourceError, match="closed"):
        group.push(tensors, 5)


def test_a_server_that_does_not_commit_leaves_the_group_then_the_push_raises(tiny_models) -> None:
    qwen, llama = tiny_models["qwen2"], tiny_models["llama"]
    with live_server(qwen) as good, live_server(llama) as other, ServerGroup(timeout=10.0) as group:
        group.join([good.url, other.url])
        with pytest.raises(SyncFailed) as failed:
            group.push(load_file(qwen / "model.safetensors"), 1)  # llama's server cannot take qwen2's weights
        assert [client.base_url for client in group.live] == [good.url]
        assert list(group.failed) == [other.url] and "did not commit version 1 (PlanError: " in group.failed[other.url]
        assert not failed.value.report.ok and good.client.weight_info()["version"] == 1


def test_a_malformed_url_is_refused_before_any_server_is_asked() -> None:
    with ServerGroup(timeout=1.0) as group, pytest.raises(ConfigError, match="http:// or https://"):
        group.join(["http://127.0.0.1:9", "127.0.0.1:8000"])
    assert group.clients == []


def test_wait_until_up_honours_its_whole_timeout_while_the_port_refuses_connections(tiny_models) -> None:
    """A server binds its port only after its imports (8-40 s on a busy host): refused connections
    are waited for as long as a 503 is, the whole timeout, not a shorter grace of their own."""
    from weightsync.client import RolloutClient
    from weightsync.serving.background import bind

    with RolloutClient(DEAD) as client:
        started = time.monotonic()
        with pytest.raises(ServerError, match="not up after 2 s") as refused:
            client.wait_until_up(2.0)
        assert time.monotonic() - started >= 2.0 and refused.value.status == 0
    probe = bind("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()  # a free port nothing listens on yet: refused until the server below takes it
    found: dict[str, object] = {}
    with RolloutClient(f"http://127.0.0.1:{port}") as client:
        waiter = threading.Thread(target=lambda: found.update(client.wait_until_up(60.0)))
        waiter.start()
        time.sleep(11.0)  # past the 10 s refused connections used to get
        assert waiter.is_alive(), "still waiting for the port"
        with live_server(tiny_models["qwen2"], port=port) as server:
            waiter.join(60.0)
            assert found["addresses"] == server.client.weight_info()["addresses"]


def test_a_url_that_is_not_a_weightsync_server_is_named_not_its_html() -> None:
    """Another service's 404 page is not repeated to the user: one line says what answered."""
    import http.server

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = b"<!DOCTYPE html><html><head><title>404 Not Found</title></head><body>" + b"x" * 900 + b"</body>"
            self.send_response(404)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=web.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{web.server_address[1]}"
    try:
        with ServerGroup(timeout=5.0) as group:
            _, errors = group.join([url])
    finally:
        web.shutdown()
        web.server_close()
        thread.join()
    message = str(errors[url])
    assert "answered HTTP 404 with a web page: is it a weightsync server?" in message and "<" not in message, message
