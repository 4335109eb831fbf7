"""The exceptions of the export package, and how they are reported. All are
``ValueError``s: each one is a user-facing problem with a file or an input,
reported in one line (:func:`one_line`)."""

__all__ = ['one_line', 'ExportError', 'VerificationError', 'ModelFileError', 'InputError',
           'OutputError']


class ExportError(ValueError):
    """A checkpoint or environment that the exporter cannot turn into files."""


class VerificationError(ExportError):
    """An export whose files failed a verification check; nothing was written."""


class ModelFileError(ValueError):
    """An exported model file that is missing, corrupt, or of an unknown kind."""


class InputError(ValueError):
    """Prediction inputs that are not a finite numeric (samples, features) table."""


class OutputError(ValueError):
    """A predictions output path of a kind that cannot be written."""


def one_line(err):
    """An error's message with its line breaks and runs of spaces folded."""
    return ' '.join(str(err).split())
