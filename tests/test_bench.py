"""`cargo xtask bench` smoke check: the driver runs its shortest form end to end (real servers,
real agent, real wrk) and writes a report with every column; no figure is judged, only that
each request was traced and nothing was lost."""

import json
import shutil
import subprocess
import sys

import pytest

from harness import ROOT, agent_binary

pytestmark = pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (cargo xtask bench installs it)")


def test_quick_bench_writes_a_complete_report(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench.py"), "--agent", str(agent_binary()), "--out-dir", str(tmp_path),
         "--quick", "--only", "verify", "--duration", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verify   gym-tracer" in out.stdout, out.stdout

    report = json.loads((tmp_path / "latest.json").read_text())
    for key in ("machine", "commit", "parameters", "runs", "table", "headline", "text"):
        assert key in report, key
    table = report["table"]
    assert set(table) == {"verify/untraced", "verify/gym-tracer", "verify/tracer-no-ctx", "verify/otel"}
    for row in table.values():
        for column in ("rps", "p50_ms", "p99_ms", "server_cpu_us_per_req", "rps_vs_untraced"):
            assert row[column] > 0, (column, row)
    traced = table["verify/gym-tracer"]
    for column in ("agent_cpu_us_per_req", "agent_peak_rss_kib"):
        assert traced[column] > 0, (column, traced)
    # Every answered request has its SERVER span and none is made up (requests in flight
    # when wrk stops are sent, served and traced, but not answered), and the agent lost and
    # dropped nothing.
    [run] = [r for r in report["runs"] if r["variant"] == "gym-tracer"]
    assert run["requests"] <= run["entry_server_spans"] <= run["sent"], run
    assert run["one_span_per_request"]
    assert traced["events_lost"] == 0 and traced["agent_drops"] == 0, traced
    assert report["headline"]["verify"]["otel_throughput_cost"] is not None
    # The task-context reads priced on their own: one chain per /verify response with them
    # (per request wrk sent: the last ones sent are not all answered), none without.
    cost = report["context_cost"]["verify"]
    assert 0.9 <= cost["context_chains_per_req"] <= 1.05, cost  # + the route harvest's response
    assert table["verify/tracer-no-ctx"]["context_chains_per_req"] == 0, table["verify/tracer-no-ctx"]
