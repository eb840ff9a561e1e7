"""A Gym-shaped resources server (`resources_servers`): a pure-ASGI middleware like Gym's
RolloutContextMiddleware strips `/ng-rollout/<id>` (strict id pattern; a malformed id is not
stripped, so it 404s), then /seed_session, /verify, /close_session, /aggregate_metrics and
GET /reverify_mode.

/verify scores `reward` from the body (default 1.0; 0 is still a success) and raises -> 500
when the body has `"raise": true`.
"""

import re

from fastapi import Request

from servers.gym_common import ROLLOUT_ID, ROLLOUT_ID_PATTERN, RolloutPrefixMiddleware, new_app, serve, traced


class RolloutContextMiddleware(RolloutPrefixMiddleware):
    """Gym's resources middleware: the strict id pattern, so a malformed id is not stripped."""

    PREFIX = re.compile(rf"^/ng-rollout/(?P<rollout_id>{ROLLOUT_ID_PATTERN.pattern.strip('^$')})(?P<rest>/.*)$")


class VerifierCrashed(RuntimeError):
    pass


app = new_app()


@app.post("/seed_session")
async def seed_session(request: Request):
    await request.body()
    return {"rollout_id": ROLLOUT_ID.get()}


@app.post("/verify")
@traced("verify", "gym.verify")
async def verify(request: Request):
    body = await request.json()
    if body.get("raise"):
        raise VerifierCrashed("verifier raised, as asked")
    return {"reward": float(body.get("reward", 1.0)), "rollout_id": ROLLOUT_ID.get()}


@app.post("/close_session")
async def close_session(request: Request):
    await request.body()
    return {"closed": True}


@app.post("/aggregate_metrics")
async def aggregate_metrics(request: Request):
    body = await request.json()
    rewards = [r.get("reward", 0.0) for r in body.get("verify_responses", [])]
    return {"mean_reward": sum(rewards) / len(rewards) if rewards else 0.0}


@app.get("/reverify_mode")
async def reverify_mode():
    return {"reverify": False}


# Routes of the environment's own, as real resources servers add (tools): not in Gym's route
# table, so only the harvested /openapi.json names them.
@app.post("/get_weather")
async def get_weather(request: Request):
    await request.body()
    return {"weather": "sunny"}


@app.get("/items/{item_id}")
async def get_item(item_id: int):
    return {"item": item_id}


app = RolloutContextMiddleware(app)

if __name__ == "__main__":
    serve(app)
