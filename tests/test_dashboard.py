"""deploy/grafana/gym-tracer-dashboard.json, checked without a Grafana: it is a dashboard
Grafana imports (unique panel ids, panels on the 24-column grid without overlap, every query
on the templated Prometheus data source), and every series and label it queries is one the
agent really exports, under the name the OpenTelemetry Collector's prometheus exporter
(deploy/collector) gives it. The oracle for the second part is a real run: the real nemo-gym
servers traced through two rollouts (model calls over the canned upstream included), the
metrics the agent printed as JSON lines, renamed by the exporter's rules. A metric renamed in
the agent, a panel on a label the metric does not carry, or a gym.* / gen_ai.* / http.*
metric no panel shows fails here.

The renaming rules are this test's model of the Collector's exporter (its Go translator is not
available on this machine: no Go toolchain, no collector binary in the registries), so the
model is checked against another implementation of the same OpenTelemetry specification, the
Python SDK's Prometheus exporter, fed instruments of the agent's names, units and kinds: every
name must agree, but for the one rule the two implement differently (a gauge of unit "1" gets
`_ratio` from the Collector, github.com/prometheus/otlptranslator, and nothing from Python)."""

import json
import re

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider

import pytest

from harness import ROOT
from real_gym.launch import RealGymRun
from test_real_gym import attached_tracer, gym_venv

DASHBOARD = ROOT / "deploy" / "grafana" / "gym-tracer-dashboard.json"
GRID_COLUMNS = 24
# Labels every series has in Prometheus: the exporter's job/instance (from service.name and
# service.instance.id), and a histogram bucket's bound.
ALWAYS = {"job", "instance", "le"}
# The Collector's unit words (otlptranslator): {annotations} and "1" add none, except a
# gauge's "1", which is a ratio.
UNIT_WORDS = {"s": "seconds", "ms": "milliseconds", "By": "bytes"}


def prometheus_name(metric, unit, kind):
    """The name the Collector's prometheus exporter gives an OTLP metric, with its default
    add_metric_suffixes: non-name characters to `_`, the unit word unless the name already
    ends in it, `_ratio` for a gauge of unit 1, `_total` for a counter."""
    name = re.sub(r"[^a-zA-Z0-9_:]", "_", metric)
    word = "ratio" if unit == "1" and kind == "gauge" else UNIT_WORDS.get(unit)
    if word and not name.endswith(f"_{word}"):
        name += f"_{word}"
    if kind == "sum":
        name += "_total"
    return name


def python_exporter_name(metric, unit, kind):
    """The name the OpenTelemetry Python SDK's Prometheus exporter gives an instrument of this
    name, unit and kind (the agent's sums are counters)."""
    reader = PrometheusMetricReader(disable_target_info=True)
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("naming-check")
    if kind == "sum":
        meter.create_counter(metric, unit=unit).add(1)
    elif kind == "gauge":
        meter.create_gauge(metric, unit=unit).set(1)
    else:
        meter.create_histogram(metric, unit=unit).record(1)
    try:
        [family] = reader._collector.collect()  # noqa: SLF001 - its families, not the global registry's
    finally:
        provider.shutdown()
    # prometheus_client names a counter's family without the _total its samples carry.
    return family.name + ("_total" if family.type == "counter" else "")


def series_of(points):
    """{Prometheus series name: its labels} for the agent's JSON-lines metric points."""
    series = {}
    for point in points:
        kind = point["type"]
        name = prometheus_name(point["metric"], point["unit"], kind)
        labels = {re.sub(r"[^a-zA-Z0-9_]", "_", key) for key in point["attributes"]} | ALWAYS
        names = [f"{name}_bucket", f"{name}_sum", f"{name}_count"] if kind == "histogram" else [name]
        for each in names:
            series.setdefault(each, set()).update(labels)
    return series


def panels(dashboard):
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def queries(dashboard):
    return [(panel["title"], target["expr"]) for panel in panels(dashboard) for target in panel["targets"]]


def selected_series(expr):
    """Metric names in a PromQL expression: identifiers followed by a selector or a range."""
    return set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{|\[)", expr))


def used_labels(expr):
    """Labels grouped by (`by (...)`) or matched (`{label=...}`)."""
    grouped = {label.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", expr) for label in group.split(",")}
    matched = {m for selector in re.findall(r"\{([^}]*)\}", expr)
               for m in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector)}
    return (grouped | matched) - {""}


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    cells = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel.get("description"), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert selected_series(expr), f"{panel['title']}: no series in {expr}"
            # Every variable a query uses is defined (Grafana's own are $__*).
            for variable in re.findall(r"\$(\w+)", expr):
                assert variable.startswith("__") or variable in variables, f"${variable} in {expr}"


def test_dashboard_queries_what_the_agent_exports(tracer):
    run = RealGymRun(gym_venv()).start()
    try:
        agent = attached_tracer(tracer, run.pids)
        for task in range(2):
            assert run.drive_rollout(task, 0)["reward"] == 1.0
    finally:
        run.stop()
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    points = [line for line in agent.lines() if "metric" in line]
    exported = series_of(points)

    # This test's renaming agrees with another implementation of the specification's rules.
    disagree = []
    for metric, unit, kind in sorted({(p["metric"], p["unit"], p["type"]) for p in points}):
        ours, theirs = prometheus_name(metric, unit, kind), python_exporter_name(metric, unit, kind)
        allowed = {theirs, f"{theirs}_ratio"} if kind == "gauge" and unit == "1" else {theirs}
        if ours not in allowed:
            disagree.append(f"{metric} ({kind}, unit {unit!r}): this test says {ours}, the Python exporter {theirs}")
    assert not disagree, "\n".join(disagree)
    dashboard = json.loads(DASHBOARD.read_text())

    problems, shown = [], set()
    for title, expr in queries(dashboard):
        for series in selected_series(expr):
            if series not in exported:
                problems.append(f"{title}: {series} is not exported (exported: {sorted(exported)})")
                continue
            shown.add(series)
            unknown = used_labels(expr) - exported[series]
            if unknown:
                problems.append(f"{title}: {series} has no label {sorted(unknown)} (it has {sorted(exported[series])})")
    assert not problems, "\n".join(problems)

    # Every Gym, GenAI and HTTP metric of the run is on some panel.
    ours = {prometheus_name(p["metric"], p["unit"], p["type"]) for p in points
            if p["metric"].split(".")[0] in ("gym", "gen_ai", "http")}
    assert {"gym_rollout_duration_ms_milliseconds", "gen_ai_client_token_usage",
            "http_server_request_duration_seconds"} <= ours, ours
    missing = {name for name in ours if not any(s == name or s.startswith(f"{name}_") for s in shown)}
    assert not missing, f"no panel shows {sorted(missing)}"


if __name__ == "__main__":
    pytest.main([__file__])
