"""``rl-tinker serve CONFIG [key=value ...]``: start the Tinker-compatible service."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rl-tinker`` command."""
    parser = argparse.ArgumentParser(prog="rl-tinker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the Tinker REST API (docs/service.md)")
    serve.add_argument("config", help="YAML file of rl_tinker.config.ServiceConfig")
    serve.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. port=9000")
    args = parser.parse_args(argv)

    import logging

    from rl_core.config import apply_overrides, from_dict, load_config_file
    from rl_core.errors import RLError
    from rl_tinker.config import ServiceConfig
    from rl_tinker.runner import serve_forever

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        data = load_config_file(args.config)
        if args.overrides:
            data = apply_overrides(data, args.overrides, base_dir=".")
        config = from_dict(ServiceConfig, data)
        serve_forever(config)
    except RLError as e:
        print(f"rl-tinker: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
