"""Many rollouts in flight at once at an agent's `POST /run`, as Gym's rollout collection keeps
them (nemo_gym/rollout_collection.py posts each row to the agent's /run from one aiohttp
session, all of a batch awaited together).

Why aiohttp and not a thread per rollout: 256 to 10,000 rollouts are in flight for seconds each
(the canned upstream's delay, twice or three times per rollout); one event loop holds them all
with one socket each. The session's connector allows `concurrency` connections (aiohttp's
default of 100 would queue the rest inside the client, so the servers would never see them at
once), and RLIMIT_NOFILE is raised to its hard limit, since each rollout holds a socket.

A rollout's body is built when its turn comes (`item(i)` -> (meta, body bytes)), and only a
summary of its answer is kept, so memory grows with `concurrency`, not with `n`, except for
the small result dicts: task and rollout index (in `meta`), HTTP status, `reward`, `start_ns`
and `end_ns` (wall clock, time.time_ns(), around the POST and the reading of its answer), the
verdict Gym parsed from the judge's answer (`verdict`: equivalence_llm_judge's last
`judge_evaluations[].verdict_label`, arena_judge's `verdict_gen_base`; `verdict_swapped`:
arena_judge's `verdict_base_gen`), `failure_kind` (Gym's `judge_failsafe` answers a failed judge
call with reward 0.0 and `failure_kind: judge_failed`, status 200: nemo_gym/judge.py), and
`error` (the start of a non-200 answer, or the exception).

The tests' venv (target/venv) has aiohttp; where the calling Python has not, the same code runs
as a script with the gym venv's Python (which has it, for Gym's servers): the items go to it as
JSON lines in a file, the results come back as JSON lines on stdout.

    python drive.py --url http://127.0.0.1:PORT/run --items ITEMS.jsonl --concurrency C [--timeout S]
"""

import argparse
import asyncio
import json
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path


def raise_nofile():
    """The soft RLIMIT_NOFILE up to the hard one; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def result(meta, status, payload, start_ns, end_ns, error=None):
    """What is kept of one rollout's answer."""
    out = dict(meta)
    out.update(status=status, start_ns=start_ns, end_ns=end_ns, reward=None, verdict=None, verdict_swapped=None,
               failure_kind=None, error=error)
    if isinstance(payload, dict):
        out["reward"] = payload.get("reward")
        out["failure_kind"] = payload.get("failure_kind") or payload.get("_ng_failure_class")
        if "verdict_gen_base" in payload:
            out["verdict"] = payload.get("verdict_gen_base")
            out["verdict_swapped"] = payload.get("verdict_base_gen")
        else:
            evaluations = payload.get("judge_evaluations") or []
            if evaluations and isinstance(evaluations[-1], dict):
                out["verdict"] = evaluations[-1].get("verdict_label")
    return out


async def drive_async(url, item, n, concurrency, timeout=600):
    import aiohttp

    concurrency = max(1, min(concurrency, n)) if n else 1
    raise_nofile()
    results = [None] * n
    semaphore = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:

        async def one(i):
            async with semaphore:
                meta, body = item(i)
                start = time.time_ns()
                try:
                    async with session.post(url, data=body, headers=headers) as response:
                        text = await response.text()
                        end = time.time_ns()
                        if response.status == 200:
                            try:
                                payload = json.loads(text)
                            except ValueError:
                                results[i] = result(meta, 200, None, start, end, f"not JSON: {text[:200]!r}")
                                return
                            results[i] = result(meta, 200, payload, start, end)
                        else:
                            results[i] = result(meta, response.status, None, start, end, text[:500])
                except Exception as e:  # a timeout or a refused or reset connection: say which
                    results[i] = result(meta, None, None, start, time.time_ns(), f"{type(e).__name__}: {e}"[:500])

        await asyncio.gather(*(one(i) for i in range(n)))
    return results


def drive_rollouts(url, item, n, concurrency, timeout=600, gym_python=None):
    """`n` POSTs of `item(i)`'s body to `url`, `concurrency` at once; their results in order.
    In this process if it has aiohttp, else as a script under `gym_python`."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        if gym_python is None:
            raise
        return _drive_in(gym_python, url, item, n, concurrency, timeout)
    return asyncio.run(drive_async(url, item, n, concurrency, timeout))


def _drive_in(python, url, item, n, concurrency, timeout):
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", prefix="rollouts-") as f:
        for i in range(n):
            meta, body = item(i)
            f.write(json.dumps({"meta": meta, "body": json.loads(body)}) + "\n")
        f.flush()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM_"))}
        out = subprocess.run([str(python), str(Path(__file__).resolve()), "--url", url, "--items", f.name,
                              "--concurrency", str(concurrency), "--timeout", str(timeout)],
                             capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"drive.py failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def percentile(values, q):
    """The q-th percentile (0..100) by nearest rank."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[min(len(ordered), int(rank)) - 1]


def summarize(results):
    """Counts and durations (seconds) of a batch of results."""
    durations = [(r["end_ns"] - r["start_ns"]) / 1e9 for r in results if r["start_ns"] and r["end_ns"]]
    statuses, rewards = {}, {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        rewards[str(r["reward"])] = rewards.get(str(r["reward"]), 0) + 1
    starts = [r["start_ns"] for r in results if r["start_ns"]]
    ends = [r["end_ns"] for r in results if r["end_ns"]]
    return {
        "rollouts": len(results),
        "statuses": statuses,
        "rewards": rewards,
        "duration_s": {"min": min(durations, default=None), "p50": percentile(durations, 50),
                       "p90": percentile(durations, 90), "max": max(durations, default=None)},
        "wall_s": (max(ends) - min(starts)) / 1e9 if starts and ends else None,
        "start_spread_s": (max(starts) - min(starts)) / 1e9 if starts else None,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--items", required=True, help='JSON lines {"meta": {...}, "body": {...}}')
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    with open(args.items) as f:
        lines = [line for line in f if line.strip()]

    def item(i):
        entry = json.loads(lines[i])
        return entry["meta"], json.dumps(entry["body"]).encode()

    for r in asyncio.run(drive_async(args.url, item, len(lines), args.concurrency, args.timeout)):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
