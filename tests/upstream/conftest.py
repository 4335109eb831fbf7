"""MXNet 1.9.1's own ``tests/python/unittest/test_gluon_trainer.py``, byte for
byte, run with ``gluon.Trainer`` replaced by :class:`mp_symbolic.Trainer`.

The file is apache/mxnet's at tag 1.9.1 (commit 3f8f3be9); ``common.py`` and
``nose/`` beside it stand in for the suite helpers it imports. Each test runs
in its own temporary directory (the tests write state files to the working
directory). ``MP_SYMBOLIC_UPSTREAM_STOCK=1`` runs the same file against
MXNet's own ``gluon.Trainer``, to compare.

Every test of the file passes on CPU with stock MXNet 1.9.1, and every one
runs here; none is skipped.
"""
import os
import sys

import mxnet as mx
import pytest

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # common, nose

from mp_symbolic.core.trainer import Trainer  # noqa: E402  pylint: disable=wrong-import-position


@pytest.fixture(autouse=True)
def _our_trainer_in_a_temporary_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    if os.environ.get('MP_SYMBOLIC_UPSTREAM_STOCK') != '1':
        monkeypatch.setattr(mx.gluon, 'Trainer', Trainer)
        monkeypatch.setattr(mx.gluon.trainer, 'Trainer', Trainer)
