"""A real ComfyUI server with the pack installed, for the example run and the host and browser tests.

The host is the ComfyUI checkout named by ``COMFYUI_PATH`` or the default one that
``tests/host/install_comfyui.sh`` unpacks into ``.host/comfyui-0.3.75``. Each server gets its own base
directory (models, custom_nodes with a link to this pack, input, output, user) and runs on the CPU, or on
the GPU when ``H3_COMFY_GPU=1`` is set (the same tests then exercise the nodes' CUDA paths).
``H3_COMFY_ARGS`` adds arguments to the host's command line (for example ``--front-end-root DIR`` where the
frontend package is not installed).

The driver needs nothing the host does not install: HTTP goes through ``urllib.request`` (no proxy: the server
is on the loopback address), the event stream through aiohttp's WebSocket client (aiohttp is the host's own
server library, in its requirements), so the host tests run in any environment that runs the host.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_HOST = ROOT / ".host" / "comfyui-0.3.75"
TEXT_EVENT = 3  # the host's binary event type of a node's progress text
PREVIEW_EVENTS = (1, 4)  # a preview image, and one with its metadata (protocol.BinaryEventTypes)
END_EVENTS = ("execution_success", "execution_error", "execution_interrupted")
DEVICE_FLAGS = () if os.environ.get("H3_COMFY_GPU") == "1" else ("--cpu",)
EXTRA_ARGS = tuple(shlex.split(os.environ.get("H3_COMFY_ARGS", "")))
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # http_proxy must not catch 127.0.0.1


def comfyui_root() -> Path:
    root = Path(os.environ.get("COMFYUI_PATH") or DEFAULT_HOST)
    if not (root / "main.py").is_file():
        raise RuntimeError(
            f"no ComfyUI at {root}: run `bash tests/host/install_comfyui.sh {sys.executable}` (the "
            "test command does) or set COMFYUI_PATH"
        )
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PromptRefused(AssertionError):
    """The server refused a prompt when it was queued (validation): ``answer`` is its JSON answer, the message
    ``failure_message(answer)``."""

    def __init__(self, answer: dict):
        super().__init__(failure_message(answer))
        self.answer = answer


class ComfyServer:
    def __init__(self, base: Path, extra_args: tuple[str, ...] = ()):
        self.base, self.extra_args = base, tuple(extra_args)
        for folder in ("models", "custom_nodes", "input", "output", "user"):
            (base / folder).mkdir(parents=True, exist_ok=True)
        link = base / "custom_nodes" / "h3_hybrid"
        if not link.exists():
            link.symlink_to(ROOT, target_is_directory=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "server.log"
        self.process: subprocess.Popen | None = None
        self.client_id = uuid.uuid4().hex

    @classmethod
    def beside(cls, other: "ComfyServer", base: Path, extra_args: tuple[str, ...] = ()) -> "ComfyServer":
        """A new server (not started) on ``other``'s model and input folders, with the node packs installed beside
        the pack in ``other`` (the test probes)."""
        for folder in ("models", "input"):
            (base / folder).symlink_to(getattr(other, folder), target_is_directory=True)
        server = cls(base, extra_args)
        for pack in (other.base / "custom_nodes").iterdir():
            if not (server.base / "custom_nodes" / pack.name).exists():
                (server.base / "custom_nodes" / pack.name).symlink_to(pack.resolve(), target_is_directory=True)
        return server

    @property
    def models(self) -> Path:
        return self.base / "models"

    @property
    def output(self) -> Path:
        return self.base / "output"

    @property
    def input(self) -> Path:
        return self.base / "input"

    def stall_check(self, what: str, stall: float) -> Callable[[], None]:
        """A check that raises ``TimeoutError`` (naming ``what``) once the server's log has not grown for ``stall``
        seconds: waits end on a lack of progress, not on how fast this machine happens to be."""
        seen = {"size": -1, "since": time.monotonic()}

        def check() -> None:
            size = self.log_path.stat().st_size if self.log_path.exists() else 0
            now = time.monotonic()
            if size != seen["size"]:
                seen.update(size=size, since=now)
            elif now - seen["since"] > stall:
                raise TimeoutError(f"{what}: the server logged nothing for {stall:.0f} s:\n{self.log_tail()}")

        return check

    def start(self, stall: float = 240) -> "ComfyServer":
        root = comfyui_root()
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "main.py",
                *DEVICE_FLAGS,
                "--listen",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--base-directory",
                str(self.base),
                "--disable-auto-launch",
                *EXTRA_ARGS,
                *self.extra_args,
            ],
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        check = self.stall_check("ComfyUI did not start answering", stall)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.request("GET", "/object_info/H3Sampler", timeout=5)
                return self
            except OSError:  # not listening yet: refused, reset or timed out (urllib's errors are OSErrors)
                pass
            check()
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_for_log(self, text: str, count: int, stall: float = 120) -> None:
        """Until ``text`` appears ``count`` times in the server's log: for what the server does beside the
        prompts (its start thread's work, say)."""
        check = self.stall_check(f"{text!r} not logged {count} times", stall)
        while self.log_path.read_text(errors="replace").count(text) < count:
            check()
            time.sleep(0.1)

    def free(self, said: str, unload_models: bool = True, free_memory: bool = False, stall: float = 120) -> None:
        """POST ``/free`` and wait until the server's log says ``said`` once more. The host's worker reads the flags
        only when it wakes, and a ``/free`` posted while it is between reading them and waiting again wakes nobody
        (it would sleep up to 1000 s): the request is posted again every 5 s until the log says it was done."""
        count = self.log_path.read_text(errors="replace").count(said) + 1
        check = self.stall_check(f"{said!r} not logged after /free", stall)
        while True:
            self.post("/free", {"unload_models": unload_models, "free_memory": free_memory})
            posted = time.monotonic()
            while time.monotonic() - posted < 5:
                if self.log_path.read_text(errors="replace").count(said) >= count:
                    return
                check()
                time.sleep(0.1)

    def request(self, method: str, path: str, body=None, timeout: float = 60):
        """``method`` ``path`` with ``body`` (JSON) if given; the answer's JSON, or None for an empty answer.
        An HTTP error status raises ``urllib.error.HTTPError`` (its ``read()`` holds the server's answer)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {} if data is None else {"Content-Type": "application/json"}
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        with _LOOPBACK.open(request, timeout=timeout) as response:
            answer = response.read()
        return json.loads(answer) if answer.strip() else None

    def get(self, path: str):
        return self.request("GET", path)

    def post(self, path: str, body=None, timeout: float = 60):
        """POST ``body`` as JSON (``/free`` takes ``{"unload_models": ..., "free_memory": ...}``)."""
        return self.request("POST", path, {} if body is None else body, timeout)

    def object_info(self) -> dict:
        return self.get("/object_info")

    def queue(self, prompt: dict) -> dict:
        """POST /prompt; the server's answer: ``prompt_id`` or ``error`` with ``node_errors``."""
        try:
            return self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})
        except urllib.error.HTTPError as refused:  # 400 with the validation errors as JSON
            with refused:
                return json.loads(refused.read())

    def wait(self, prompt_id: str, stall: float = 600) -> dict:
        """The history entry of a finished prompt (``status``, ``outputs``); ``TimeoutError`` when the server logs
        nothing for ``stall`` seconds before it finishes."""
        check = self.stall_check(f"prompt {prompt_id} did not finish", stall)
        while True:
            history = self.get(f"/history/{prompt_id}")
            if prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
                entry = history[prompt_id]
                if entry["status"].get("status_str") in ("success", "error"):
                    return entry
            check()
            time.sleep(0.25)

    def run(self, prompt: dict, stall: float = 600) -> dict:
        """The history entry of ``prompt`` once it has run; ``PromptRefused`` when the server refuses it."""
        answer = self.queue(prompt)
        if "prompt_id" not in answer:
            raise PromptRefused(answer)
        return self.wait(answer["prompt_id"], stall)

    def socket(self) -> "_EventSocket":
        """The host's websocket for this client, opened (as the frontend has it open before anything is queued)."""
        return _EventSocket(f"ws://127.0.0.1:{self.port}/ws?clientId={self.client_id}")

    def events(self, prompt: dict, timeout: float = 300, ws: "_EventSocket | None" = None):
        """Queue ``prompt`` and yield its events from the host's websocket until it ends: ``(type, data)`` for
        the JSON messages about this prompt (the last one ``execution_success``, ``execution_error`` or
        ``execution_interrupted``), ``("text", (node, text))`` for a node's progress text and
        ``("preview", payload)`` for a preview image (the bytes after the event type). The first event is
        ``("queued", {"prompt_id": ...})``. ``ws``: a socket already open (``socket()``), closed at the end."""
        ws = ws or self.socket()
        try:
            answer = self.queue(prompt)
            if "prompt_id" not in answer:
                raise PromptRefused(answer)
            prompt_id = answer["prompt_id"]
            yield "queued", {"prompt_id": prompt_id}
            while True:
                try:
                    message = ws.receive(timeout)
                except TimeoutError:
                    raise TimeoutError(f"no event from the server in {timeout} s:\n{self.log_tail()}") from None
                if isinstance(message, bytes):
                    (kind,) = struct.unpack(">I", message[:4])
                    if kind == TEXT_EVENT:  # node id length, node id, text
                        (size,) = struct.unpack(">I", message[4:8])
                        yield "text", (message[8 : 8 + size].decode(), message[8 + size :].decode())
                    elif kind in PREVIEW_EVENTS:
                        yield "preview", message[4:]
                    continue
                event = json.loads(message)
                if event.get("data", {}).get("prompt_id") != prompt_id:
                    continue
                yield event["type"], event["data"]
                if event["type"] in END_EVENTS:
                    return
        finally:
            ws.close()

    def interrupt(self) -> None:
        self.post("/interrupt", timeout=30)


class _EventSocket:
    """A blocking reader of the host's WebSocket: aiohttp's client, driven on an event loop of its own."""

    def __init__(self, url: str):
        import aiohttp

        self._loop = asyncio.new_event_loop()

        async def connect():
            session = aiohttp.ClientSession()
            try:
                return session, await session.ws_connect(url, max_msg_size=0)  # no cap on a message's size
            except BaseException:
                await session.close()
                raise

        try:
            self._session, self._ws = self._loop.run_until_complete(connect())
        except BaseException:
            self._loop.close()
            raise

    def receive(self, timeout: float) -> str | bytes:
        """The next text (``str``) or binary (``bytes``) message; ``TimeoutError`` when none comes in time,
        ``ConnectionError`` when the server closes the socket."""
        import aiohttp

        try:
            message = self._loop.run_until_complete(self._ws.receive(timeout))
        except asyncio.TimeoutError:  # an alias of TimeoutError from Python 3.11 on
            raise TimeoutError(f"no message in {timeout} s") from None
        if message.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            return message.data
        raise ConnectionError(f"the server's WebSocket ended ({message.type.name}: {message.extra})")

    def close(self) -> None:
        async def close():
            await self._ws.close()
            await self._session.close()

        try:
            self._loop.run_until_complete(close())
        finally:
            self._loop.close()


def failure_message(answer: dict) -> str:
    """What went wrong with a prompt, readably, naming each failing node by id and class type.

    ``answer`` is either what ``ComfyServer.queue`` returned for a refused prompt (the host's ``error`` and,
    per node, ``node_errors``: each error's message and details) or the history entry of a prompt that failed
    while running (its ``execution_error``: the node and the exception's message)."""
    if "status" in answer:
        status = answer["status"]
        for kind, data in status.get("messages", []):
            if kind in ("execution_error", "execution_interrupted"):
                node = f"node {data.get('node_id')} ({data.get('node_type')})"
                if kind == "execution_interrupted":
                    return f"the prompt was interrupted at {node}"
                exception = (data.get("exception_type") or "").rsplit(".", 1)[-1]
                text = str(data.get("exception_message", "")).strip()
                return f"{node} failed: {exception + ': ' if exception else ''}{text}"
        return f"the prompt ended with status {status.get('status_str')!r} and no error message"
    error = answer.get("error")
    if isinstance(error, dict):
        head = ": ".join(str(part).strip() for part in (error.get("message"), error.get("details")) if part)
    else:
        head = str(error or "no error given")
    lines = [f"the server refused the prompt: {head}"]
    node_errors = answer.get("node_errors") or {}
    for node_id in sorted(node_errors, key=lambda key: (len(key), key)):  # "9" before "10"
        node = node_errors[node_id]
        # The host repeats a node's own validation verdict once per input it checked ("mode - <verdict>",
        # "input_types - <verdict>"): one line per verdict, naming those inputs.
        verdicts = {}
        for entry in node.get("errors") or [{}]:
            message, details = str(entry.get("message") or "").strip(), str(entry.get("details") or "").strip()
            name = (entry.get("extra_info") or {}).get("input_name")
            if name and details.startswith(f"{name} - "):
                verdicts.setdefault((message, details[len(name) + 3 :]), []).append(name)
            else:
                verdicts.setdefault((message, details), [])
        for (message, details), names in verdicts.items():
            details = f"{', '.join(names)} - {details}" if names else details
            text = ": ".join(part for part in (message, details) if part) or "failed validation"
            lines.append(f"  node {node_id} ({node.get('class_type', '?')}): {text}")
    return "\n".join(lines)


def error_message(entry: dict) -> str:
    """The exception message of a failed prompt's history entry."""
    for kind, data in entry["status"].get("messages", []):
        if kind == "execution_error":
            return data.get("exception_message", "")
    return ""


def mp4_files(entry: dict, output: Path) -> list[Path]:
    files = []
    for node_output in entry.get("outputs", {}).values():
        for item in node_output.get("images", []):
            if item["filename"].endswith(".mp4"):
                files.append(output / item["subfolder"] / item["filename"])
    return files
