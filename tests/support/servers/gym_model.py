"""A Gym-shaped model server (`responses_api_models`) with canned answers: POST
/v1/chat/completions, /v1/responses, /v1/messages, behind a middleware that strips
`/ng-rollout/<id>[/training-token-capture]` like Gym's model capture middleware (any
non-slash id, so even a malformed one is stripped and served)."""

import re

from fastapi import Request

from servers.gym_common import RolloutPrefixMiddleware, new_app, serve, traced

ANSWER = "The answer is 42."


class CapturePrefixMiddleware(RolloutPrefixMiddleware):
    """Gym's model capture middleware: any non-slash id, and `/training-token-capture`."""

    PREFIX = re.compile(r"^/ng-rollout/(?P<rollout_id>[^/]+)(?:/training-token-capture)?(?P<rest>/.*)$")


app = new_app()


@app.post("/v1/chat/completions")
@traced("model_call", "gym.model.chat_completions")
async def chat_completions(request: Request):
    body = await request.json()
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "model": body.get("model", "canned"),
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ANSWER}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
    }


@app.post("/v1/responses")
@traced("model_call", "gym.model.responses")
async def responses(request: Request):
    body = await request.json()
    return {
        "id": "resp_1", "object": "response", "status": "completed", "model": body.get("model", "canned"),
        "output": [{"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                    "content": [{"type": "output_text", "text": ANSWER, "annotations": []}]}],
        "usage": {"input_tokens": 5, "output_tokens": 5, "total_tokens": 10},
    }


@app.post("/v1/messages")
@traced("model_call", "gym.model.messages")
async def messages(request: Request):
    body = await request.json()
    return {
        "id": "msg_1", "type": "message", "role": "assistant", "model": body.get("model", "canned"),
        "content": [{"type": "text", "text": ANSWER}], "stop_reason": "end_turn",
        "usage": {"input_tokens": 5, "output_tokens": 5},
    }


app = CapturePrefixMiddleware(app)

if __name__ == "__main__":
    serve(app)
