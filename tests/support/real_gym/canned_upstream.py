"""A canned OpenAI-compatible upstream for Gym's `openai_model` server.

`openai_model` forwards `POST /v1/responses` to `{openai_base_url}/responses` and
`POST /v1/chat/completions` to `{openai_base_url}/chat/completions` (aiohttp, Bearer key).
This server answers both with canned replies, chosen by what the request holds, for
`example_single_tool_call` and for two environments whose `/verify` calls an LLM judge through
a model server (`equivalence_llm_judge`, `arena_judge`). Non-streamed, in this order:

- Responses API, the input's text holds both judge labels (`--judge-labels`, default
  `[[A=B]]` `[[A!=B]]`, equivalence_llm_judge.yaml's `judge_equal_label` and
  `judge_not_equal_label`; its prompt template, prompt_templates/equivalence_llm_judge.txt,
  names both): equivalence_llm_judge's judge call (its app.py `_generate_judge_evaluation`
  posts it to the judge model server's /v1/responses, here `policy_model`). The answer is a
  final message whose text ends with the equal label, or with the not-equal label if the
  judged text holds LOSE (below). The server reads the last label of the last output's last
  text part (`_parse_judge_verdict`) and rewards 1.0 for the equal label, else 0.0.
- Responses API, no `tools` in the request (equivalence_llm_judge's and arena_judge's rows
  have none): a final assistant message, POLICY_ANSWER, with " " + LOSE appended when the
  request's input holds LOSE (the policy "repeats" it, so every judge of the answer sees it).
- Responses API with tools, no `function_call_output` in the input yet: one `get_weather`
  function call (the agent then calls the resources server's `/get_weather`);
- Responses API with tools, a `function_call_output` present: a final assistant message (the
  agent then stops and verifies; example_single_tool_call rewards the earlier `get_weather`
  call with 1.0);
- chat completions whose messages hold arena-hard's answer slots ("<|The Start of Assistant
  A's Answer|>" and B's, prompts/arena.yaml, arena_creative.yaml): arena_judge's judge call
  (its app.py `_judge_once`, two at once per rollout under `asyncio.gather`: A=candidate,
  B=baseline, then swapped). The candidate is the slot whose answer starts with
  POLICY_ANSWER (else slot A). Unless the messages hold LOSE, the verdict favours the
  candidate: `[[A>B]]` when it is A, `[[B>A]]` when it is B; with LOSE, the other way round.
  `_parse_verdict` takes the one label; the reward is 1.0 iff the A=candidate call says A>>B
  or A>B, so: 1.0 without LOSE, 0.0 with it;
- chat completions with tools (what `vllm_model` and `azure_openai_model` make of a Responses
  API call with tools): one `get_weather` tool call while no `tool` message is in the
  messages, then a final assistant message, as for the Responses API above;
- any other chat completion: a fixed assistant message.

Azure OpenAI's paths (`/openai/deployments/<model>/chat/completions?api-version=...`, what
`azure_openai_model`'s `AsyncAzureOpenAI` client calls, its key in an `api-key` header) are
answered as `/v1/chat/completions`.

The verdict rule, for a test to reproduce from the rollout body it sent: a rollout is judged
"lose" (reward 0.0) iff LOSE (`[canned-judge:lose]`) is in a text its judge is sent. Put it in
the rollout's prompt (any message of `responses_create_params.input`, e.g. `prompt_suffix` or
`RealGymRun.rollout_body(lose=True)`): equivalence_llm_judge sends the judge the last user
message and the policy's answer, arena_judge sends the policy's answer, which repeats it. A
row's `expected_answer` (equivalence) or `question` / `baseline_answer` (arena) reach the judge
too. Without LOSE: reward 1.0.

Failures, with no usage, for a test to put in one rollout's prompt (`RealGymRun.rollout_body(
fail="judge" | "policy")`): a judge call whose judged text holds FAIL_JUDGE
(`[canned-judge:fail]`; the policy repeats it, as LOSE) is answered 500 (log kind
`judge_failed`): the judge model server fails, and Gym's `judge_failsafe` makes the rollout's
`/verify` answer 200 with reward 0.0 and failure_kind `judge_failed`. A policy call (no judge
labels) whose input holds FAIL_POLICY (`[canned-policy:fail]`) is answered 500 (kind
`policy_failed`): the agent's `/run` fails.

`--delay-s S` sleeps S seconds before answering every request (streamed or not, any path, but
not `/_canned/*`), as a model that takes its time, in the connection's thread: requests on other
connections are not held up. `--slow-every N --slow-extra-s E` makes every Nth request (by its
number n, below) wait E seconds more: a straggling model call (its log entry says `slow`). The
listen backlog is 4096 (socketserver's default of 5 makes a
burst of connects stall in SYN retries of 1, 3, 7, 15 s); one thread per connection.

Token usage differs per call, as a function of the call's number n (1-based, its place in the
order of arrival, which is the log's while it has not dropped any): `usage(n)` input 1000 + 7n,
output 2000 + 13n. It sits where OpenAI puts it: in a
Responses API object after the other fields (then `user`, `metadata`), in a chat completion
after `choices`.

A POST whose body says `"stream": true` is answered as OpenAI streams (server-sent events,
HTTP/1.1 chunked, one chunk per event): for /v1/responses `response.created`, ...,
`response.output_text.delta` events, ..., `response.completed` with the whole response (and
its usage); for /v1/chat/completions `data: {chunk}` deltas, a chunk with `"choices": []` and
the usage (as with `stream_options.include_usage`), then `data: [DONE]`. A streamed Responses
API answer is always the final assistant message.

Over HTTPS with `--tls-cert`/`--tls-key` (PEM), plain HTTP without.

Each request is logged: method, path, auth_ok (the `Authorization` header carried the
expected key), stream, the `model` its body asked for, `model_offset` (the byte offset of the
body's top-level `"model"` key, or null) and `body_bytes`, the usage answered (`{"input",
"output"}`, or null), `kind` (`policy`, `tool_call`, `judge` or null: which rule above
answered), `verdict` (a judge's label, e.g. `[[A=B]]`, `[[B>A]]`, else null) and `t_ns` (its
arrival, wall clock). `GET /_canned/requests` returns that log, and is not in it; it keeps the
last `--log-max` entries (default 20,000, under 1 KB each), while the call number n goes on
counting. `GET /_canned/summary` returns counts over every request: {"requests": n so far,
"logged": entries kept, "counts": {"METHOD PATH KIND": count}, "verdicts": {label: count},
"peak_in_flight": {"METHOD PATH KIND": most answered at once}, "auth_failed": requests to
/v1/... without the expected key}. The key itself is never logged, nor any prompt. Standard
library only.

    python canned_upstream.py --port PORT --api-key KEY [--ready-file PATH]
                              [--tls-cert CERT.pem --tls-key KEY.pem] [--delay-s S]
                              [--judge-labels EQUAL NOT_EQUAL] [--log-max N]
"""

import argparse
import collections
import json
import re
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MODEL = "canned-model"
CITY = "San Francisco"
ANSWER = f"It is cold in {CITY}."
# Before each event of a streamed answer (the first too, so that no event leaves with the
# head): each event leaves in its own TLS record and write.
STREAM_EVENT_GAP_S = 0.005

# The verdict marker: a judged text holding it is judged against the policy's answer.
LOSE = "[canned-judge:lose]"
# The failure markers: a judge call about a text holding the first, a policy call whose input
# holds the second, are answered 500.
FAIL_JUDGE = "[canned-judge:fail]"
FAIL_POLICY = "[canned-policy:fail]"
# The policy's answer where no tool is offered: a plausible final answer (boxed, as
# equivalence_llm_judge's prompts ask).
POLICY_ANSWER = "Here is my answer, reasoned step by step: the final answer is \\boxed{42}."
JUDGE_LABELS = ("[[A=B]]", "[[A!=B]]")
# arena-hard's answer slots (resources_servers/arena_judge/prompts/arena.yaml).
ARENA_SLOT = re.compile(
    r"<\|The Start of Assistant (A|B)'s Answer\|>\n?(.*?)\n?<\|The End of Assistant \1's Answer\|>", re.DOTALL)
# Azure OpenAI's chat completions path (the openai SDK's AzureOpenAI, a deployment per model).
AZURE_CHAT = re.compile(r"/openai/deployments/[^/]+/chat/completions")
# The listen backlog: net.core.somaxconn here, so a burst of 1,000+ connects is queued, not
# dropped into SYN retries.
LISTEN_BACKLOG = 4096


def usage(n):
    """The (input, output) tokens of call n."""
    return 1000 + 7 * n, 2000 + 13 * n


def responses_usage(n):
    tokens_in, tokens_out = usage(n)
    return {
        "input_tokens": tokens_in,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": tokens_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": tokens_in + tokens_out,
    }


def chat_usage(n):
    tokens_in, tokens_out = usage(n)
    return {"prompt_tokens": tokens_in, "completion_tokens": tokens_out, "total_tokens": tokens_in + tokens_out}


def _response(output, response_id, n, status="completed", with_usage=True):
    """A Responses API object, its fields in the order OpenAI sends them."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": MODEL,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": True,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": responses_usage(n) if with_usage else None,
        "user": None,
        "metadata": {},
    }


def _message(n, text=ANSWER, status="completed"):
    return {
        "type": "message",
        "id": f"msg_canned_{n}",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}] if text is not None else [],
    }


def _texts(value):
    """Every string inside a request's input or messages, in order (content strings, text
    parts), as one text: what a judge was given to read."""
    out = []

    def walk(v):
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, list):
            for item in v:
                walk(item)
        elif isinstance(v, dict):
            for key in ("content", "text", "output"):
                if key in v:
                    walk(v[key])

    walk(value)
    return "\n".join(out)


def equivalence_verdict(text, labels=JUDGE_LABELS):
    """The judge's verdict text: the equal label, or the not-equal one if `text` holds LOSE."""
    equal, not_equal = labels
    if LOSE in text:
        return not_equal, f"The candidate does not match the GOLD reference.\n\n{not_equal} they are not equivalent"
    return equal, f"The candidate states the same answer as the GOLD reference.\n\n{equal} they are equivalent"


def arena_verdict(text):
    """arena_judge's verdict for one side-ordering: favour the candidate's slot (the answer
    that starts with POLICY_ANSWER, else A), or the other slot if `text` holds LOSE."""
    slots = {slot: answer.strip() for slot, answer in ARENA_SLOT.findall(text)}
    candidate = "B" if slots.get("B", "").startswith(POLICY_ANSWER) and not slots.get("A", "").startswith(
        POLICY_ANSWER) else "A"
    winner = candidate if LOSE not in text else ("B" if candidate == "A" else "A")
    label = "[[A>B]]" if winner == "A" else "[[B>A]]"
    return label, (f"My own answer agrees with Assistant {winner}'s, which is correct and concise.\n\n"
                   f"My final verdict is: {label}")


def is_arena_judge(text):
    return "<|The Start of Assistant A's Answer|>" in text and "<|The Start of Assistant B's Answer|>" in text


def responses_reply(body, n, labels=JUDGE_LABELS):
    """(the Responses API answer, kind, verdict label or None)."""
    items = body.get("input")
    text = _texts(items)
    if all(label in text for label in labels):
        if FAIL_JUDGE in text:
            return None, "judge_failed", None
        label, verdict = equivalence_verdict(text, labels)
        return _response([_message(n, verdict)], f"resp_canned_{n}", n), "judge", label
    if FAIL_POLICY in text:
        return None, "policy_failed", None
    if not body.get("tools"):
        answer = POLICY_ANSWER + "".join(" " + marker for marker in (LOSE, FAIL_JUDGE) if marker in text)
        return _response([_message(n, answer)], f"resp_canned_{n}", n), "policy", None
    answered = isinstance(items, list) and any(
        isinstance(item, dict) and item.get("type") == "function_call_output" for item in items
    )
    if not answered:
        output = [{
            "type": "function_call",
            "id": f"fc_canned_{n}",
            "call_id": f"call_canned_{n}",
            "name": "get_weather",
            "arguments": json.dumps({"city": CITY}),
            "status": "completed",
        }]
        return _response(output, f"resp_canned_{n}", n), "tool_call", None
    return _response([_message(n)], f"resp_canned_{n}", n), "policy", None


def chat_reply(n, content=ANSWER):
    return {
        "id": f"chatcmpl-canned-{n}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [{
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": content},
        }],
        "usage": chat_usage(n),
        "system_fingerprint": None,
    }


def chat_tool_call(n):
    """A chat completion that calls `get_weather`, as vLLM's OpenAI server answers one."""
    reply = chat_reply(n)
    reply["choices"][0]["finish_reason"] = "tool_calls"
    reply["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [{
        "id": f"call_canned_{n}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": CITY})},
    }]}
    return reply


def chat_answer(body, n):
    """(the chat completion, kind, verdict label or None)."""
    messages = body.get("messages")
    text = _texts(messages)
    if is_arena_judge(text):
        label, verdict = arena_verdict(text)
        return chat_reply(n, verdict), "judge", label
    if body.get("tools"):
        answered = isinstance(messages, list) and any(
            isinstance(m, dict) and m.get("role") == "tool" for m in messages)
        if not answered:
            return chat_tool_call(n), "tool_call", None
        return chat_reply(n), "policy", None
    return chat_reply(n), None, None


def _pieces(text):
    """The answer as a model streams it: a word (and its space) at a time."""
    words = text.split(" ")
    return [word + (" " if i < len(words) - 1 else "") for i, word in enumerate(words)]


def responses_events(n):
    """A streamed Responses API answer: (event name, data) in OpenAI's order."""
    response_id, item_id = f"resp_canned_{n}", f"msg_canned_{n}"
    events = [
        ("response.created", {"response": _response([], response_id, n, "in_progress", with_usage=False)}),
        ("response.in_progress", {"response": _response([], response_id, n, "in_progress", with_usage=False)}),
        ("response.output_item.added", {"output_index": 0, "item": _message(n, None, "in_progress")}),
        ("response.content_part.added", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                         "part": {"type": "output_text", "annotations": [], "text": ""}}),
    ]
    for piece in _pieces(ANSWER):
        events.append(("response.output_text.delta", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                                      "delta": piece, "logprobs": []}))
    events += [
        ("response.output_text.done", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                       "text": ANSWER, "logprobs": []}),
        ("response.content_part.done", {"item_id": item_id, "output_index": 0, "content_index": 0,
                                        "part": {"type": "output_text", "annotations": [], "text": ANSWER}}),
        ("response.output_item.done", {"output_index": 0, "item": _message(n)}),
        ("response.completed", {"response": _response([_message(n)], response_id, n)}),
    ]
    return [(name, {"type": name, "sequence_number": i, **data}) for i, (name, data) in enumerate(events)]


def chat_chunks(n):
    """A streamed chat completion: its chunks, the usage chunk last."""
    created = int(time.time())

    def chunk(choices, **extra):
        return {"id": f"chatcmpl-canned-{n}", "object": "chat.completion.chunk", "created": created,
                "model": MODEL, "system_fingerprint": None, "choices": choices, "usage": None, **extra}

    chunks = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]
    chunks += [chunk([{"index": 0, "delta": {"content": piece}, "finish_reason": None}]) for piece in _pieces(ANSWER)]
    chunks.append(chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    chunks.append(chunk([], usage=chat_usage(n)))
    return chunks


def top_level_keys(raw):
    """The byte offset of each top-level key of a JSON object body (first occurrence)."""
    text = raw.decode("utf-8", errors="replace")
    if not text.isascii():
        return {}  # offsets in characters would not be byte offsets; the canned bodies are ASCII
    decoder, offsets = json.JSONDecoder(), {}

    def skip(i):
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        return i

    try:
        i = skip(0)
        if text[i] != "{":
            return {}
        i = skip(i + 1)
        while text[i] != "}":
            key, end = decoder.raw_decode(text, i)
            offsets.setdefault(key, i)
            i = skip(end)
            assert text[i] == ":"
            _, i = decoder.raw_decode(text, skip(i + 1))
            i = skip(i)
            if text[i] == ",":
                i = skip(i + 1)
    except (AssertionError, IndexError, ValueError):
        pass
    return offsets


class Log:
    """The request log: the last `maxlen` entries, the call count, counts over every request,
    and how many of each were being answered at once (at most)."""

    def __init__(self, maxlen=20_000):
        self.entries = collections.deque(maxlen=maxlen)
        self.count = 0
        self.counts = collections.Counter()
        self.verdicts = collections.Counter()
        self.in_flight = collections.Counter()
        self.peak = collections.Counter()
        self.auth_failed = 0
        self.lock = threading.Lock()

    def add(self, entry, answers_usage):
        """Appends `entry` (with `usage(n)` when `answers_usage`); returns its number n."""
        with self.lock:
            self.count += 1
            n = self.count
            entry["n"] = n
            self.auth_failed += not entry["auth_ok"] and entry["path"].startswith("/v1/")
            if answers_usage:
                tokens_in, tokens_out = usage(n)
                entry["usage"] = {"input": tokens_in, "output": tokens_out}
            self.entries.append(entry)
            return n

    @staticmethod
    def key(entry):
        return f"{entry['method']} {entry['path']} {entry['kind']}"

    def settle(self, entry, kind, verdict):
        """Says which rule answers `entry` (logged already, so n was its arrival's); it is
        being answered until `finish`."""
        with self.lock:
            entry["kind"], entry["verdict"] = kind, verdict
            key = self.key(entry)
            self.counts[key] += 1
            if verdict:
                self.verdicts[verdict] += 1
            self.in_flight[key] += 1
            self.peak[key] = max(self.peak[key], self.in_flight[key])

    def finish(self, entry):
        with self.lock:
            self.in_flight[self.key(entry)] -= 1

    def snapshot(self):
        with self.lock:
            return list(self.entries)

    def summary(self):
        with self.lock:
            return {"requests": self.count, "logged": len(self.entries), "counts": dict(self.counts),
                    "verdicts": dict(self.verdicts), "peak_in_flight": dict(self.peak),
                    "auth_failed": self.auth_failed}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api_key = ""
    log = Log()
    delay_s = 0.0
    slow_every = 0
    slow_extra_s = 0.0
    judge_labels = JUDGE_LABELS

    def log_message(self, *args):
        pass

    def setup(self):
        # TLS is negotiated here, in the connection's own thread, so a slow or failed
        # handshake holds up no other client.
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()

    def _record(self, raw=b"", body=None, answers_usage=False):
        """Logs this request (with `usage(n)` when `answers_usage`); returns (its number n
        (1-based), its log entry)."""
        body = body if isinstance(body, dict) else {}
        entry = {
            "method": self.command,
            "path": self.path,
            "auth_ok": (self.headers.get("Authorization") == f"Bearer {self.api_key}"
                        or self.headers.get("api-key") == self.api_key),
            "stream": body.get("stream") is True,
            "model": body.get("model"),
            "model_offset": top_level_keys(raw).get("model") if "model" in body else None,
            "body_bytes": len(raw),
            "usage": None,
            "kind": None,
            "verdict": None,
            "t_ns": time.time_ns(),
        }
        return self.log.add(entry, answers_usage), entry

    def _answer(self, entry, kind=None, verdict=None):
        """Settles `entry`, then waits the configured delay before the answer goes out."""
        self.log.settle(entry, kind, verdict)
        self._answering = entry
        slow = self.slow_every > 0 and entry.get("n", 0) % self.slow_every == 0
        entry["slow"] = slow
        delay = self.delay_s + (self.slow_extra_s if slow else 0.0)
        if delay > 0:
            time.sleep(delay)

    def handle_one_request(self):
        self._answering = None
        try:
            super().handle_one_request()
        finally:
            if self._answering is not None:
                self.log.finish(self._answering)

    def _send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events):
        """Server-sent events, one HTTP/1.1 chunk each: `events` are (event name or None, data
        text)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for name, data in events:
            time.sleep(STREAM_EVENT_GAP_S)
            event = (f"event: {name}\n" if name else "") + f"data: {data}\n\n"
            payload = event.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
        self.wfile.write(b"0\r\n\r\n")

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return raw, json.loads(raw or b"{}")
        except ValueError:
            return raw, {}

    def do_GET(self):
        if self.path == "/_canned/requests":
            return self._send(200, self.log.snapshot())
        if self.path == "/_canned/summary":
            return self._send(200, self.log.summary())
        n, entry = self._record()
        self._answer(entry)
        if self.path.rstrip("/") == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                                "owned_by": "canned"}]})
        self._send(404, {"error": {"message": "not found", "n": n}})

    def _route(self):
        """The path answered: Azure OpenAI's deployment paths are chat completions."""
        path = self.path.split("?", 1)[0]
        if AZURE_CHAT.fullmatch(path):
            return "/v1/chat/completions"
        return self.path

    def do_POST(self):
        raw, body = self._body()
        route = self._route()
        n, entry = self._record(raw, body, answers_usage=route in ("/v1/responses", "/v1/chat/completions"))
        stream = isinstance(body, dict) and body.get("stream") is True
        body = body if isinstance(body, dict) else {}
        if route == "/v1/responses":
            if stream:
                self._answer(entry, "policy")
                return self._stream([(name, json.dumps(data)) for name, data in responses_events(n)])
            reply, kind, verdict = responses_reply(body, n, self.judge_labels)
            if reply is None:
                entry["usage"] = None
                self._answer(entry, kind, verdict)
                return self._send(500, {"error": {"message": f"the canned upstream fails this call ({kind})", "n": n}})
            self._answer(entry, kind, verdict)
            return self._send(200, reply)
        if route == "/v1/chat/completions":
            if stream:
                self._answer(entry)
                return self._stream([(None, json.dumps(chunk)) for chunk in chat_chunks(n)] + [(None, "[DONE]")])
            reply, kind, verdict = chat_answer(body, n)
            self._answer(entry, kind, verdict)
            return self._send(200, reply)
        self._answer(entry)
        self._send(404, {"error": {"message": "not found"}})


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def handle_error(self, request, client_address):
        pass  # a client that hung up, or failed the TLS handshake


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--ready-file")
    parser.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    parser.add_argument("--delay-s", type=float, default=0.0, help="wait this long before every answer")
    parser.add_argument("--slow-every", type=int, default=0, help="every Nth request waits --slow-extra-s more")
    parser.add_argument("--slow-extra-s", type=float, default=0.0)
    parser.add_argument("--judge-labels", nargs=2, metavar=("EQUAL", "NOT_EQUAL"), default=list(JUDGE_LABELS),
                        help="equivalence_llm_judge's judge_equal_label and judge_not_equal_label")
    parser.add_argument("--log-max", type=int, default=20_000, help="keep the last N requests in the log")
    args = parser.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    Handler.api_key = args.api_key
    Handler.delay_s = max(0.0, args.delay_s)
    Handler.slow_every = max(0, args.slow_every)
    Handler.slow_extra_s = max(0.0, args.slow_extra_s)
    Handler.judge_labels = tuple(args.judge_labels)
    Handler.log = Log(args.log_max)
    # One thread per connection; a small stack keeps thousands of them cheap (the handlers
    # recurse no deeper than json does on these small bodies).
    threading.stack_size(2 << 20)
    server = Server((args.host, args.port), Handler)
    if args.tls_cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.tls_cert, args.tls_key)
        server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    if args.ready_file:
        Path(args.ready_file).write_text("ready\n")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
