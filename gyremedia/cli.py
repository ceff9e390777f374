"""``gyremedia train | config | plugins``: every run is a yaml plus ``key=value`` overrides."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib import resources
from pathlib import Path

from gyremedia.config import ConfigError, ResolvedConfig, load_config, resolve_config
from gyremedia.plugins import PluginError, PluginManager

DEFAULT_CONFIG = "quickstart.yaml"


def bundled_config(name: str) -> Path:
    """A config shipped with the package (the repository's ``configs/`` folder)."""
    return Path(str(resources.files("gyremedia.configs") / name))


def _resolve(config_path: str | None, overrides: list[str], pm: PluginManager) -> ResolvedConfig:
    if config_path is None:
        config_path = str(bundled_config(DEFAULT_CONFIG))
    elif not Path(config_path).is_file():
        shipped = bundled_config(config_path if config_path.endswith(".yaml") else config_path + ".yaml")
        if not shipped.is_file():
            raise ConfigError(f"config file {config_path!r} not found (nor among the bundled configs)")
        config_path = str(shipped)
    return resolve_config(load_config(config_path, overrides), pm)


def _split_args(values: list[str]) -> tuple[str | None, list[str]]:
    """The first value is the config file unless it is already a ``key=value`` override."""
    if values and "=" not in values[0]:
        return values[0], values[1:]
    return None, values


def cmd_train(args: argparse.Namespace) -> int:
    from gyremedia.trainer import RESOLVED_CONFIG, RewardError, Trainer

    pm = PluginManager()
    config_path, overrides = _split_args(args.args)
    if args.resume:
        if config_path is not None:
            raise ConfigError("with --resume the config is the run's own; pass only key=value overrides")
        config_path = str(Path(args.resume) / RESOLVED_CONFIG)
        if not Path(config_path).is_file():
            raise ConfigError(f"--resume {args.resume}: no {RESOLVED_CONFIG} there; is it a run folder?")
        overrides = [f"run.output_dir={args.resume}", *overrides]
    config = _resolve(config_path, overrides, pm)
    try:
        state = Trainer(config, pm, resume=bool(args.resume)).train()
    except RewardError as exc:
        print(f"gyremedia: error: {exc}", file=sys.stderr)
        return 1
    if state.accelerator.is_main_process:
        print(f"run folder: {state.run_dir}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    config_path, overrides = _split_args(args.args)
    print(_resolve(config_path, overrides, PluginManager()).to_yaml(), end="")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    pm = PluginManager()
    rows = pm.describe()
    failed = [{"plugin": f.name, "package": f.distribution, "error": f.error} for f in pm.failed]
    if args.json:
        print(json.dumps({"plugins": rows, "failed": failed}, indent=2))
        return 0
    for row in rows:
        print(f"{row['plugin']}  (package {row['package']})")
        for item in row["registers"]:
            kind, name = item.split(":", 1)
            description = pm.registry.get(kind, name).meta.get("description", "")
            print(f"    {kind:<12}{name:<24}{description}")
        if row["hooks"]:
            print(f"    hooks: {', '.join(row['hooks'])}")
    for item in failed:
        print(f"FAILED {item['plugin']}  (package {item['package']}): {item['error']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gyremedia", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    train = commands.add_parser("train", help="train from a yaml (default: the quickstart) plus key=value overrides")
    train.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last complete checkpoint")
    train.set_defaults(func=cmd_train)
    config = commands.add_parser("config", help="validate a config and print it with every default filled in")
    config.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    config.set_defaults(func=cmd_config)
    plugins = commands.add_parser("plugins", help="list plugins, what they register and the hooks they implement")
    plugins.add_argument("--json", action="store_true", help="print one JSON object")
    plugins.set_defaults(func=cmd_plugins)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `gyremedia` alone trains the quickstart, like `gyremedia train`
        args = parser.parse_args(["train", *(argv or [])])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, PluginError) as exc:
        print(f"gyremedia: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
