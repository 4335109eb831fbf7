"""Shared fixtures. Every test runs on ``cpu(i)`` stand-in devices, as MXNet's
own model-parallel tests do, so no GPU is needed."""
import os

import pytest

os.environ.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')

THREE_DEVICES = 'cpu:0,cpu:1,cpu:2'


@pytest.fixture(scope='session')
def small_data():
    """400 examples of the seed's regression problem."""
    from mp_symbolic.training.tasks.regression import make_dataset  # pylint: disable=import-outside-toplevel
    return make_dataset(num_examples=400, seed=1)


@pytest.fixture(scope='session')
def digits_data():
    """The digits split: ``(X_train, y_train, X_held_out, y_held_out)``."""
    from mp_symbolic.training.tasks import digits  # pylint: disable=import-outside-toplevel
    return digits.split(*digits.load_digits(), seed=0)
