# SPDX-License-Identifier: Apache-2.0
"""``vllm-dsv4-hw``: the command line (also ``python -m vllm_dsv4_hw``).

Subcommands: ``kv-plan`` (per-sequence KV cache sizing), ``info`` (device, versions, op
backends), ``conformance`` (certify a device's backends: vllm_dsv4_hw.conformance) and
``make-checkpoint`` (a tiny random checkpoint in the official format). Run it as
``vllm-dsv4-hw`` or ``python -m vllm_dsv4_hw`` (not as ``python -m vllm_dsv4_hw.cli.main``: the
subcommand modules import this one).

Results go to stdout. A bad argument or input ends the command with exit status 2 and one line on
stderr naming the problem (no traceback); diagnostics go through ``logging`` (``-v``/``-vv``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn, Sequence

PROG = "vllm-dsv4-hw"
EXIT_USAGE = 2
EXIT_FAILURE = 1

logger = logging.getLogger(__name__)


class CLIError(Exception):
    """A failure to report as one line, with an exit status."""

    def __init__(self, message: str, status: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.status = status


def one_line(message: object) -> str:
    return " ".join(str(message).split())


def report_error(message: object, prog: str = PROG) -> None:
    sys.stderr.write(f"{prog}: error: {one_line(message)}\n")
    sys.stderr.flush()


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        report_error(f"{message} (see {self.prog} --help)", prog=PROG)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    from vllm_dsv4_hw import __version__
    from vllm_dsv4_hw.cli import conformance, info, kv_plan, make_checkpoint

    parser = _Parser(prog=PROG, description="DeepSeek V4 attention plugin for vLLM: tools.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="diagnostics on stderr (-v info, -vv debug)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    kv_plan.add_parser(sub)
    info.add_parser(sub)
    make_checkpoint.add_parser(sub)
    conformance.add_parser(sub)
    return parser


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    # No-op when the host (pytest, vLLM) already configured the root logger.
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("vllm_dsv4_hw").setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help / --version (0) or a usage error (already reported)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    _setup_logging(args.verbose)
    logger.debug("command line: %s", args)
    from vllm_dsv4_hw.config import ConfigError
    from vllm_dsv4_hw.envs import SettingError

    try:
        return int(args.run(args))
    except CLIError as exc:
        report_error(exc)
        return exc.status
    except (ConfigError, SettingError) as exc:
        report_error(exc)
        return EXIT_USAGE
