"""Resolve a run config the way `ng_run` / `gym env start` does and print it as YAML.

Runs with the gym venv's Python (it imports nemo_gym):

    python make_config.py RUN_CONFIG.yaml --out RESOLVED.yaml [--keep-environment-servers]

RUN_CONFIG holds the server instances (server name -> {server type: {impl name: {...}}})
plus any global keys. It goes through nemo_gym's own GlobalConfigDictParser (no CLI, no
env.yaml), which fills the global keys every server process reads (head_server,
dry_run, uv_*, disallowed_ports, ...), validates the server references and assigns
missing hosts and ports; the result, written to --out, is what Gym puts in
NEMO_GYM_CONFIG_DICT. Stdout gets one JSON object per line for each server Gym would start,
found with the same walk as `RunHelper._start` (nemo_gym/cli/env.py): name, server type,
impl name, the server's folder (resolved like `_resolve_server_dir`), entrypoint, host, port.

nemo-gym 0.7.0 fronts every agent without an environment server with a generated
`legacy_agent` relay (type `environment_servers`, relays /run unchanged). The tests drive
the agent's /run directly, so the generated relays are dropped unless
--keep-environment-servers is given.
"""

import argparse
import json
import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from nemo_gym import _resolve_under_cwd_or_install
from nemo_gym.global_config import (
    NEMO_GYM_RESERVED_TOP_LEVEL_KEYS,
    GlobalConfigDictParser,
    GlobalConfigDictParserConfig,
)


def server_dir(rel_path):
    """nemo_gym.cli.env._resolve_server_dir (that module imports Gym's CLI-only deps)."""
    return _resolve_under_cwd_or_install(
        rel_path, validator=lambda d: (d / "requirements.txt").exists() or (d / "pyproject.toml").exists()
    )


def servers_to_start(config):
    """The walk in RunHelper._start: name -> {type: {impl: {entrypoint, ...}}}."""
    for name in config.keys():
        if name in NEMO_GYM_RESERVED_TOP_LEVEL_KEYS:
            continue
        by_type = config[name]
        if not isinstance(by_type, DictConfig):
            continue
        server_type = list(by_type)[0]
        by_impl = by_type[server_type]
        if not isinstance(by_impl, DictConfig):
            continue
        impl = list(by_impl)[0]
        server = by_impl[impl]
        if not isinstance(server, DictConfig) or "entrypoint" not in server:
            continue
        yield {
            "name": name,
            "type": server_type,
            "impl": impl,
            "dir": str(server_dir(Path(server_type, impl)).absolute()),
            "entrypoint": server.entrypoint,
            "host": server.get("host"),
            "port": server.get("port"),
        }


def main():
    parser = argparse.ArgumentParser(description="Resolve a Gym run config as ng_run does.")
    parser.add_argument("config")
    parser.add_argument("--out", required=True)
    parser.add_argument("--keep-environment-servers", action="store_true")
    args = parser.parse_args()

    # The parser logs a deprecation warning for each generated relay; stdout stays JSON only.
    logging.getLogger("nemo_gym.global_config").setLevel(logging.ERROR)
    initial = OmegaConf.load(args.config)
    declared = set(initial.keys())
    resolved = GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            initial_global_config_dict=initial,
            skip_load_from_cli=True,
            skip_load_from_dotenv=True,
        )
    )
    if not args.keep_environment_servers:
        for key in list(resolved.keys()):
            value = resolved[key]
            if key not in declared and isinstance(value, DictConfig) and "environment_servers" in value:
                del resolved[key]
    Path(args.out).write_text(OmegaConf.to_yaml(resolved))
    for server in servers_to_start(resolved):
        print(json.dumps(server))


if __name__ == "__main__":
    main()
