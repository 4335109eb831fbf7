"""Stand-in for MXNet 1.9.1's ``tests/python/unittest/common.py``: the names
``test_gluon_trainer.py`` and ``test_module.py`` import, with the same
behaviour (seeding, the exception check, waiting for the engine at the end
of a file); none of the CUDA, model-zoo or spawn helpers."""
import functools
import os
import random

import mxnet as mx
import numpy as np

__all__ = ['setup_module', 'with_seed', 'assertRaises', 'teardown']


def assertRaises(expected_exception, func, *args, **kwargs):  # pylint: disable=invalid-name
    """Asserts ``func(*args, **kwargs)`` raises ``expected_exception``."""
    try:
        func(*args, **kwargs)
    except expected_exception:
        pass
    else:
        raise AssertionError('%s did not raise %s' % (func.__name__, expected_exception.__name__))


def _seed(seed):
    np.random.seed(seed)
    mx.random.seed(seed)
    random.seed(seed)


def setup_module():
    """Seeds numpy, MXNet and Python from ``MXNET_MODULE_SEED`` (or a random seed)."""
    _seed(int(os.getenv('MXNET_MODULE_SEED', str(np.random.randint(0, np.iinfo(np.int32).max)))))


def with_seed(seed=None):
    """Runs the test with numpy, MXNet and Python seeded: ``seed``, else
    ``MXNET_TEST_SEED``, else a random seed, which a failure reports."""
    def decorate(test):
        @functools.wraps(test)
        def seeded(*args, **kwargs):
            env_seed = os.getenv('MXNET_TEST_SEED')
            this_seed = seed if seed is not None else \
                int(env_seed) if env_seed is not None else \
                np.random.randint(0, np.iinfo(np.int32).max)
            state = np.random.get_state()
            _seed(this_seed)
            try:
                test(*args, **kwargs)
            except BaseException as err:
                err.args = err.args + ('(use MXNET_TEST_SEED=%d to reproduce)' % this_seed,)
                raise
            finally:
                mx.nd.waitall()
                np.random.set_state(state)
        return seeded
    return decorate


def teardown():
    """Waits for every operation of the file to finish (MXNet's, run after each file)."""
    mx.nd.waitall()
