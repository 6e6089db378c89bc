"""What a command module gives `pdchaos`, and how its handler is called.

A command module has `register(commands: Subcommands) -> None`, which adds its parser(s) and sets
`handler` on each: a function of the parsed namespace that returns the exit code. `call_handler`
runs it and turns the errors every layer may raise into exit codes instead of tracebacks.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import TypeAlias

from chaos import transport
from chaos.errors import TargetError, UsageError
from chaos.exit_codes import ExitCode

# argparse's own type for what add_subparsers() returns (a string: it is not subscriptable at run time)
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def call_handler(args: argparse.Namespace) -> int:
    """Run the handler a command's parser set, as the exit code of `pdchaos`."""
    try:
        return int(args.handler(args))
    except UsageError as exc:
        print(f"pdchaos: error: {transport.redact(str(exc))}", file=sys.stderr)
        return ExitCode.USAGE
    except TargetError as exc:  # the target could not be started or reached: a setup problem
        print(f"pdchaos: target error: {transport.redact(str(exc))}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # `pdchaos ... | head`: the reader left, nothing is wrong
        return ExitCode.PASS
    except Exception:
        if not transport.current().has_secrets:
            raise
        # Python would print the traceback as it is; a message in it may quote a header
        print(transport.redact(traceback.format_exc()), file=sys.stderr, end="")
        return ExitCode.FAIL
