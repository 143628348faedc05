"""End to end: ``pagellm serve`` in a subprocess on loopback, driven by the official ``openai`` client and httpx.

One server (API key on, ``--log-interval 1``) serves this whole package; an offline ``LLM`` in the test process is
the reference for greedy outputs. When a test of the package fails, the tail of the server's log is attached to its
report.
"""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from pagellm import LLM

from .harness import API_KEY, CHAT_CONTENT, MAX_MODEL_LEN, OFFLINE, REPO, STARTUP_TIMEOUT_S, greedy

HERE = pathlib.Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log: pathlib.Path, chars: int = 6000) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError as e:
        return f"<cannot read {log}: {e}>"
    return text[-chars:]


class _AttachServerLog:
    """pytest plugin: a failing test of this package gets the server log's tail as a report section."""

    def __init__(self, log: pathlib.Path) -> None:
        self.log = log

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        rep = yield
        if rep.failed and HERE in pathlib.Path(item.path).resolve().parents:
            rep.sections.append(("pagellm serve log (tail)", _log_tail(self.log)))
        return rep


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: pathlib.Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"pagellm serve exited with {self.proc.returncode} during startup; log:\n"
                            f"{_log_tail(self.log)}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        pytest.fail(f"pagellm serve not healthy after {timeout:.0f} s; log:\n{_log_tail(self.log)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


@pytest.fixture(scope="package")
def _server_proc(gguf_path, tmp_path_factory, request):
    """Starts ``pagellm serve`` (without waiting for it, so the offline LLM can load meanwhile)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("pagellm_serve") / "server.log"
    cmd = [sys.executable, "-m", "pagellm", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--kv-cache-memory", "512MiB", "--max-model-len", str(MAX_MODEL_LEN),
           "--api-key", API_KEY, "--log-interval", "1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PAGELLM_API_KEY", None)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    server = Server(proc, port, log)
    plugin = _AttachServerLog(log)
    request.config.pluginmanager.register(plugin, f"pagellm-serve-log-{port}")
    try:
        yield server
    finally:
        server.stop()
        request.config.pluginmanager.unregister(plugin)


@pytest.fixture(scope="package")
def server(_server_proc) -> Server:
    _server_proc.wait_healthy()
    return _server_proc


@pytest.fixture(scope="package")
def llm(_server_proc):
    """The offline reference. Depends on _server_proc only so that the server boots while this loads.

    One intra-op thread: the server process runs next to this one, and two processes each spinning two OpenMP
    threads on a busy machine slow the offline side down many times over (greedy outputs do not depend on
    the thread count). The engine sets torch's thread count process-wide, so it is put back afterwards.
    """
    threads = torch.get_num_threads()
    try:
        yield LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=MAX_MODEL_LEN, num_threads=1)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="package")
def client(server):
    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=60.0)
    yield c
    c.close()


@pytest.fixture(scope="package")
def http(server):
    c = httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60.0)
    yield c
    c.close()


@pytest.fixture(scope="package")
def model_name(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="package")
def ref(llm) -> dict:
    """name -> offline RequestOutput (``OFFLINE`` through ``LLM.generate``; "chat16" through ``LLM.chat``)."""
    names = list(OFFLINE)
    outs = llm.generate([OFFLINE[n][0] for n in names], [OFFLINE[n][1] for n in names], use_tqdm=False)
    res = dict(zip(names, outs))
    res["chat16"] = llm.chat([{"role": "user", "content": CHAT_CONTENT}], greedy(16), use_tqdm=False)[0]
    return res
