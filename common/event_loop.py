"""The run's event loop for a user's `async def` functions, entered where one is given: async reward functions
(common/reward_extras.py), async tools, an environment's async methods and its async get_reward
(common/episodes.py). As TRL keeps one (its trainer's `async_loop`), there is one per process, running in a daemon
thread from the first await on: a client one of them keeps between calls (an HTTP session, a judge's connection)
stays on the loop it was made on, and a coroutine that never ends is left there, not waited for at exit."""

import asyncio
import inspect
import threading

_loop, _lock = None, threading.Lock()


def awaited(coroutine, timeout: float | None = None):
    """The coroutine's result, run on the run's loop; past `timeout` seconds (None: no limit) TimeoutError, and the
    coroutine is left running there."""
    global _loop
    with _lock:  # from several threads (tools run in threads of their own): one loop
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, daemon=True, name="async user functions").start()
    return asyncio.run_coroutine_threadsafe(coroutine, _loop).result(timeout)


def resolved(value):
    """What a user's function returned: a coroutine (an `async def`'s) awaited, anything else as it is."""
    return awaited(value) if inspect.iscoroutine(value) else value
