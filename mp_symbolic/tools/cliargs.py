"""One-line command-line errors, for every command of the project.

Argparse answers a bad flag with its whole usage block and the message at the
bottom; here a flag error, like every other user error, is one line on
stderr (``error: <prog>: <message> (see --help)``) and exit status 2.
:func:`print_error` writes such a line so that it always reaches the
terminal: whatever its encoding, a path that cannot be shown in it is
printed with backslash escapes instead of raising ``UnicodeEncodeError``.
"""
import argparse
import sys

__all__ = []

USAGE_ERROR = 2  # argparse's own exit status for a bad command line


def print_error(message, file=None):
    """Prints ``error: <message>`` as one line; never raises.

    Args:
        message: An exception or a string; its line breaks and runs of spaces
            are folded into single spaces.
        file: A text stream (default: ``sys.stderr``). If it is closed or
            missing (``2>&-``) nothing is printed.
    """
    file = sys.stderr if file is None else file
    if file is None:
        return
    line = 'error: %s\n' % ' '.join(str(message).split())
    encoding = getattr(file, 'encoding', None) or 'utf-8'
    try:
        # Characters the stream cannot encode (an undecodable file name, 'é' on
        # an ASCII terminal) become \xff, \udcff, ... instead of an exception.
        line = line.encode(encoding, 'backslashreplace').decode(encoding, 'replace')
    except LookupError:
        line = line.encode('ascii', 'backslashreplace').decode('ascii')
    try:
        file.write(line)
        file.flush()
    except (OSError, ValueError):
        pass  # stderr itself is gone: the exit status still tells


class _Subcommands(argparse._SubParsersAction):  # pylint: disable=protected-access
    """Subcommands whose parser refuses an argument it does not know, naming
    itself: argparse leaves such arguments to the top-level parser, whose
    refusal names only the top-level program."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        # argparse's own place for them (the top-level parser keeps its own apart)
        unknown = argparse._UNRECOGNIZED_ARGS_ATTR  # pylint: disable=protected-access
        extras = vars(namespace).pop(unknown, None)
        if extras:
            self._name_parser_map[values[0]].error(
                'unrecognized arguments: %s' % ' '.join(extras))


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and exit status 2.

    Subcommand parsers made through :meth:`add_subparsers` are of this class
    too (argparse makes them of the parent's class), so their errors name the
    subcommand: ``error: python -m mp_symbolic train: argument --epochs:
    invalid int value: 'x' (see --help)``, and so does an argument after the
    subcommand that it does not know: ``error: python -m mp_symbolic train:
    unrecognized arguments: --bogus (see --help)``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register('action', 'parsers', _Subcommands)

    def error(self, message):
        print_error('%s: %s (see --help)' % (self.prog, message))
        self.exit(USAGE_ERROR)
