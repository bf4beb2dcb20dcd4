"""Step hooks reach the library: its statistics count the steps and phases."""

from __future__ import annotations

import pytest

import stepalloc
from conftest import MIB, check_child, run_python


def steps(phase: str | None = None) -> int:
    own = stepalloc.stepalloc_stats(0)
    return int(own.get("steps" if phase is None else f"steps.{phase}", 0))


def test_context_manager_counts_a_step_of_its_phase() -> None:
    total, rollouts = steps(), steps("rollout")
    with stepalloc.step("rollout"):
        p = stepalloc.raw_alloc(2 * MIB)
        stepalloc.raw_free(p, 2 * MIB)
    assert steps() == total + 1
    assert steps("rollout") == rollouts + 1


def test_decorator_and_explicit_calls() -> None:
    @stepalloc.step("train")
    def train_step() -> int:
        return 42

    trains = steps("train")
    assert train_step() == 42
    assert train_step() == 42
    stepalloc.step_begin("train")
    stepalloc.step_end()
    assert steps("train") == trains + 3


def test_step_ends_when_the_body_raises() -> None:
    evals = steps("eval")
    with pytest.raises(KeyError), stepalloc.step("eval"):
        raise KeyError("boom")
    assert steps("eval") == evals + 1
    with stepalloc.step("eval"):  # the step was closed: a new one can begin
        pass
    assert steps("eval") == evals + 2


def test_step_figures_are_the_steps_peak() -> None:
    with stepalloc.step("rollout"):
        ptrs = [stepalloc.raw_alloc(4 * MIB) for _ in range(3)]
        for p in ptrs:
            stepalloc.raw_free(p, 4 * MIB)
    own = stepalloc.stepalloc_stats(0)
    assert own["last_step.peak_allocated_bytes"] >= 12 * MIB
    assert own["last_step.peak_reserved_bytes"] >= own["last_step.peak_allocated_bytes"]


def test_phase_must_be_a_string() -> None:
    with pytest.raises(TypeError):
        stepalloc.step(3)  # type: ignore[arg-type]


def test_agent_loop_records_each_phase() -> None:
    loop = stepalloc.AgentLoop(device=0)
    for _ in range(2):
        with loop.rollout():
            cache = [stepalloc.raw_alloc(1 * MIB) for _ in range(6)]  # a growing KV cache
            for p in cache:
                stepalloc.raw_free(p, 1 * MIB)
        with loop.train():
            p = stepalloc.raw_alloc(16 * MIB)
            stepalloc.raw_free(p, 16 * MIB)
        loop.next_iteration()
    assert [(r.iteration, r.phase) for r in loop.history] == [
        (0, "rollout"),
        (0, "train"),
        (1, "rollout"),
        (1, "train"),
    ]
    assert all(r.peak_allocated_bytes >= 6 * MIB for r in loop.history if r.phase == "rollout")
    assert all(r.peak_allocated_bytes >= 16 * MIB for r in loop.history if r.phase == "train")


def test_steps_do_not_nest() -> None:
    rollouts = steps("rollout")
    with stepalloc.step("rollout"), pytest.raises(RuntimeError, match="do not nest"), stepalloc.step("train"):
        pass
    assert steps("rollout") == rollouts + 1
    with stepalloc.step("train"):  # nothing is left open
        pass


def test_step_name_with_nul_is_refused_not_truncated() -> None:
    for call in (stepalloc.step, stepalloc.step_begin):
        with pytest.raises(ValueError, match="NUL"):
            call("ab\x00cd")
    with stepalloc.step("train"):  # nothing was left open
        pass


def test_decorated_coroutine_and_generator_are_inside_their_step() -> None:
    import asyncio

    size = 40 * MIB

    def body() -> None:
        p = stepalloc.raw_alloc(size)
        stepalloc.raw_free(p, size)

    @stepalloc.step("eval")
    async def coroutine() -> int:
        await asyncio.sleep(0)
        body()
        return 7

    @stepalloc.step("eval")
    def generator():  # type: ignore[no-untyped-def]
        yield 1
        body()
        yield 2

    @stepalloc.step("eval")
    async def async_generator():  # type: ignore[no-untyped-def]
        yield 1
        await asyncio.sleep(0)
        body()
        yield 2

    async def consume() -> list[int]:
        return [x async for x in async_generator()]

    for run in (lambda: asyncio.run(coroutine()), lambda: list(generator()), lambda: asyncio.run(consume())):
        evals = steps("eval")
        run()
        assert steps("eval") == evals + 1
        assert stepalloc.stepalloc_stats(0)["last_step.peak_allocated_bytes"] >= size


def test_steps_are_per_process_threads_in_the_same_phase_share_one() -> None:
    import threading

    trains = steps("train")
    inside = threading.Barrier(2)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with stepalloc.step("train"):
                inside.wait(timeout=10)
                p = stepalloc.raw_alloc(MIB)
                stepalloc.raw_free(p, MIB)
                inside.wait(timeout=10)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert steps("train") == trains + 1  # one process-wide step, entered by both threads


def test_another_phase_on_another_thread_is_refused_clearly() -> None:
    import threading

    entered, release = threading.Event(), threading.Event()

    def rollout() -> None:
        with stepalloc.step("rollout"):
            entered.set()
            release.wait(timeout=10)

    t = threading.Thread(target=rollout)
    t.start()
    try:
        assert entered.wait(timeout=10)
        with pytest.raises(RuntimeError, match="process-wide") as e, stepalloc.step("train"):
            pass
        assert "rollout" in str(e.value) and "nest" not in str(e.value)
    finally:
        release.set()
        t.join()
    with stepalloc.step("train"):  # nothing was left open
        pass


def test_concurrent_tasks_in_one_phase_share_the_step() -> None:
    import asyncio

    trains = steps("train")

    @stepalloc.step("train")
    async def task() -> None:
        await asyncio.sleep(0.01)

    async def main() -> None:
        await asyncio.gather(task(), task(), task())

    asyncio.run(main())
    assert steps("train") == trains + 1


def test_a_phase_is_checked_at_the_call_before_the_allocator_exists() -> None:
    # A name the library refuses passed the first step (before the first allocation) and
    # failed the second; a 10 MB name and a 33rd phase passed too.
    out = check_child(
        run_python(
            """
            import stepalloc
            from stepalloc import _lib

            stepalloc.configure("backend:sim")

            def refused(name, match):
                for begin in (stepalloc.step_begin, lambda n: stepalloc.step(n).__enter__()):
                    try:
                        begin(name)
                    except stepalloc.ConfigError as e:
                        assert match in str(e) and len(str(e)) < 400, str(e)[:400]
                    else:
                        raise AssertionError(f"{name[:20]!r} accepted")

            for name in ["\u0442\u0440\u0435\u043d", "x" * 10_000_000, "", "a b", "a/b"]:
                refused(name, "phase")
            for i in range(32):
                with stepalloc.step(f"p{i}"):
                    pass
            refused("p32", "too many phases (at most 32)")
            with stepalloc.step("p31"):  # a phase already used still begins
                pass
            assert not _lib.initialised(), "a check created the allocator"

            # The same rules once the allocator exists.
            stepalloc.raw_free(stepalloc.raw_alloc(1 << 20))
            refused("\u0442\u0440\u0435\u043d", "phase")
            refused("p32", "too many phases")
            with stepalloc.step("p0"):
                pass
            print("ok")
            """
        )
    )
    assert out.strip() == "ok"


def test_the_phase_bound_is_the_librarys() -> None:
    # steps.MAX_PHASES repeats the library's bound: the library itself takes 32 phases, not 33.
    out = check_child(
        run_python(
            """
            import stepalloc
            from stepalloc import _lib, steps

            stepalloc.configure("backend:sim")
            stepalloc.raw_free(stepalloc.raw_alloc(1 << 20))
            lib = _lib.lib()
            for i in range(steps.MAX_PHASES):
                assert lib.stepalloc_step_begin(f"q{i}".encode()) == _lib.OK, _lib.last_error()
            assert lib.stepalloc_step_begin(b"one_more") == _lib.INVALID_ARGUMENT
            print(_lib.last_error())
            """
        )
    )
    assert "too many phases" in out, out
