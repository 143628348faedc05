"""AsyncLLMEngine: the step loop in a background thread, each request's outputs as an async stream.

The engine itself is single-threaded. All calls into it (add, abort, step) happen on the loop thread; the
asyncio side only enqueues commands and receives outputs through ``loop.call_soon_threadsafe``. So HTTP
handlers never block on a forward pass, and many requests are batched continuously by the one loop.

The loop thread also builds the engine, so that it is the only thread starting OpenMP parallel regions. libgomp
keeps a pool of worker threads per thread that starts regions, and once it manages more threads than there are
CPUs it stops spinning between regions: each of a step's ~250 kernel calls then wakes its workers through the
kernel. With the model loaded on the caller's thread and stepped on this one, workload_64 took 9.8-9.9 s against
7.9-8.4 s from one thread (2 cores, pagellm serve 10.1-11.2 s against the offline engine's ~8).

    handler --(add/abort command)--> [command queue] --> loop thread: apply commands, step(), publish outputs
    handler <--(RequestOutput)------ [per-request asyncio.Queue] <--------------------------/
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagellm.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.metrics import EngineMetrics
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm")

# KV cache mapped per chunk while idle: ~5 ms where the host already backs the memory, ~50 ms where it backs it
# only on first touch (1.1-1.7 s a GiB on the project's VM)
_PREFAULT_CHUNK = 32 * 2**20


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, log_interval_s: float = 5.0, registry=None,
                 prefault_when_idle: bool = True) -> None:
        """Builds the engine on the loop thread (see above) and returns once it is ready, raising what building it
        raised. prefault_when_idle: map the KV cache's never-used blocks while no request runs (LLMEngine.
        prefault_kv_cache), so that later steps take no page faults in them."""
        self.engine: LLMEngine  # both set on the loop thread
        self.metrics: EngineMetrics
        self.prefault_when_idle = prefault_when_idle
        self.log_interval_s = log_interval_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self.dead_error: BaseException | None = None
        self._ids = 0
        failed: list[BaseException] = []
        ready = threading.Event()
        self._thread = threading.Thread(target=self._build_and_run, args=(config, registry, ready, failed),
                                        name="pagellm-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    # ------------------------------------------------------------------ asyncio side
    async def generate(self, prompt: str | None, sampling_params: SamplingParams,
                       prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                       cache_salt: str | None = None,
                       share_prompt_with: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as tokens arrive; the last one has ``finished=True``.

        Raises ValueError (bad input) before the first output. Leaving the iteration early (client gone,
        cancellation) aborts the request in the engine, which frees its blocks at the next step.
        ``share_prompt_with``: as in LLMEngine.add_request.
        """
        outputs = self.submit(prompt, sampling_params, prompt_token_ids, request_id, cache_salt,
                              share_prompt_with=share_prompt_with)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()  # (now, not when collected: it aborts an unfinished request)

    def submit(self, prompt: str | None, sampling_params: SamplingParams, prompt_token_ids: list[int] | None = None,
               request_id: str | None = None, cache_salt: str | None = None, keep_kv: bool = False,
               fork_of: str | None = None, share_prompt_with: str | None = None) -> AsyncIterator[RequestOutput]:
        """``generate``, but the request is queued now, in call order with other commands, and its outputs come
        from the iterator returned. ``keep_kv`` and ``fork_of`` (a kept request's id; ``prompt_token_ids`` are then
        the tokens the fork adds) as in LLMEngine.add_request and fork_request; ``release_kv`` frees what is kept.
        Call from the event loop's thread. Iterate the result to its end, or close it once started, or release_kv
        the request: one dropped unstarted neither aborts nor frees it (and release_kv of a request still being
        iterated aborts it: its iterator then waits for nothing more)."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop has died: {self.dead_error!r}")
        loop = asyncio.get_running_loop()
        if request_id is None:
            self._ids += 1
            request_id = f"req-{self._ids}"
        accepted: asyncio.Future = loop.create_future()
        stream = _Stream(loop, asyncio.Queue())
        self._command(("add", request_id, prompt, sampling_params, prompt_token_ids, cache_salt, stream, accepted,
                       keep_kv, fork_of, share_prompt_with))
        return self._outputs(request_id, stream, accepted)

    async def _outputs(self, request_id: str, stream: _Stream,
                       accepted: asyncio.Future) -> AsyncIterator[RequestOutput]:
        try:
            await accepted  # raises the engine's ValueError for bad input
        except asyncio.CancelledError:
            self.abort(request_id)  # queued after the add, so it finds the request (a no-op if the add failed)
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._command(("abort", request_id))

    def release_kv(self, request_id: str) -> None:
        """Free a kept request's blocks (LLMEngine.release_kv), or abort it if it has not finished."""
        self._command(("release", request_id))

    def _command(self, cmd: tuple) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ loop thread
    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, ids, salt, stream, accepted, keep_kv, parent, lead = cmd
                try:
                    if parent is not None:
                        self.engine.fork_request(parent, ids, params, rid, keep_kv)
                    else:
                        self.engine.add_request(prompt, params, prompt_token_ids=ids, request_id=rid,
                                                cache_salt=salt, keep_kv=keep_kv, share_prompt_with=lead)
                except Exception as e:  # bad input: tell the caller, touch nothing else
                    stream.loop.call_soon_threadsafe(_set_exception, accepted, e)
                    continue
                self._streams[rid] = stream
                self.metrics.on_arrival(rid)
                stream.loop.call_soon_threadsafe(_set_result, accepted, None)
            elif cmd[0] == "abort" or (cmd[0] == "release" and not self.engine.release_kv(cmd[1])):
                rid = cmd[1]
                if self._streams.pop(rid, None) is not None and self.engine.abort_request(rid):
                    self.metrics.on_finished(rid, "abort")

    def _build_and_run(self, config: EngineConfig, registry, ready: threading.Event,
                       failed: list[BaseException]) -> None:
        try:
            self.engine = LLMEngine(config)
            self.metrics = EngineMetrics(self.engine, registry)
        except BaseException as e:  # bad config, missing model...: __init__ raises it
            failed.append(e)
            return
        finally:
            ready.set()
        self._run()

    def _run(self) -> None:
        last_log = time.monotonic()
        try:
            while not self._stop:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self.metrics.update_gauges()
                    # a chunk at a time (tens of ms at most), so a request arriving meanwhile waits little
                    if self.prefault_when_idle and self.engine.prefault_kv_cache(_PREFAULT_CHUNK):
                        continue
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                now = time.monotonic()
                for out in outputs:
                    self.metrics.on_output(out, now)
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                self.metrics.update_gauges()
                if now - last_log >= self.log_interval_s:
                    logger.info(self.metrics.log_line(now - last_log))
                    last_log = now
        except BaseException as e:  # the loop died: fail every open stream, /health reports 503
            logger.exception("engine loop died")
            self.dead_error = e
            for stream in self._streams.values():
                stream.put(EngineDeadError(f"the engine loop has died: {e!r}"))
            self._streams.clear()


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
