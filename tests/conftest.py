"""Shared fixtures. Every test runs on ``cpu(i)`` stand-in devices, as MXNet's
own model-parallel tests do, so no GPU is needed."""
import pytest

from mp_symbolic.data import make_dataset

THREE_DEVICES = 'cpu:0,cpu:1,cpu:2'


@pytest.fixture(scope='session')
def small_data():
    """400 examples of the seed's regression problem."""
    return make_dataset(num_examples=400, seed=1)
