"""Work spread over a few daemon threads: results in order, the first error raised once the calls under way end."""

from __future__ import annotations

import threading
from typing import Any, Callable, ContextManager, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def map_on_threads(per_thread: Callable[[], ContextManager[Callable[[T], R]]], items: Sequence[T], at_once: int,
                   name: str) -> list[R]:
    """Each of ``items`` through the function ``per_thread()`` gives each of up to ``at_once`` threads (a context:
    a thread's own buffer is set up and closed around its calls), results in the items' order. No call starts after
    a failure; the first is raised. Daemon threads: one waiting on a hung server never holds the process at its exit,
    as a ThreadPoolExecutor's would (a restore goes on without that server, client/locate.py)."""
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    todo = iter(range(len(items)))
    lock = threading.Lock()

    def failed(exc: BaseException) -> None:
        with lock:
            errors.append(exc)

    def work() -> None:
        try:
            with per_thread() as fn:
                while True:
                    with lock:
                        i = None if errors else next(todo, None)
                    if i is None:
                        return
                    try:
                        results[i] = fn(items[i])
                    except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                        failed(exc)  # before the thread's own clean-up, whose error (if any) comes second
                        return
        except BaseException as exc:  # noqa: BLE001 - the thread's set-up or clean-up
            failed(exc)

    threads = [threading.Thread(target=work, name=f"{name}-{i}", daemon=True)
               for i in range(min(at_once, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
