"""``attn-probe`` command line: thin argparse front-end; each subcommand lives in its own module.

A command module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and imports its
heavy dependencies inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "score": ("attn_probe.commands.score", "score a saved Hugging Face checkpoint directory"),
    "export": ("attn_probe.commands.export", "export trajectories to CSV, Parquet or JSONL"),
    "plot": ("attn_probe.commands.plot", "draw the emergent-dynamics figure of one or more runs"),
    "summary": ("attn_probe.commands.summary", "first and last median [q25, q75] per run"),
    "heatmap": ("attn_probe.commands.heatmap", "heatmap of one layer's W_qk from a checkpoint"),
    "demo": ("attn_probe.commands.demo", "train an encoder and a decoder and compare their W_qk"),
}


class CommandError(Exception):
    """A user-facing error: printed as one line, exit code 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="attn-probe",
        description="Symmetry and directionality of self-attention's W_qk (Saponati et al., 2025).",
    )
    parser.add_argument("--version", action="version", version=f"attn-probe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("attn_probe"):
                continue  # command not built yet
            raise
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except CommandError as exc:
        print(f"attn-probe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
