"""tests/comfy_host.py's HTTP and WebSocket client against an aiohttp server (the host's own server library)
that answers the way ComfyUI 0.3.75's server.py does: JSON, empty answers, a 400 with validation errors, and
the event stream (JSON messages and binary frames whose first four bytes give the event type)."""

import asyncio
import json
import struct
import threading

import pytest
from aiohttp import web
from comfy_host import TEXT_EVENT, ComfyServer, _EventSocket

PREVIEW_EVENT = 1  # the host's binary event type of a preview image
BIG = bytes(range(256)) * (5 * 4096 + 7)  # over aiohttp's default 4 MiB cap on a message


@pytest.fixture
def host(tmp_path):
    """A ComfyServer pointed at the stand-in server (no ComfyUI process), and what the stand-in received."""
    received, loop = [], asyncio.new_event_loop()
    queued = asyncio.Event()

    async def post_prompt(request):
        body = await request.json()
        received.append(body)
        if "bad" in body["prompt"]:
            return web.json_response(
                {"error": {"type": "prompt_outputs_failed_validation"}, "node_errors": {"1": {}}}, status=400
            )
        queued.set()
        return web.json_response({"prompt_id": "p1", "number": 0, "node_errors": {}})

    async def echo(request):
        return web.json_response(await request.json())

    async def object_info(request):
        return web.json_response({"H3Sampler": {"category": "H3 Hybrid"}})

    async def empty(request):
        received.append(await request.text())
        return web.Response()

    async def events(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(json.dumps({"type": "status", "data": {"status": {}, "sid": "x"}}))
        await queued.wait()
        await ws.send_str(json.dumps({"type": "progress", "data": {"prompt_id": "other", "value": 1, "max": 2}}))
        await ws.send_bytes(struct.pack(">I", PREVIEW_EVENT) + b"\xff\xd8 a jpeg")
        node = b"7"
        await ws.send_bytes(struct.pack(">II", TEXT_EVENT, len(node)) + node + "step 1 of 2 · é".encode())
        progress = {"prompt_id": "p1", "node": "7", "value": 1, "max": 2}
        await ws.send_str(json.dumps({"type": "progress", "data": progress}))
        await ws.send_str(json.dumps({"type": "execution_success", "data": {"prompt_id": "p1"}}))
        await ws.send_str(json.dumps({"type": "status", "data": {"prompt_id": "p1", "after": "the end"}}))
        await ws.close()
        return ws

    async def big_then_close(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_bytes(BIG)
        await ws.send_str("done")
        await ws.close()
        return ws

    async def silent(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for _ in ws:  # sends nothing until the client closes
            pass
        return ws

    app = web.Application()
    app.add_routes(
        [
            web.post("/prompt", post_prompt),
            web.post("/echo", echo),
            web.get("/object_info", object_info),
            web.post("/interrupt", empty),
            web.get("/ws", events),
            web.get("/big", big_then_close),
            web.get("/silent", silent),
        ]
    )
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ComfyServer(tmp_path / "base")
    server.port = runner.addresses[0][1]
    server.url = f"http://127.0.0.1:{server.port}"
    server.received = received
    yield server
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_json_requests_and_answers(host):
    assert host.post("/echo", {"unload_models": True, "free_memory": False}) == {
        "unload_models": True,
        "free_memory": False,
    }
    assert host.post("/echo") == {}
    assert host.object_info() == {"H3Sampler": {"category": "H3 Hybrid"}}
    host.interrupt()  # an empty answer
    assert host.received == ["{}"]


def test_a_refused_prompt_gives_the_servers_errors(host):
    answer = host.queue({"bad": {}})
    assert answer == {"error": {"type": "prompt_outputs_failed_validation"}, "node_errors": {"1": {}}}
    assert host.received == [{"prompt": {"bad": {}}, "client_id": host.client_id}]


def test_events_of_the_prompt_until_it_ends(host):
    got = list(host.events({"1": {"class_type": "H3Sampler", "inputs": {}}}, timeout=30))
    assert got == [
        ("queued", {"prompt_id": "p1"}),
        ("preview", b"\xff\xd8 a jpeg"),
        ("text", ("7", "step 1 of 2 · é")),
        ("progress", {"prompt_id": "p1", "node": "7", "value": 1, "max": 2}),
        ("execution_success", {"prompt_id": "p1"}),
    ]


def test_messages_of_any_size_then_the_close(host):
    ws = _EventSocket(f"ws://127.0.0.1:{host.port}/big")
    try:
        assert ws.receive(30) == BIG
        assert ws.receive(30) == "done"
        with pytest.raises(ConnectionError, match="WebSocket ended"):
            ws.receive(30)
    finally:
        ws.close()


def test_a_silent_socket_times_out(host):
    ws = _EventSocket(f"ws://127.0.0.1:{host.port}/silent")
    try:
        with pytest.raises(TimeoutError, match="no message in 0.2 s"):
            ws.receive(0.2)
    finally:
        ws.close()
