"""What every Gym-shaped test server shares: reading its own entry from the run config the
launcher puts in the environment (as `ng_run` does), and serving under uvicorn (uvloop +
httptools) from `python <server>.py`."""

import os
import re

import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

# Gym's rollout id (nemo_gym/rollout_correlation.py).
ROLLOUT_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def run_config():
    return yaml.safe_load(os.environ["NEMO_GYM_CONFIG_DICT"])


def server_entry(config, name):
    """`name: {<server type>: {<impl name>: {...}}}` -> (server type, that innermost dict)."""
    [(server_type, impls)] = config[name].items()
    [(_, entry)] = impls.items()
    return server_type, entry


def own_entry():
    return server_entry(run_config(), os.environ["NEMO_GYM_CONFIG_PATH"])[1]


def base_url(name):
    entry = server_entry(run_config(), name)[1]
    return f"http://{entry['host']}:{entry['port']}"


def new_app():
    app = FastAPI()  # keeps FastAPI's /openapi.json: the tracer harvests routes from it

    @app.middleware("http")
    async def exception_handling_middleware(request: Request, call_next):
        """Gym's: an exception becomes a JSON 500 and the connection stays open."""
        try:
            return await call_next(request)
        except Exception as error:  # noqa: BLE001
            return JSONResponse(content=repr(error), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def serve(app):
    entry = own_entry()
    uvicorn.run(app, host=entry["host"], port=entry["port"], loop="uvloop", http="httptools",
                access_log=False, log_level="warning")
