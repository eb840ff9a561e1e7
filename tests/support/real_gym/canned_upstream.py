"""A canned OpenAI-compatible upstream for Gym's `openai_model` server.

`openai_model` forwards `POST /v1/responses` to `{openai_base_url}/responses` and
`POST /v1/chat/completions` to `{openai_base_url}/chat/completions` (aiohttp, Bearer key).
This server answers both with fixed replies shaped for `example_single_tool_call`:

- Responses API, no `function_call_output` in the input yet: one `get_weather` function call
  (the agent then calls the resources server's `/get_weather`);
- Responses API, a `function_call_output` present: a final assistant message (the agent
  then stops and verifies; the verifier rewards the earlier `get_weather` call with 1.0);
- chat completions: a fixed assistant message.

It records method, path and whether the `Authorization` header carried the expected key;
`GET /_canned/requests` returns that log (never the key itself). Standard library only.

    python canned_upstream.py --port PORT --api-key KEY [--ready-file PATH]
"""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MODEL = "canned-model"
CITY = "San Francisco"


def _response(output, response_id):
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": MODEL,
        "status": "completed",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": 20,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 10,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 30,
        },
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
        output = [{
            "type": "message",
            "id": f"msg_canned_{n}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": f"It is cold in {CITY}.", "annotations": []}],
        }]
    return _response(output, f"resp_canned_{n}")


def chat_reply(n):
    return {
        "id": f"chatcmpl-canned-{n}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [{
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": f"It is cold in {CITY}."},
        }],
        "usage": {"prompt_tokens": 20, "completion_tokens": 10, "total_tokens": 30},
    }


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api_key = ""
    log = []
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _record(self):
        auth_ok = self.headers.get("Authorization") == f"Bearer {self.api_key}"
        with self.lock:
            self.log.append({"method": self.command, "path": self.path, "auth_ok": auth_ok})
            return len(self.log)

    def _send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw or b"{}")
        except ValueError:
            return {}

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
        body = self._body()
        n = self._record()
        if self.path == "/v1/responses":
            return self._send(200, responses_reply(body, n))
        if self.path == "/v1/chat/completions":
            return self._send(200, chat_reply(n))
        self._send(404, {"error": {"message": "not found"}})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--ready-file")
    args = parser.parse_args()
    Handler.api_key = args.api_key
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    if args.ready_file:
        Path(args.ready_file).write_text("ready\n")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
