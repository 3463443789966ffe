"""``rankgate serve`` and ``rankgate mock-engine``.

Every ``serve`` flag can also come from the environment as ``RANKGATE_<FLAG>`` (dashes as
underscores), which is how containers configure it; a flag given on the command line wins.
The flags are declared once, in :mod:`rankgate.app.config.serve_flags`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rankgate import __version__
from rankgate.app.config import flags
from rankgate.app.config.serve_flags import SERVE_FLAGS
from rankgate.app.config.settings import GatewaySettings
from rankgate.app.observability.logs import configure_logging


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, SERVE_FLAGS)


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    return flags.settings_from_args(args, SERVE_FLAGS)


def serve(settings: GatewaySettings) -> int:
    configure_logging(settings.log_level, settings.log_format)
    if settings.workers > 1:
        from rankgate.app.serving.workers import run_workers

        return run_workers(settings)
    from rankgate.app.serving.process import serve_worker

    return serve_worker(settings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rankgate", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"rankgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser(
        "serve", help="serve the OpenAI API in front of vLLM (or the bundled mock engine)"
    )
    add_serve_arguments(serve_parser)
    serve_parser.set_defaults(handler=lambda args: serve(settings_from_args(args)))
    from rankgate.mocker.cli import register

    register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
