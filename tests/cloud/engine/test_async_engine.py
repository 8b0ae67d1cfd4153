"""AsyncEngine: streaming, concurrency, cancellation frees KV blocks, errors reach the caller."""
from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from apiary.cloud.engine import AsyncEngine, EngineError, EngineOverloaded, RequestRejected, SamplingParams
from tests.cloud.engine.test_engine import engine_for, prompts

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def async_engine(tiny_llama: Path):
    engine = AsyncEngine(engine_for(tiny_llama, max_waiting=64))
    yield engine
    engine.shutdown()


def wait_until(predicate, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_stream_yields_deltas_that_add_up(async_engine: AsyncEngine) -> None:
    async def main():
        outs = [o async for o in async_engine.stream("hive bees queen", params=SamplingParams(max_tokens=15, ignore_eos=True))]
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].output_token_ids) == 15
    assert "".join(o.text_delta for o in outs) == outs[-1].text
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].output_token_ids


def test_metrics_show_a_finished_request_done_when_its_caller_gets_it(async_engine: AsyncEngine) -> None:
    """The snapshot is taken before delivery, so a caller that has its answer never sees it still running."""
    async def main():
        seen = []
        for _ in range(20):
            await async_engine.generate("hive bees queen", params=SamplingParams(max_tokens=2, ignore_eos=True))
            seen.append(async_engine.metrics()["requests_running"])
        return seen

    assert asyncio.run(main()) == [0] * 20


def test_concurrent_requests_match_the_blocking_engine(tiny_llama: Path, async_engine: AsyncEngine) -> None:
    texts = prompts(8, seed=4)
    params = SamplingParams(max_tokens=10)
    expected = [o.output_token_ids for o in engine_for(tiny_llama).generate(texts, params)]

    async def main():
        return await asyncio.gather(*(async_engine.generate(t, params=params, priority=i % 3)
                                      for i, t in enumerate(texts)))

    finals = asyncio.run(main())
    assert [o.output_token_ids for o in finals] == expected


def test_client_going_away_aborts_and_frees_blocks(async_engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=500, ignore_eos=True)

    async def leave_after_two(rid: str) -> int:
        got = 0
        async with contextlib.aclosing(async_engine.stream("hive " * 30, params=params, request_id=rid)) as s:
            async for _ in s:
                got += 1
                if got == 2:
                    break
        return got

    async def cancelled_task() -> None:
        started = asyncio.Event()

        async def consume():
            async for _ in async_engine.stream("queen " * 30, params=params, request_id="cancelled"):
                started.set()
                await asyncio.sleep(0.05)  # a slow reader: the engine cannot finish 500 tokens before the cancel

        task = asyncio.create_task(consume())
        await started.wait()  # cancelled mid-stream, not after a fixed time (a fast engine finished within 0.3 s)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    assert asyncio.run(leave_after_two("left")) == 2
    asyncio.run(cancelled_task())
    engine = async_engine._engine
    assert wait_until(lambda: async_engine.metrics()["kv_blocks_used"] == 0)
    assert "left" not in engine.requests and "cancelled" not in engine.requests
    assert async_engine.metrics()["requests_aborted"] == 2


def test_errors_reach_the_caller(tiny_llama: Path) -> None:
    engine = AsyncEngine(engine_for(tiny_llama, max_waiting=1, max_num_seqs=1))

    async def main():
        with pytest.raises(RequestRejected):
            await engine.generate("")
        with pytest.raises(RequestRejected):
            await engine.generate("hive", params=SamplingParams(max_tokens=10**6))
        long = SamplingParams(max_tokens=1000, ignore_eos=True)
        running = engine.stream("a", params=long)
        await anext(running)  # "a" holds the only sequence slot for ~1000 steps
        waiting = asyncio.create_task(engine.generate("b", params=long))
        while (await asyncio.to_thread(engine.metrics))["requests_waiting"] != 1:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineOverloaded):
            await engine.generate("c")
        await running.aclose()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_shutdown_ends_streams_and_refuses_new_work(tiny_llama: Path) -> None:
    engine = AsyncEngine(engine_for(tiny_llama))

    async def main():
        stream = engine.stream("hive", params=SamplingParams(max_tokens=1000, ignore_eos=True))
        first = await anext(stream)  # running now, with ~1000 steps to go
        assert not first.finished
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineError, match="shut down"):
            await engine.generate("hive")

    asyncio.run(main())
    assert not engine._thread.is_alive()
    assert engine._engine.block_manager.num_free_blocks == engine._engine.block_manager.num_blocks


def test_duplicate_request_id_is_rejected_without_hurting_the_original(async_engine: AsyncEngine) -> None:
    async def main():
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        first = async_engine.stream("hive", params=params, request_id="same")
        await anext(first)
        with pytest.raises(RequestRejected, match="already in use"):
            await async_engine.generate("queen", params=params, request_id="same")
        rest = [o async for o in first]
        return rest[-1]

    final = asyncio.run(main())
    assert final.finished and len(final.output_token_ids) == 40


def test_submissions_are_announced_until_added_even_when_refused(async_engine: AsyncEngine) -> None:
    """Each stream announces its priority (so a less urgent running step can stop early) and
    withdraws it once the engine took or refused the request: nothing stays announced."""
    async def main():
        ok = [o async for o in async_engine.stream("hive", params=SamplingParams(max_tokens=3), priority=0)]
        with pytest.raises(RequestRejected):
            async for _ in async_engine.stream("", params=SamplingParams(max_tokens=3), priority=-4):
                pass
        return ok

    assert asyncio.run(main())[-1].finished
    assert async_engine._engine._most_urgent_announced() == float("inf")
