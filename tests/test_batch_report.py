"""The batch report ([batch-report]), from a real Gym batch: the unmodified nemo-gym servers
of equivalence_llm_judge (its /verify calls an LLM judge through a model server), Gym's
default configuration, telemetry off, ROLLOUTS rollouts posted at once to a canned upstream
that answers after 0.3 s, every 50th call SLOW_EXTRA_S later (a few stragglers), and fails two
calls: one rollout's judge call inside /verify (Gym's judge_failsafe answers /verify 200 with
reward 0.0 and failure_kind judge_failed: a failure only a tracer shows) and another's policy
call (its /run fails).

gym-tracer runs with --report (the page written at exit from what it exported) and its
JSON-lines output on stdout; `gym-tracer report` then makes the page from that output.

Checked:
1. both pages load in headless Chromium with no console error, no uncaught exception and
   nothing fetched; a screenshot is kept under target/report/;
2. the figures the page shows equal the ones this test computes itself: the count of
   rollouts (and the driver's), p50 (nearest rank) and max of the `gym.rollout` spans'
   durations, the slowest rollout's id, the token totals (the canned upstream's own log of
   the usage it answered), succeeded, failed and answered-with-a-failed-call (the driver's
   statuses and Gym's failure_kind); the failure table names the two model servers' 500s and
   the agent's /run 500 with the rollouts they broke, and no other rollout; the slowest
   rollouts listed are the slowest by the spans, linked to --trace-url;
3. the page `run --report` wrote shows the same figures, and the event-loop load it sampled;
4. two hosts' files (the spans split by server, 100 spans in both, half of them `gym.rollout`
   spans, the metric points in both) give the same figures, and the page says the 100 were
   counted once;
5. malformed and foreign lines (a log line, JSON that is not the agent's, a span with a bad
   id, a truncated last line) are counted by reason and named by file and line, on stderr
   and in the page, which still shows the same figures; a missing file is an error naming it;
6. at scale: the batch copied 72 times (18,432 rollouts, ~330k spans; fresh trace, span and
   rollout ids) renders into a page under 5 MB whose figures are the copies' (render time
   printed).

Needs target/gym-venv (`cargo xtask setup`) and Debian's chromium.
"""

import collections
import json
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from browser import render
from harness import ROOT, agent_binary
from real_gym.launch import RealGymRun
from test_real_gym import gym_venv, tree_size
from test_task_lineage import attached_tracer, expected_tree, stop_when_exported

ROLLOUTS = int(os.environ.get("REPORT_ROLLOUTS", "256"))
UPSTREAM_DELAY_S = 0.3
SLOW_EVERY = 50
SLOW_EXTRA_S = 6.0
ENVIRONMENT = "equivalence_llm_judge"
# (task index, rollout index) of the rollouts whose judge call and policy call the upstream fails.
FAILING = {(1, 7): "judge", (2, 9): "policy"}
COPIES = 72
MAX_PAGE_BYTES = 5 << 20
ARTIFACTS = ROOT / "target" / "report"
TRACE_URL = "http://traces.example/trace/{trace_id}"

# What the page shows, read in the browser.
READ_PAGE = """JSON.stringify({
  figures: Object.fromEntries([...document.querySelectorAll('[data-key]')].map(e => [e.dataset.key, e.textContent])),
  failures: [...document.querySelectorAll('tr[data-failure]')].map(r => [...r.cells].map(c => c.textContent)),
  slowest: [...document.querySelectorAll('h3[data-slowest]')].map(h => h.textContent),
  links: [...document.querySelectorAll('h3[data-slowest] + p a')].map(a => a.href),
  skipped: document.getElementById('skipped') ? document.getElementById('skipped').innerText : '',
  charts: document.querySelectorAll('svg').length,
  loopCharts: (() => {
    let n = 0;
    for (let e = document.getElementById('loop-load')?.nextElementSibling; e && e.tagName !== 'H2'; e = e.nextElementSibling)
      n += e.tagName.toLowerCase() === 'svg';
    return n;
  })(),
  resources: performance.getEntriesByType('resource').map(r => r.name),
})"""


def grouped(n):
    return f"{n:,}"


def seconds(ns):
    return f"{ns / 1e9:.3f} s"


def nearest_rank(values, q):
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def report(inputs, output, *extra, check=True):
    """`gym-tracer report INPUTS -o OUTPUT`: (exit status, stderr)."""
    done = subprocess.run([str(agent_binary()), "report", *map(str, inputs), "-o", str(output), *extra],
                          capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr
    return done.returncode, done.stderr


def read_page(path, screenshot):
    """The page as headless Chromium shows it: its figures, tables and what went wrong."""
    page = render(f"file://{path}", ["The batch in numbers"], screenshot, timeout=60, width=1100, height=2400,
                  evaluate=READ_PAGE)
    assert not page.missing, f"{path} did not render: {page.text[:2000]}"
    assert page.errors == [], f"{path}: the console says {page.errors}"
    shown = json.loads(page.value)
    assert shown["resources"] == [], f"{path} fetched {shown['resources']}"
    return shown


def expected_figures(rollout_spans, results, upstream):
    """This test's own account of the batch, as the page prints it."""
    durations = {s["attributes"]["nemo.gym.rollout.id"]: s["end_time_unix_nano"] - s["start_time_unix_nano"]
                 for s in rollout_spans}
    answered = [r["usage"] for r in upstream if r.get("usage")]
    failed = [r for r in results if r["status"] != 200]
    call_failed = [r for r in results if r["status"] == 200 and r["failure_kind"]]
    by_status = collections.Counter(r["status"] for r in failed)
    return {
        "rollouts": str(len(results)),
        "succeeded": str(len(results) - len(failed) - len(call_failed)),
        "call_failed": str(len(call_failed)),
        "failed": f"{len(failed)} (" + ", ".join(f"{n} × /run {s}" for s, n in sorted(by_status.items())) + ")",
        "p50": seconds(nearest_rank(durations.values(), 0.5)),
        "max": seconds(max(durations.values())),
        "slowest": max(durations, key=durations.get),
        "input_tokens": grouped(sum(u["input"] for u in answered)),
        "output_tokens": grouped(sum(u["output"] for u in answered)),
    }


def assert_figures(shown, expected, what):
    got = {key: shown["figures"].get(key) for key in expected}
    assert got == expected, f"{what}: the page shows {got}, the spans say {expected}"


def split_by_host(lines, agent_pid, overlap=50):
    """Two hosts' files: the agent server's spans on one, the other servers' on the other,
    the metric points on both, and `overlap` of the first file's `gym.rollout` spans and as
    many of its other spans on both (so a rollout read twice would count twice)."""
    spans = [line for line in lines if '"span_id"' in line]
    metrics = [line for line in lines if '"metric"' in line]
    first = [line for line in spans if json.loads(line)["resource"].get("process.pid") == agent_pid]
    second = [line for line in spans if json.loads(line)["resource"].get("process.pid") != agent_pid]
    rollouts = [line for line in first if json.loads(line)["name"] == "gym.rollout"]
    others = [line for line in first if json.loads(line)["name"] != "gym.rollout"]
    assert len(rollouts) > overlap and len(others) > overlap and second
    return first + metrics, rollouts[:overlap] + others[:overlap] + second + metrics


def damaged(lines, path):
    """`lines` with four that are not the agent's, and the (line number, reason) of each."""
    span = next(line for line in lines if '"span_id"' in line)
    bad_id = re.sub(r'"span_id":"[0-9a-f]{16}"', '"span_id":"not-hex"', span, count=1)
    out = ["2026-12-05T07:00:00Z INFO gym_tracer: a log line in the wrong place"] + lines[:10] + \
          ['{"level": "info", "message": "some other tool"}', bad_id] + lines[10:] + [span[: len(span) // 2]]
    path.write_text("\n".join(out))  # the last line truncated, no newline
    return [(1, "not JSON"), (12, "not a span or metric point of gym-tracer's"),
            (13, "a span or metric point with a bad field"), (len(out), "not JSON")]


def copies(lines, count):
    """The batch `count` times: every id made new per copy (trace and span ids xor the copy's
    number, the rollout index shifted by 1,000 per copy), the times kept."""
    spans = [line for line in lines if '"span_id"' in line]
    hex_id = re.compile(r'"(trace_id|span_id|parent_span_id)":"([0-9a-f]+)"')
    rollout_id = re.compile(r'"nemo\.gym\.rollout\.id":"(\d+)-(\d+)"')
    for copy in range(count):
        def new_id(match, copy=copy):
            value = match.group(2)
            flipped = int(value, 16) ^ (copy << 8)
            return f'"{match.group(1)}":"{flipped:0{len(value)}x}"'

        def new_rollout(match, copy=copy):
            return f'"nemo.gym.rollout.id":"{match.group(1)}-{int(match.group(2)) + 1000 * copy}"'

        for line in spans:
            yield rollout_id.sub(new_rollout, hex_id.sub(new_id, line))


def test_a_real_gym_batch_makes_a_page_whose_figures_are_the_spans(agents):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    work = ARTIFACTS / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    run_report = work / "run-report.html"
    run = RealGymRun(gym_venv(), environment=ENVIRONMENT, upstream_delay_s=UPSTREAM_DELAY_S)
    run.canned.slow_every, run.canned.slow_extra_s = SLOW_EVERY, SLOW_EXTRA_S
    try:
        run.start()
        agent_pid = run.pids[run.agent]
        tracer = lambda *extra: agents(discover=True, extra_args=extra, metric_interval=2)  # noqa: E731
        agent = attached_tracer(tracer, run, "--report", str(run_report), "--report-trace-url", TRACE_URL)
        results = run.drive_rollouts(ROLLOUTS, fail=lambda task, rollout: FAILING.get((task, rollout)))
        upstream = run.upstream_requests()
        summary_counts = run.upstream_summary()
        spans, _ = stop_when_exported(agent, run, tree_size(expected_tree(run)) * (ROLLOUTS - 1))
        lines = agent.stdout_text().splitlines()
    finally:
        run.stop()

    # The batch: the policy failure's /run failed, the judge failure's was scored 0 by Gym's
    # failsafe, every other rollout answered; the upstream logged every call.
    failing = {f"{task}-{rollout}": kind for (task, rollout), kind in FAILING.items()}
    judge_id, policy_id = sorted(failing, key=failing.get)
    by_id = {f"{r['task_index']}-{r['rollout_index']}": r for r in results}
    statuses = {i: r["status"] for i, r in by_id.items()}
    assert [i for i, s in statuses.items() if s != 200] == [policy_id], statuses
    assert statuses[policy_id] >= 500
    assert (statuses[judge_id], by_id[judge_id]["failure_kind"]) == (200, "judge_failed"), by_id[judge_id]
    assert [i for i, r in by_id.items() if r["failure_kind"]] == [judge_id]
    assert len(upstream) == summary_counts["requests"], "the upstream's log dropped calls"
    assert {r["kind"] for r in upstream} >= {"judge_failed", "policy_failed"}
    slow_calls = sum(1 for r in upstream if r.get("slow"))
    assert slow_calls >= 2, f"only {slow_calls} slow calls: no stragglers to look at"
    rollout_spans = [s for s in spans if s["name"] == "gym.rollout"]
    assert sorted(s["attributes"]["nemo.gym.rollout.id"] for s in rollout_spans) == sorted(statuses)
    expected = expected_figures(rollout_spans, results, upstream)
    durations = sorted(rollout_spans, key=lambda s: s["end_time_unix_nano"] - s["start_time_unix_nano"],
                       reverse=True)

    # (1) and (2): the page of the JSON output.
    output = work / "spans.jsonl"
    output.write_text("\n".join(lines) + "\n")
    page_path = work / "report.html"
    status, stderr = report([output], page_path, "--trace-url", TRACE_URL)
    print(f"\n{stderr.strip()}")
    shown = read_page(page_path, ARTIFACTS / "report.png")
    assert_figures(shown, expected, "report of the JSON output")
    print("figures:", shown["figures"])
    # Rows: server, kind, route, status, requests, rollouts, requests tied to no rollout.
    failed_rows = {(row[1], row[2], row[3], row[5]) for row in shown["failures"]}
    for want in [("SERVER", "/v1/responses", "500", judge_id), ("SERVER", "/v1/responses", "500", policy_id),
                 ("SERVER", "/run", "500", policy_id)]:
        assert want in failed_rows, (want, shown["failures"])
    assert all(set(row[5].split(", ")) <= {judge_id, policy_id, ""} for row in shown["failures"]), \
        f"a failure in a rollout that did not fail: {shown['failures']}"
    want_slowest = [s["attributes"]["nemo.gym.rollout.id"] for s in durations[:10]]
    got_slowest = [heading.split(" ")[1] for heading in shown["slowest"]]
    assert got_slowest == want_slowest, (got_slowest, want_slowest)
    assert shown["links"][0] == TRACE_URL.replace("{trace_id}", durations[0]["trace_id"])
    assert shown["skipped"] == "", shown["skipped"]

    # (3): the page the run wrote at exit: the same figures, and the loop load it sampled.
    assert run_report.exists(), "run --report wrote no page"
    from_run = read_page(run_report, ARTIFACTS / "run-report.png")
    assert_figures(from_run, expected, "run --report")
    assert from_run["loopCharts"] == 1, "run --report drew no event-loop load"
    assert shown["loopCharts"] == 1, "the JSON output's loop-utilization points were not drawn"

    # (4): two hosts' files.
    first, second = work / "host-a.jsonl", work / "host-b.jsonl"
    host_a, host_b = split_by_host(lines, agent_pid)
    first.write_text("\n".join(host_a) + "\n")
    second.write_text("\n".join(host_b) + "\n")
    merged_path = work / "merged.html"
    _, merged_stderr = report([first, second], merged_path)
    merged = read_page(merged_path, work / "merged.png")
    assert_figures(merged, expected, "report of two hosts' files")
    assert "100 spans given more than once" in merged["skipped"], merged["skipped"]
    assert "100 spans given more than once, counted once" in merged_stderr

    # (5): lines that are not the agent's.
    damaged_path = work / "damaged.jsonl"
    bad_lines = damaged(lines, damaged_path)
    damaged_page = work / "damaged.html"
    _, damaged_stderr = report([damaged_path], damaged_page)
    shown_damaged = read_page(damaged_page, work / "damaged.png")
    assert_figures(shown_damaged, expected, "report of damaged input")
    assert "4 lines skipped" in damaged_stderr, damaged_stderr
    for number, reason in bad_lines:
        where = f"{damaged_path}:{number}: {reason}"
        assert where in damaged_stderr, (where, damaged_stderr)
        assert where in shown_damaged["skipped"], (where, shown_damaged["skipped"])
    missing = work / "no-such-file.jsonl"
    status, missing_stderr = report([output, missing], work / "never.html", check=False)
    assert status == 1 and str(missing) in missing_stderr and "No such file" in missing_stderr, missing_stderr
    assert not (work / "never.html").exists()

    # (6): at scale.
    big = work / "big.jsonl"
    with open(big, "w") as out:
        for line in copies(lines, COPIES):
            out.write(line + "\n")
    big_page = work / "big.html"
    started = time.monotonic()
    _, big_stderr = report([big], big_page)
    took = time.monotonic() - started
    size = big_page.stat().st_size
    print(f"{COPIES} copies: {big.stat().st_size / 1e6:.0f} MB of JSON lines, {COPIES * len(rollout_spans)} rollouts, "
          f"{COPIES * len(spans)} spans: page {size / 1e6:.2f} MB in {took:.1f} s ({big_stderr.strip()})")
    assert size < MAX_PAGE_BYTES, f"the page of {COPIES * ROLLOUTS} rollouts is {size} bytes"
    shown_big = read_page(big_page, work / "big.png")
    got = {key: shown_big["figures"][key] for key in ("rollouts", "max", "p50")}
    assert got == {"rollouts": str(COPIES * ROLLOUTS), "max": expected["max"], "p50": expected["p50"]}, got
    tokens = int(expected["input_tokens"].replace(",", ""))
    assert shown_big["figures"]["input_tokens"] == grouped(COPIES * tokens)
    big.unlink()
