"""MXNet 1.9.1's own unit tests, byte for byte, run against this project's
classes: ``test_gluon_trainer.py`` with ``gluon.Trainer`` replaced by
:class:`mp_symbolic.Trainer`; and ``test_module.py`` (with the
``test_bucketing.py`` it imports, from ``tests/python/train``), where they
are placed here, with ``mx.mod.Module`` replaced by
:class:`~mp_symbolic.core.engine.device_module.DeviceModule`, the Module that
``PipelineModule`` is (no host copy of the
parameters: ``get_params`` and MXNet's own reads of ``_arg_params`` get a
fresh one from the devices), BucketingModule's buckets included. Those two
are not kept in the tree (``.gitignore``); they are fetched with::

    curl -fsSL -o tests/upstream/test_module.py \
        https://raw.githubusercontent.com/apache/mxnet/1.9.1/tests/python/unittest/test_module.py
    curl -fsSL -o tests/upstream/test_bucketing.py \
        https://raw.githubusercontent.com/apache/mxnet/1.9.1/tests/python/train/test_bucketing.py

The files are apache/mxnet's at tag 1.9.1 (commit 3f8f3be9); ``common.py`` and
``nose/`` beside them stand in for the suite helpers they import. Each test
runs in its own temporary directory (the tests write state files to the
working directory). ``MP_SYMBOLIC_UPSTREAM_STOCK=1`` runs the same files
against MXNet's own ``gluon.Trainer`` and ``Module``, to compare.

Every test of the files passes on CPU with stock MXNet 1.9.1, and every one
runs here; none is skipped. Where the two are absent, ``test_fetched.py``
reports each as a skipped test with the command above.
"""
import os
import sys

import mxnet as mx
import pytest

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # common, nose, test_bucketing

# pylint: disable=wrong-import-position
from mp_symbolic.core.engine.device_module import DeviceModule  # noqa: E402
from mp_symbolic.core.optim.trainer import Trainer  # noqa: E402


@pytest.fixture(autouse=True)
def _our_classes_in_a_temporary_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    if os.environ.get('MP_SYMBOLIC_UPSTREAM_STOCK') != '1':
        monkeypatch.setattr(mx.gluon, 'Trainer', Trainer)
        monkeypatch.setattr(mx.gluon.trainer, 'Trainer', Trainer)
        # mx.mod is mx.module; a BucketingModule makes its buckets by this name.
        # (Not mxnet.module.module.Module: Module's own methods call super() by it.)
        monkeypatch.setattr(mx.module, 'Module', DeviceModule)
        monkeypatch.setattr(mx.module.bucketing_module, 'Module', DeviceModule)
