"""A Gym-shaped agent server (`responses_api_agents`).

POST /run: one rollout. The rollout id is computed from the body as Gym's
maybe_rollout_id_from_run_body does (a malformed `_ng_rollout_id` raises -> 500); then the
model server's `<prefix>/v1/responses` and the resources server's `<prefix>/verify` are called
through ONE shared aiohttp ClientSession, with prefix `/ng-rollout/<id>` (none without an id).
The verify request is the run body plus the model's response, as in Gym; a failing verify
fails the run (500).
POST /v1/responses, /ng-rollout/{rollout_id}/v1/responses and
/ng-rollout/{rollout_id}/training-token-capture/v1/responses: forwarded to the model server
under the same prefix. POST /aggregate_metrics.
"""

import aiohttp
from fastapi import Request

from servers.gym_common import (ROLLOUT_ID_PATTERN, SECRET_HEADERS, base_url, client_span, new_app, own_entry, serve,
                                traced)

CONFIG = own_entry()
MODEL_URL = base_url(CONFIG["model_server"]["name"])
RESOURCES_URL = base_url(CONFIG["resources_server"]["name"])
_session = None


def client():
    """Gym's global aiohttp client: one session, one connection pool, for every call."""
    global _session
    if _session is None:
        _session = aiohttp.ClientSession()
    return _session


async def post(url, payload):
    with client_span("POST", url) as call:  # Gym's CLIENT span, in the in-process OTel mode only
        response = await client().post(url, json=payload, headers={**SECRET_HEADERS, **(call.headers or {})})
        call.status(response.status)
    async with response:
        response.raise_for_status()
        return await response.json()


def rollout_id_from_run_body(body):
    explicit = body.get("_ng_rollout_id")
    if explicit is not None:
        if not (isinstance(explicit, str) and ROLLOUT_ID_PATTERN.match(explicit)):
            raise ValueError(f"_ng_rollout_id must match {ROLLOUT_ID_PATTERN.pattern}")
        rollout_id = explicit
    else:
        task, rollout = body.get("_ng_task_index"), body.get("_ng_rollout_index")
        if task is None or rollout is None:
            return None
        rollout_id = f"{task}-{rollout}"
    attempt = body.get("_ng_attempt_index")
    if attempt is not None and int(attempt) > 0:
        rollout_id = f"{rollout_id}-a{int(attempt)}"
    return rollout_id


app = new_app()


@app.post("/run")
@traced("rollout", "gym.rollout", rollout_id_from_body=rollout_id_from_run_body)
async def run(request: Request):
    body = await request.json()
    rollout_id = rollout_id_from_run_body(body)
    prefix = f"/ng-rollout/{rollout_id}" if rollout_id else ""
    response = await post(f"{MODEL_URL}{prefix}/v1/responses", body["responses_create_params"])
    verified = await post(f"{RESOURCES_URL}{prefix}/verify", {**body, "response": response})
    return {"reward": verified["reward"], "rollout_id": rollout_id}


@app.post("/v1/responses")
@app.post("/ng-rollout/{rollout_id}/v1/responses")
@app.post("/ng-rollout/{rollout_id}/training-token-capture/v1/responses")
@traced("agent", "gym.agent.responses")
async def responses(request: Request):
    prefix = request.url.path.removesuffix("/v1/responses")
    return await post(f"{MODEL_URL}{prefix}/v1/responses", await request.json())


@app.post("/aggregate_metrics")
async def aggregate_metrics(request: Request):
    body = await request.json()
    rewards = [r.get("reward", 0.0) for r in body.get("verify_responses", [])]
    return {"mean_reward": sum(rewards) / len(rewards) if rewards else 0.0}


if __name__ == "__main__":
    serve(app)
