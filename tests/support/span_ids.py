"""How the tests key spans, and the run-wide check that keying is sound: a span id names a span
only within its trace (a parent edge joins two spans of one trace), and no two exported spans
of a run may share a span id at all, or a checker keyed by id would silently merge them.

Its own module: harness uses it too, and cannot import gym_expect (which imports gym_launch,
which imports harness); gym_expect re-exports it for the checkers."""

import collections
import json


def span_key(span):
    """(trace id, span id): what names a span, for every checker."""
    return span["trace_id"], span["span_id"]


def parent_key(span):
    """(trace id, parent span id), the key its parent has if it is among the spans; None for a
    root (no parent id: "" in the JSON lines and from the OTLP receiver)."""
    parent = span.get("parent_span_id")
    if not parent or not parent.strip("0"):
        return None
    return span["trace_id"], parent


def spans_by_key(spans):
    """Each span by span_key: two spans sharing an id in different traces stay apart."""
    return {span_key(span): span for span in spans}


def children_by_parent(spans):
    """The spans under each parent, by its span_key; the roots under None."""
    children = collections.defaultdict(list)
    for span in spans:
        children[parent_key(span)].append(span)
    return children


def _describe(span):
    return f"{span['kind']} {span['name']} (trace {span['trace_id']})"


def shared_span_ids(spans):
    """The span ids two different spans carry, as lines naming them; [] if every id is unique.
    A span delivered twice with identical content (as a retried OTLP export can deliver it) is
    one span."""
    by_id = collections.defaultdict(dict)
    for span in spans:
        by_id[span["span_id"]].setdefault(json.dumps(span, sort_keys=True, default=repr), span)
    problems = []
    for span_id, distinct in by_id.items():
        if len(distinct) > 1:
            first, second, *more = distinct.values()
            problems.append(f"span id {span_id}: {_describe(first)} and {_describe(second)}"
                            + (f", and {len(more)} more" if more else ""))
    return problems
