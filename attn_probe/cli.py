"""``attn-probe`` command line: thin argparse front-end; each subcommand lives in its own module.

A command module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and imports its
heavy dependencies inside ``run``.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
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
    "models": ("attn_probe.commands.models", "list the attention layouts attn_probe reads and how to add one"),
    "reference": ("attn_probe.commands.reference", "list the paper's scores of pretrained models and its training runs"),
}


class CommandError(Exception):
    """A user-facing error: printed as one line, exit code 2, no traceback."""


def one_line(text: str) -> str:
    """``text`` as one terminal-safe line: control characters escaped (:func:`attn_probe.formats.logdir.printable`)."""
    from .formats.logdir import printable

    return printable(text)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="attn-probe",
        description="Symmetry and directionality of self-attention's W_qk (Saponati et al., 2025).",
    )
    parser.add_argument("--version", action="version", version=f"attn-probe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers: dict[str, argparse.ArgumentParser] = {}
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
        subparsers[name] = p
    parser._attn_probe_subparsers = subparsers  # type: ignore[attr-defined]
    return parser


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """Report arguments no parser took with the subcommand's usage, suggesting close option names.

    ``attn-probe plot --metrics symmetry`` says ``did you mean --metric?`` under ``plot``'s usage
    (argparse alone prints the top-level usage). Exits with status 2.
    """
    sub = getattr(parser, "_attn_probe_subparsers", {}).get(getattr(args, "command", None))
    target = sub if sub is not None else parser
    options = [o for a in target._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in extras:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                hints.append(f"{arg.split('=', 1)[0]}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(extras)}"
    if hints:
        message += " (" + "; ".join(hints) + ")"
    target.error(message)


def _quiet_broken_pipe() -> int:
    """stdout's reader went away (``attn-probe summary RUN | head -4``): stop quietly, as Unix
    tools do. stdout is pointed at ``/dev/null`` so that the interpreter's final flush does not
    report the pipe again; the status is the shell's for SIGPIPE (128 + 13)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor: nothing left to protect
        pass
    return 141


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unrecognized(parser, args, extras)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except CommandError as exc:
        print(f"attn-probe {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
