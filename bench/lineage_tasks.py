"""The cost of the task-lineage uprobe per task created, on a CPython process alone.

An asyncio task creates N child tasks one after the other (`await asyncio.create_task(...)`,
as a handler awaits what it spawns): each creation runs `_asyncio`'s Task.__init__, where the
agent's uprobe traps when --task-lineage probes this process. No I/O: the loop's only work is
creating, running and awaiting the tasks. Prints the process's CPU microseconds per task.

Usage: python lineage_tasks.py N   (asyncio is imported, so `_asyncio` is mapped, before it
waits for a line on stdin, so that an agent attached meanwhile has its probe in place before
the first task)
"""

import asyncio
import sys
import time


async def child():
    return None


async def drive(n):
    start = time.process_time()
    for _ in range(n):
        await asyncio.create_task(child())
    return time.process_time() - start


def main():
    n = int(sys.argv[1])
    sys.stdin.readline()
    cpu = asyncio.run(drive(n))
    print(f"{1e6 * cpu / n:.3f}", flush=True)


if __name__ == "__main__":
    main()
