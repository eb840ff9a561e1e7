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
--keep-environment-servers is given; so are the environment servers a `config_paths` file
declares (an environment's own config, e.g. `<env>_environment_server`), which are not keys
of RUN_CONFIG itself.

An environment from the package is named the way `ng_run` is given one: RUN_CONFIG's
`config_paths` lists the environment's config file (resources_servers/<env>/configs/<env>.yaml)
and the policy model's (responses_api_models/openai_model/configs/openai_model.yaml, whose
`${policy_base_url}`, `${policy_api_key}`, `${policy_model_name}` RUN_CONFIG sets), and the
parser merges them. Their server names are then only known once merged, so RUN_CONFIG may carry
a private key `_real_gym` (removed before parsing) saying what to set on each of them:

    _real_gym:
      ports: [P, ...]              # handed out, in the parser's server order, to every server
      hosts: {NAME: ADDRESS}       # a server's `host` (default: the parser's, 127.0.0.1)
      model_upstream: {IMPL: {openai_base_url: ..., openai_api_key: ..., openai_model: ...}}
                                   # set on every responses_api_models server of implementation
                                   # IMPL, whatever its config says (arena_judge's judge model
                                   # reads ARENA_JUDGE_* environment variables, falling back to
                                   # "MISSING"); a model server of another implementation is an
                                   # error

The config is parsed once offline (GlobalConfigDictParserConfig.offline: no port probing) to
learn the servers, then again with those values as RUN_CONFIG keys, so they are merged over
the files' as a user's command-line overrides are. Each stdout line then also has `refs`
(the server's `{type, name}` references, e.g. an agent's `resources_server` and
`model_server`, a resources server's `judge_model_server`), `labels` (its string settings
whose key ends in `_label`, e.g. equivalence_llm_judge's `judge_equal_label`) and `datasets`
(an agent's `datasets`: name, type, jsonl_fpath).
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


def server_facts(config, name, server_type, impl):
    """What the launcher needs to know of a server besides where it runs (never its secrets):
    its references to other servers, its `*_label` strings and, for an agent, its datasets."""
    server = config[name][server_type][impl]
    refs, labels, datasets = {}, {}, []
    for key in server.keys():
        try:
            value = server[key]
        except Exception:  # an interpolation only the server's own environment resolves
            continue
        if isinstance(value, DictConfig) and set(value.keys()) >= {"type", "name"}:
            refs[key] = {"type": str(value.type), "name": str(value.name)}
        elif key.endswith("_label") and isinstance(value, str):
            labels[key] = value
    for dataset in server.get("datasets") or []:
        if isinstance(dataset, DictConfig):
            datasets.append({k: dataset.get(k) for k in ("name", "type", "jsonl_fpath")})
    return {"refs": refs, "labels": labels, "datasets": datasets}


def parse(initial, offline=False):
    return GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            initial_global_config_dict=OmegaConf.create(OmegaConf.to_container(initial)),
            skip_load_from_cli=True,
            skip_load_from_dotenv=True,
            offline=offline,
        )
    )


def with_server_settings(initial, settings):
    """RUN_CONFIG plus the `_real_gym` settings on each server the merged config has."""
    ports = list(settings.get("ports") or [])
    hosts = dict(settings.get("hosts") or {})
    upstream = dict(settings.get("model_upstream") or {})
    probe = parse(initial, offline=True)
    overrides = {}
    for server in servers_to_start(probe):
        if server["type"] == "environment_servers":
            continue
        values = {}
        if ports:
            values["port"] = ports.pop(0)
        if server["name"] in hosts:
            values["host"] = hosts.pop(server["name"])
        if server["type"] == "responses_api_models" and upstream:
            if server["impl"] not in upstream:
                raise SystemExit(f"model server {server['name']} is a {server['impl']}; model_upstream "
                                 f"says how to point {sorted(upstream)} at the upstream")
            values.update(upstream[server["impl"]])
        overrides[server["name"]] = {server["type"]: {server["impl"]: values}}
    if hosts:
        raise SystemExit(f"hosts name servers the config does not have: {sorted(hosts)}; "
                         f"it has {sorted(overrides)}")
    return OmegaConf.merge(initial, OmegaConf.create(overrides))


def main():
    parser = argparse.ArgumentParser(description="Resolve a Gym run config as ng_run does.")
    parser.add_argument("config")
    parser.add_argument("--out", required=True)
    parser.add_argument("--keep-environment-servers", action="store_true")
    args = parser.parse_args()

    # The parser logs a deprecation warning for each generated relay; stdout stays JSON only.
    logging.getLogger("nemo_gym.global_config").setLevel(logging.ERROR)
    initial = OmegaConf.load(args.config)
    settings = initial.pop("_real_gym", None)
    declared = set(initial.keys())
    if settings is None:
        resolved = GlobalConfigDictParser().parse(
            GlobalConfigDictParserConfig(
                initial_global_config_dict=initial,
                skip_load_from_cli=True,
                skip_load_from_dotenv=True,
            )
        )
    else:
        initial = with_server_settings(initial, OmegaConf.to_container(settings))
        resolved = parse(initial)
    if not args.keep_environment_servers:
        for key in list(resolved.keys()):
            value = resolved[key]
            if key not in declared and isinstance(value, DictConfig) and "environment_servers" in value:
                del resolved[key]
    Path(args.out).write_text(OmegaConf.to_yaml(resolved))
    for server in servers_to_start(resolved):
        if settings is not None:
            server.update(server_facts(resolved, server["name"], server["type"], server["impl"]))
        print(json.dumps(server))


if __name__ == "__main__":
    main()
