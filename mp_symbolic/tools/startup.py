"""MXNet loaded by a command as on a machine without scikit-learn.

MXNet 1.9.1's ``mxnet/model.py`` imports ``sklearn.base`` as it loads, only
to derive its legacy ``FeedForward`` model from scikit-learn's
``BaseEstimator`` (``object`` where scikit-learn is absent, MXNet's own
fallback); scikit-learn loads SciPy's and pandas's modules with it, a
large share of every command's start. :func:`mxnet_without_sklearn`, called
by the commands' entry points before MXNet loads, turns that one import
away: everything else, a task's ``sklearn.datasets`` included, imports
scikit-learn as usual, and a process that has loaded MXNet already is left
as it is. Standard library only.
"""
import sys

__all__ = ['mxnet_without_sklearn', 'SklearnForMXNet']

_IMPORTER = 'mxnet.model'  # the module whose load imports sklearn.base
_DEPTH = 32  # frames looked through from the finder up to that module's code


class SklearnForMXNet:
    """A ``sys.meta_path`` finder that refuses ``sklearn`` and its
    submodules (``ModuleNotFoundError``, as where it is not installed) while
    MXNet's ``mxnet/model.py`` runs its module code, and finds nothing
    otherwise (the next finders answer)."""

    @staticmethod
    def find_spec(name, path=None, target=None):  # pylint: disable=unused-argument
        """Raises ``ModuleNotFoundError`` for ``sklearn[.*]`` imported by
        ``mxnet/model.py`` as it loads; returns None for every other import."""
        if name != 'sklearn' and not name.startswith('sklearn.'):
            return None
        frame = sys._getframe(1)  # pylint: disable=protected-access
        for _ in range(_DEPTH):
            if frame is None:
                break
            if frame.f_code.co_name == '<module>' and \
                    frame.f_globals.get('__name__') == _IMPORTER:
                raise ModuleNotFoundError('%s: left out of MXNet (only its legacy FeedForward '
                                          'reads it)' % name, name=name)
            frame = frame.f_back
        return None


def mxnet_without_sklearn():
    """Puts :class:`SklearnForMXNet` first on ``sys.meta_path`` where MXNet
    is not loaded yet and it is not there already. Returns True where it is
    there once the call ends."""
    if any(isinstance(f, SklearnForMXNet) or f is SklearnForMXNet for f in sys.meta_path):
        return True
    if 'mxnet' in sys.modules:
        return False
    sys.meta_path.insert(0, SklearnForMXNet)
    return True
