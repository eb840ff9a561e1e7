"""A canned OpenAI-compatible upstream for Gym's `openai_model` server.

`openai_model` forwards `POST /v1/responses` to `{openai_base_url}/responses` and
`POST /v1/chat/completions` to `{openai_base_url}/chat/completions` (aiohttp, Bearer key).
This server answers both with fixed replies shaped for `example_single_tool_call`:

- Responses API, no `function_call_output` in the input yet: one `get_weather` function call
  (the agent then calls the resources server's `/get_weather`);
- Responses API, a `function_call_output` present: a final assistant message (the agent
  then stops and verifies; the verifier rewards the earlier `get_weather` call with 1.0);
- chat completions: a fixed assistant message.

Token usage differs per call, as a function of the call's number n (1-based, its place in the
log): `usage(n)` input 1000 + 7n, output 2000 + 13n. It sits where OpenAI puts it: in a
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
body's top-level `"model"` key, or null) and `body_bytes`, and the usage answered (`{"input",
"output"}`, or null). `GET /_canned/requests` returns that log, and is not in it. The key itself
is never logged. Standard library only.

    python canned_upstream.py --port PORT --api-key KEY [--ready-file PATH]
                              [--tls-cert CERT.pem --tls-key KEY.pem]
"""

import argparse
import json
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MODEL = "canned-model"
CITY = "San Francisco"
ANSWER = f"It is cold in {CITY}."
# Between two events of a streamed answer: each event leaves in its own TLS record and write.
STREAM_EVENT_GAP_S = 0.005


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


def responses_reply(body, n):
    items = body.get("input")
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
    else:
        output = [_message(n)]
    return _response(output, f"resp_canned_{n}", n)


def chat_reply(n):
    return {
        "id": f"chatcmpl-canned-{n}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [{
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": ANSWER},
        }],
        "usage": chat_usage(n),
        "system_fingerprint": None,
    }


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


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api_key = ""
    log = []
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def setup(self):
        # TLS is negotiated here, in the connection's own thread, so a slow or failed
        # handshake holds up no other client.
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()

    def _record(self, raw=b"", body=None, answers_usage=False):
        """Logs this request (with `usage(n)` when `answers_usage`); returns its number n
        (1-based)."""
        body = body if isinstance(body, dict) else {}
        entry = {
            "method": self.command,
            "path": self.path,
            "auth_ok": self.headers.get("Authorization") == f"Bearer {self.api_key}",
            "stream": body.get("stream") is True,
            "model": body.get("model"),
            "model_offset": top_level_keys(raw).get("model") if "model" in body else None,
            "body_bytes": len(raw),
            "usage": None,
        }
        with self.lock:
            n = len(self.log) + 1
            if answers_usage:
                tokens_in, tokens_out = usage(n)
                entry["usage"] = {"input": tokens_in, "output": tokens_out}
            self.log.append(entry)
            return n

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
        for i, (name, data) in enumerate(events):
            if i:
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
            with self.lock:
                return self._send(200, list(self.log))
        n = self._record()
        if self.path.rstrip("/") == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                                "owned_by": "canned"}]})
        self._send(404, {"error": {"message": "not found", "n": n}})

    def do_POST(self):
        raw, body = self._body()
        n = self._record(raw, body, answers_usage=self.path in ("/v1/responses", "/v1/chat/completions"))
        stream = isinstance(body, dict) and body.get("stream") is True
        if self.path == "/v1/responses":
            if stream:
                return self._stream([(name, json.dumps(data)) for name, data in responses_events(n)])
            return self._send(200, responses_reply(body if isinstance(body, dict) else {}, n))
        if self.path == "/v1/chat/completions":
            if stream:
                return self._stream([(None, json.dumps(chunk)) for chunk in chat_chunks(n)] + [(None, "[DONE]")])
            return self._send(200, chat_reply(n))
        self._send(404, {"error": {"message": "not found"}})


class Server(ThreadingHTTPServer):
    daemon_threads = True

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
    args = parser.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    Handler.api_key = args.api_key
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
