"""``nose.tools.raises`` and ``assert_raises`` with nose's behaviour."""
import functools
import unittest

__all__ = ['raises', 'assert_raises']


def raises(*exceptions):
    """The decorated test passes only if it raises one of ``exceptions``."""
    def decorate(test):
        @functools.wraps(test)
        def checked(*args, **kwargs):
            try:
                test(*args, **kwargs)
            except exceptions:
                return
            raise AssertionError('%s() did not raise %s'
                                 % (test.__name__, ' or '.join(e.__name__ for e in exceptions)))
        return checked
    return decorate


_CASE = unittest.TestCase('__init__')
assert_raises = _CASE.assertRaises  # nose derives its assert_* from unittest's the same way
