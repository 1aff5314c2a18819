"""The ``specdec`` parser and entry point: one subcommand per module, errors as one line."""

from __future__ import annotations

import argparse
import sys

from . import demo, generate, verify_demo
from ._common import EXIT_INTERRUPTED, EXIT_USAGE, HF_MODULES, UsageError

# subcommand -> (its module's add_parser, validate (before anything loads), run)
COMMANDS = {
    "demo": (demo.add_parser, demo.validate, demo.demo),
    "generate": (generate.add_parser, generate.validate, generate.generate_command),
    "verify-demo": (verify_demo.add_parser, verify_demo.validate, verify_demo.verify_demo),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="specdec_kernels command line")
    sub = parser.add_subparsers(dest="command")
    for add_parser, _, _ in COMMANDS.values():
        add_parser(sub).add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command not in COMMANDS:
        parser.print_help()
        return 0
    _, validate, run = COMMANDS[args.command]
    try:
        validate(args)
        return run(args)
    except UsageError as exc:
        if args.debug:
            raise
        print(f"specdec {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as exc:
        if args.debug or (exc.name or "").split(".")[0] not in HF_MODULES:
            raise
        print(
            f"specdec {args.command}: error: {exc.name} is not installed (a dependency that a --no-deps install "
            'skips): pip install "transformers>=5.4" "safetensors>=0.4" "tqdm>=4"',
            file=sys.stderr,
        )
        return EXIT_USAGE
    except KeyboardInterrupt:
        if args.debug:
            raise
        sys.stdout.write("\n")  # end a half-streamed line
        sys.stdout.flush()
        print(f"specdec {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
