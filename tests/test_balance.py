"""Partitioning: never an empty stage, never a dropped block, and the best
contiguous split, for every balance mode (DeepSpeed's partitioner once
emptied a stage, #4053, and dropped trailing blocks, #4312)."""
import itertools

import mxnet as mx
from mxnet import gluon
import numpy as np
import pytest

from mp_symbolic import Pipeline
from mp_symbolic import balance_by_size, balance_by_time
from mp_symbolic.core.placement import balance as balancing
from mp_symbolic.core.base import timing
from mp_symbolic.core.placement.balance import BalanceError, check_balance, solve, stage_of_block
from mp_symbolic.training.tasks import gpt

nn = gluon.nn


def _blocks(widths):
    return [nn.Dense(widths[i + 1], in_units=widths[i], prefix='d%d_' % i)
            for i in range(len(widths) - 1)]


def _brute_force_max(costs, k):
    best = float('inf')
    for cuts in itertools.combinations(range(1, len(costs)), k - 1):
        bounds = (0,) + cuts + (len(costs),)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize('num_blocks', range(1, 13))
@pytest.mark.parametrize('num_stages', range(1, 7))
def test_solve_covers_every_block_with_non_empty_stages_and_is_optimal(num_blocks, num_stages):
    costs = list(np.random.default_rng(num_blocks * 7 + num_stages).integers(0, 50, num_blocks))
    costs[len(costs) // 2] = 0  # zero-cost blocks (Flatten, pooling) must still be placed
    if num_stages > num_blocks:
        with pytest.raises(BalanceError, match='too many devices'):
            solve(costs, num_stages)
        return
    sizes = solve(costs, num_stages)
    assert len(sizes) == num_stages and min(sizes) >= 1 and sum(sizes) == num_blocks
    stages = stage_of_block(sizes)
    assert list(stages) == sorted(stages) and len(stages) == num_blocks
    bounds = np.cumsum((0,) + sizes)
    assert max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) == \
        _brute_force_max(costs, num_stages)


@pytest.mark.parametrize('mode', ['params', 'list', 'time'])
@pytest.mark.parametrize('num_blocks, num_devices', [(1, 1), (3, 3), (5, 2), (12, 6), (7, 4),
                                                     (2, 1), (6, 6)])
def test_every_balance_mode_gives_each_stage_a_block_and_drops_none(mode, num_blocks,
                                                                    num_devices):
    widths = [3] + [4 + (i % 3) * 4 for i in range(num_blocks)]
    devices = ','.join('cpu:%d' % i for i in range(num_devices))
    kwargs = {}
    if mode == 'list':
        base, extra = divmod(num_blocks, num_devices)
        kwargs['balance'] = [base + (s < extra) for s in range(num_devices)]
    elif mode == 'time':
        kwargs.update(balance='time', sample=(8, 3))
    pipe = Pipeline(_blocks(widths), devices, **kwargs)
    assert [len(stage) for stage in pipe.stages] == list(pipe.balance)
    assert min(pipe.balance) >= 1 and sum(pipe.balance) == num_blocks
    assert [b for stage in pipe.stages for b in stage] == list(pipe.blocks)


def test_parameter_balance_puts_the_heavy_layer_alone():
    # parameters per layer: 8*2+8=24, 512*8+512=4608, 1*512+1=513
    pipe = Pipeline(_blocks((2, 8, 512, 1)), 'cpu:0,cpu:1')
    assert pipe.balance == (2, 1) or pipe.balance == (1, 2)
    costs = [24, 4608, 513]
    assert pipe.balance == solve(costs, 2) == (2, 1)


@pytest.mark.parametrize('balance, message', [
    ((1, 1), 'summing to the 3 blocks'), ((3,), 'one entry per device'),
    ((0, 3), 'at least one block'), ((1.5, 1.5), 'expected integers'),
    (5, 'expected None'),
])
def test_check_balance_says_what_is_wrong(balance, message):
    with pytest.raises(BalanceError, match=message):
        check_balance(balance, 3, 2)


def test_time_balance_times_each_block_on_the_first_stage_device(monkeypatch):
    seen = []

    def fake_times(blocks, sample_shape, ctx, repeats=5, seed=0):
        seen.append((len(blocks), tuple(sample_shape), ctx))
        return [1.0, 1.0, 5.0, 1.0]
    monkeypatch.setattr(balancing, 'forward_backward_times', fake_times)
    pipe = Pipeline(_blocks((3, 4, 4, 4, 4)), 'cpu:2,cpu:1', balance='time', sample=(8, 3))
    assert seen == [(4, (8, 3), mx.cpu(2))]
    assert pipe.balance == (2, 2) == balance_by_time(_blocks((3, 4, 4, 4, 4)), (8, 3),
                                                     partitions=2)


def test_balance_by_size_and_by_time_split_real_blocks():
    blocks = _blocks((2, 8, 512, 1))
    assert balance_by_size(blocks, 2) == (2, 1)
    balance = balance_by_time(blocks, np.zeros((16, 2)), mx.cpu(1), partitions=3)
    assert balance == (1, 1, 1)


def test_time_balance_measures_without_touching_the_blocks_parameters():
    blocks = _blocks((4, 64, 4))
    for block in blocks:
        block.initialize(ctx=mx.cpu(0))
    before = blocks[0].weight.data().asnumpy()
    Pipeline(blocks, 'cpu:0,cpu:1', balance='time', sample=np.zeros((16, 4)))
    np.testing.assert_array_equal(blocks[0].weight.data().asnumpy(), before)


def test_time_balance_splits_a_language_model_whose_first_block_reads_token_ids():
    """The GPT's first block feeds its input to an Embedding, whose backward
    gives its ids no gradient: the block is timed without one."""
    cfg = gpt.GPTConfig(vocab_size=29, block_size=16, num_layers=2, num_heads=2, num_hiddens=16)
    blocks = gpt.build_blocks(cfg)
    pipe = Pipeline(blocks, 'cpu:0,cpu:1', balance='time', sample=(4, cfg.block_size))
    assert len(pipe.balance) == 2 and min(pipe.balance) >= 1
    assert sum(pipe.balance) == len(blocks)


def test_the_timer_warms_up_then_times_each_run_in_turn():
    """timing.repeat: the warm-up calls first, untimed, then one timed call
    of each run per round, so that load changes touch every run alike."""
    calls = []
    times = timing.repeat({'a': lambda: calls.append('a'), 'b': lambda: calls.append('b')},
                          repeats=3, warmup=2)
    assert calls == ['a', 'b'] * 5
    assert {name: len(ts) for name, ts in times.items()} == {'a': 3, 'b': 3}
    assert all(t >= 0 for ts in times.values() for t in ts)
    single = []
    assert len(timing.repeat(lambda: single.append(1), repeats=4)) == 4 and len(single) == 5
