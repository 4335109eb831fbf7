"""The character-level language model (``--task lm``): it is causal, it
learns past what a model without context can reach, every split of it (stages
over the blocks or over its graph, micro-batches, replicas) computes what one
device computes, a checkpoint resumes onto another plan, and its export runs
in onnxruntime at any batch size and sequence length with the trained
numbers."""
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import mxnet as mx
import numpy as np
import onnx
import pytest

import mp_symbolic
from mp_symbolic.core import kernels
from mp_symbolic.training import loop
from mp_symbolic.training.config import TrainConfig
from mp_symbolic.training.sample import MXNetModel, OnnxModel, sample
from mp_symbolic.training.tasks import gpt, lm

ROOT = Path(__file__).resolve().parents[1]
TINY = gpt.GPTConfig(vocab_size=23, block_size=12, num_layers=2, num_heads=2, num_hiddens=8)
BATCH = 8
TOL = 1e-5
# A short run (about 10 s of training): a network that ignores the context
# cannot go below the corpus' unigram entropy (4.54 bits per character here);
# a broken one stays near log2(vocabulary) = 7.4.
SHORT_RUN = dict(num_layers=1, num_heads=2, num_hiddens=32, block_size=32,
                 train_chars=1 << 16, val_chars=1 << 13)
SHORT_RUN_BOUND = 4.2


def _batch(cfg=TINY, seed=0, batch=BATCH):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (batch, cfg.block_size)).astype(np.float32),
            rng.integers(0, cfg.vocab_size, (batch, cfg.block_size)).astype(np.float32))


def _network(whole, shards=1):
    build = gpt.build_network if whole else gpt.build_blocks
    return build(TINY, lm.sharded_layers(shards))


def _bound(pipe, arg_params, replicas=1):
    """``pipe``'s Module with SGD (lr 1: a step's change is the gradient),
    its parameters set from ``arg_params`` (unsplit names) by name."""
    X, y = _batch()
    mod = pipe.module(loss=lm.LOSS)
    mod.bind(data_shapes=[('data', X.shape)], label_shapes=[('softmax_label', y.shape)])
    mod.init_params(arg_params={k: mx.nd.array(v) for k, v in arg_params.items()},
                    aux_params={}, allow_missing=False)
    mod.init_optimizer(kvstore='local' if replicas > 1 else None, optimizer='sgd',
                       optimizer_params={'learning_rate': 1.0, 'rescale_grad': 1.0 / BATCH})
    return mod


def _one_step(devices, whole=False, chunks=1, replicas=1, init=None, shards=1,
              schedule='gpipe'):
    """Outputs and parameters after one SGD step of the tiny model on ``devices``."""
    X, y = _batch()
    pipe = mp_symbolic.Pipeline(_network(whole, shards), devices,
                                sample=(BATCH, TINY.block_size), chunks=chunks,
                                replicas=replicas, schedule=schedule)
    if init is None:
        init = loop.initial_values(pipe, seed=0)
    mod = _bound(pipe, init[0], replicas)
    mod.forward(mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)]), is_train=True)
    out = mod.get_outputs()[0].asnumpy()
    mod.backward()
    mod.update()
    params = {k: v.asnumpy() for k, v in mod.get_params()[0].items()}
    return pipe, init, out, params


@pytest.fixture(scope='module')
def one_device():
    return _one_step('cpu:0')


def test_prediction_at_a_position_reads_no_later_character():
    net = gpt.build_network(TINY)
    net.initialize(mx.init.Normal(0.5))
    X, _ = _batch()
    changed = X.copy()
    changed[:, 6:] = (changed[:, 6:] + 1) % TINY.vocab_size
    before, after = net(mx.nd.array(X)).asnumpy(), net(mx.nd.array(changed)).asnumpy()
    np.testing.assert_allclose(after[:, :6], before[:, :6], rtol=0, atol=1e-6)
    assert np.abs(after[:, 6:] - before[:, 6:]).max() > 1e-3


def test_shorter_sequence_gives_the_prefix_of_the_longer_ones_output():
    net = gpt.build_network(TINY)
    net.initialize(mx.init.Normal(0.5))
    X, _ = _batch()
    full, prefix = net(mx.nd.array(X)).asnumpy(), net(mx.nd.array(X[:, :5])).asnumpy()
    np.testing.assert_allclose(prefix, full[:, :5], rtol=1e-5, atol=1e-6)


def test_layer_norm_equals_gluons_layer_norm_and_its_gradients_under_the_same_names():
    rng = np.random.default_rng(3)
    X = mx.nd.array(rng.normal(1.0, 2.0, (3, 5, 8)))
    dy = mx.nd.array(rng.normal(size=(3, 5, 8)))
    results = []
    norms = [gpt.LayerNorm(8, fused=False, prefix='ln_')]
    if kernels.fused_layer_norm()[0]:
        norms.append(gpt.LayerNorm(8, fused=True, prefix='ln_'))
    for norm in [mx.gluon.nn.LayerNorm(in_channels=8, prefix='ln_')] + norms:
        norm.initialize()
        norm.gamma.set_data(mx.nd.array(np.linspace(0.5, 1.5, 8)))
        norm.beta.set_data(mx.nd.array(np.linspace(-1, 1, 8)))
        x = X.copy()
        x.attach_grad()
        with mx.autograd.record():
            out = norm(x)
        out.backward(dy)
        results.append({'out': out.asnumpy(), 'x': x.grad.asnumpy(),
                        **{n: p.grad().asnumpy() for n, p in norm.collect_params().items()}})
    want = results[0]
    for got in results[1:]:
        assert sorted(got) == sorted(want) == ['ln_beta', 'ln_gamma', 'out', 'x']
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_backward_pass_runs_no_broadcast_reduction_and_no_layer_norm_backward():
    """MXNet 1.9.1 on CPU reduces a broadcast's and LayerNorm's gradients in a
    generic kernel that took 37 % of the model's step (docs/lm.md): the
    causal mask, the position embeddings and the norms are written without."""
    pipe = mp_symbolic.Pipeline(gpt.build_blocks(TINY), 'cpu:0', sample=(BATCH, TINY.block_size))
    symbol = pipe.training_symbol(lm.LOSS)
    exe = symbol.simple_bind(mx.cpu(0), data=(BATCH, TINY.block_size),
                             softmax_label=(BATCH, TINY.block_size))
    ops = set(re.findall(r'Op:(\w+)', exe.debug_str()))
    product = kernels.CAUSAL_ATTENTION if kernels.use_fused_attention() else \
        kernels.SMALL_BATCH_DOT if kernels.use_small_batch_dot() else 'batch_dot'
    assert {'_backward_FullyConnected', product} <= ops  # the plan lists the backward ops
    assert not {op for op in ops if op.startswith('_backward_broadcast')}
    assert '_backward_LayerNorm' not in ops and 'LayerNorm' not in ops


def test_the_loss_head_runs_log_softmax_and_no_softmax_output_forward_or_backward():
    """MXNet 1.9.1 runs SoftmaxOutput's softmax in its generic kernel in
    training, 1.97 ms a pass on the model's scores where log_softmax, pick and
    MakeLoss with the probabilities' softmax took 0.65 (docs/lm.md)."""
    task = lm.task(**SHORT_RUN)
    assert task.loss == lm.LOSS == 'log_softmax'
    pipe = mp_symbolic.Pipeline(gpt.build_blocks(TINY), 'cpu:0', sample=(BATCH, TINY.block_size))
    ops = _ops_of(pipe.training_symbol(task.loss), data=(BATCH, TINY.block_size),
                  softmax_label=(BATCH, TINY.block_size))
    assert {'log_softmax', '_backward_log_softmax', 'softmax'} <= set(ops)
    assert not {op for op in ops if 'SoftmaxOutput' in op}


def _ops_of(symbol, **shapes):
    """The op of every node MXNet's plan of ``symbol`` runs, forward and backward."""
    exe = symbol.simple_bind(mx.cpu(0), **shapes)
    return re.findall(r'Op:(\w+)', exe.debug_str())


def test_layer_norm_scales_by_gamma_and_each_positions_deviation_in_one_product():
    """Five products a norm, forward: the mean, its spread, the variance, the
    deviation times ``gamma``, ``beta``'s spread; no (R, C) array of ``gamma``
    (the norm where the fused op cannot be built)."""
    norm = gpt.LayerNorm(8, fused=False, prefix='ln_')
    x = mx.sym.var('data')
    ops = _ops_of(norm(x), data=(3, 5, 8), ln_gamma=(8,), ln_beta=(8,))
    assert ops.count('FullyConnected') == 5
    assert ops.count('_backward_FullyConnected') == 5
    assert ops.count('elemwise_mul') == 1  # the centred rows times the scale


def test_attention_mask_is_one_product_outside_the_gradient():
    """The causal mask reaches the scores' (N, h, T, T) in one ``dot`` of a
    column of ones with the (T, T) mask, which the backward pass never runs."""
    q, k, v = (mx.sym.var(n) for n in 'qkv')
    shapes = {n: (BATCH, TINY.block_size, TINY.num_hiddens) for n in 'qkv'}
    attention = gpt._Attend(TINY.num_hiddens // TINY.num_heads)  # pylint: disable=protected-access
    ops = _ops_of(mx.sym.make_loss(mx.sym.sum(attention(mx.sym, q, k, v))), **shapes)
    assert ops.count('dot') == 2  # the ones column (N x h) and the mask over its rows
    assert not {'zeros_like', 'broadcast_add', '_backward_dot'} & set(ops)


def test_model_flops_per_token_count_every_matrix_product_forward_and_backward():
    from bench.lm import model_flops_per_token  # pylint: disable=import-outside-toplevel
    cfg = gpt.GPTConfig(vocab_size=166, block_size=64, num_layers=2, num_heads=4,
                        num_hiddens=64)  # --task lm's model
    per_block = 4 * 2 * 64 * 64 + 2 * 2 * 64 * 256 + 2 * 2 * 64 * 64  # projections, MLP, attention
    assert model_flops_per_token(cfg) == 3 * (2 * per_block + 2 * 64 * 166) == 751872


def test_bench_profile_counts_each_ops_calls_a_training_step():
    """``python -m bench.lm --against F --profile N``: 12 dense layers, the
    tied output, and the five norms: the fused op once each, or five
    products each where it cannot be built; the attention's two products a
    block, by batch_dot (its gradients two more batch_dot each) or by
    small_batch_dot (both gradients one backward op), or the attention one
    causal_attention op a block."""
    from bench.lm import against  # pylint: disable=import-outside-toplevel
    lines = []
    result = against(gpt.__file__, num_hiddens=8, steps=2, repeats=1, warmup=1, profile=3,
                     log=lines.append)
    fused = kernels.use_fused_norm()
    for name in ('this', 'other'):
        calls = {op: per_step for op, _, _, per_step in result['top_ops'][name]}
        assert calls['FullyConnected'] == calls['_backward_FullyConnected'] == \
            12 + 1 + (0 if fused else 5 * 5)
        if fused:
            assert calls['fused_layer_norm'] == calls['_backward_fused_layer_norm'] == 5
        if kernels.use_fused_attention():
            assert calls['causal_attention'] == calls['_backward_causal_attention'] == 2
            assert 'batch_dot' not in calls
        elif kernels.use_small_batch_dot():
            assert calls['small_batch_dot'] == calls['_backward_small_batch_dot'] == 2 * 2
        else:
            assert calls['batch_dot'] == 2 * 2 * 3  # two products a block, two gradients each
        assert abs(sum(share for _, _, share, _ in result['top_ops'][name]) - 1) < 1e-6
    assert "MXNet's profiler" in lines[1] and len(lines) == 3 + 3 + 1


def test_bench_losses_times_the_step_of_each_head_against_the_first():
    from bench.lm import losses  # pylint: disable=import-outside-toplevel
    lines = []
    result = losses(['softmax', 'log_softmax'], num_hiddens=8, steps=1, repeats=2, warmup=1,
                    log=lines.append)
    assert sorted(result) == ['log_softmax', 'softmax'] and result['softmax']['cpu_ratio'] == 1
    assert all(row['cpu_ms'] > 0 and row['wall_ms'] > 0 for row in result.values())
    assert [line.split()[0] for line in lines[2:]] == ['softmax', 'log_softmax']


def test_every_norm_attention_and_adam_candidate_computes_the_same_function():
    """bench.lm_ops' candidates agree to float32 rounding; the project's Adam
    steps (updater.adam_step, updater.adam_contiguous) and one adam_update
    over one array are MXNet's Adam exactly."""
    from bench.lm_ops import run  # pylint: disable=import-outside-toplevel
    from bench.lm_ops import FUSED  # pylint: disable=import-outside-toplevel
    report = run(widths=(8,), repeats=1, warmup=1, log=lambda line: None)
    fused = {FUSED} if kernels.fused_layer_norm()[0] else set()
    assert set(report['norm'][8]) == {'LayerNorm op', 'gpt.LayerNorm', 'gamma apart', 'rsqrt',
                                      'last axis', 'InstanceNorm'} | fused
    kernel = kernels.small_batch_dot_kernel()
    small = {'products by small_batch_dot (%s)' % kernel,
             'causal_attention op (%s)' % kernel} if kernel else set()
    assert set(report['attention'][8]) == {'gpt._Attend', 'zeros_like mask', 'interleaved',
                                           'softmax temperature', 'scores by linalg.gemm'} | small
    assert set(report['q, k, v'][8]) == {'three products', 'one product'}
    assert set(report['Adam'][8]) == {'Updater, one adam_update a parameter',
                                      'updater.adam_step',
                                      'updater.adam_step, adam_update a parameter',
                                      'one adam_update over one array',
                                      'updater.adam_contiguous', 'multi_adamw, one call',
                                      'multi_adamw, one call a size'}
    assert set(report['loss'][8]) == {'SoftmaxOutput', 'SoftmaxOutput, 2-D',
                                      'log_softmax, pick, MakeLoss',
                                      'softmax out, log_softmax gradient',
                                      "the 'log_softmax' head"}
    assert report['Adam'][8]['updater.adam_step']['error'] == 0
    assert report['Adam'][8]['updater.adam_step, adam_update a parameter']['error'] == 0
    assert report['Adam'][8]['updater.adam_contiguous']['error'] == 0
    # elementwise, one learning rate: one call over views of one array is each call's result
    assert report['Adam'][8]['one adam_update over one array']['error'] == 0
    for part in report.values():
        for name, row in part[8].items():
            assert row['error'] < 1e-5 and row['ms'] > 0, name


def test_output_layer_reads_the_token_embedding_on_its_own_stage():
    pipe = mp_symbolic.Pipeline(gpt.build_blocks(TINY), 'cpu:0,cpu:1,cpu:2',
                                sample=(BATCH, TINY.block_size))
    owner, readers = pipe.tied['embed_token_weight']
    assert owner == 0 and readers == [0, 2]
    assert 'head_weight' not in pipe.collect_params()  # no second copy of the weight


# Stages over the blocks or over the graph of the whole network, tensor-parallel
# shards inside stages ('+' joins a stage's devices), micro-batches, replicas.
SPLITS = [
    ('blocks', 'cpu:0,cpu:1', 1, 1, 1),
    ('blocks', 'cpu:0,cpu:1,cpu:2', 2, 1, 1),
    ('blocks', 'cpu:0,cpu:1,cpu:2,cpu:3', 1, 2, 1),
    ('blocks', 'cpu:0,cpu:1,cpu:2,cpu:3', 2, 2, 1),
    ('whole', 'cpu:0,cpu:1', 1, 1, 1),
    ('whole', 'cpu:0,cpu:1,cpu:2', 4, 1, 1),
    ('whole', 'cpu:0,cpu:1,cpu:2,cpu:3', 2, 2, 1),
    ('blocks', 'cpu:0+cpu:1', 1, 1, 2),
    ('blocks', 'cpu:0+cpu:1,cpu:2+cpu:3', 1, 1, 2),
    ('blocks', 'cpu:0+cpu:1,cpu:2+cpu:3', 2, 1, 2),
    ('blocks', 'cpu:0+cpu:1,cpu:2', 2, 1, 2),
    ('blocks', 'cpu:0+cpu:1,cpu:2+cpu:3', 1, 2, 2),
    ('whole', 'cpu:0+cpu:1,cpu:2+cpu:3', 2, 1, 2),
]


@pytest.mark.parametrize('network,devices,chunks,replicas,shards', SPLITS)
def test_split_equals_one_device_after_one_step(one_device, network, devices, chunks, replicas,
                                               shards):
    _, init, expected_out, expected = one_device
    pipe, _, out, params = _one_step(devices, network == 'whole', chunks, replicas, init,
                                     shards)
    assert pipe.plan.num_stages == len(devices.split(',')) // replicas
    np.testing.assert_allclose(out, expected_out, rtol=TOL, atol=TOL)
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(params[name], value, rtol=TOL, atol=TOL, err_msg=name)


@pytest.mark.parametrize('devices,chunks,shards', [('cpu:0,cpu:1', 4, 1),
                                                    ('cpu:0+cpu:1,cpu:2+cpu:3', 2, 2)])
def test_the_stage_runtime_under_1f1b_takes_one_devices_step_with_the_loss_head(
        one_device, devices, chunks, shards):
    """Each micro-batch's head bound alone on the last stage, its gradient
    taken with no head gradient given (the head is a MakeLoss)."""
    _, init, expected_out, expected = one_device
    _, _, out, params = _one_step(devices, chunks=chunks, init=init, shards=shards,
                                  schedule='1f1b')
    np.testing.assert_allclose(out, expected_out, rtol=TOL, atol=TOL)
    for name, value in expected.items():
        np.testing.assert_allclose(params[name], value, rtol=TOL, atol=TOL, err_msg=name)


def test_sharded_layers_sit_on_their_stage_devices_in_halves(one_device):
    _, init, _, _ = one_device
    pipe = mp_symbolic.Pipeline(_network(False, 2), 'cpu:0+cpu:1,cpu:2+cpu:3',
                                sample=(BATCH, TINY.block_size))
    executor = _bound(pipe, init[0]).executors[0]
    C = TINY.num_hiddens
    for name, device, shape in [('block0_attention_query_shard1_weight', 1, (C // 2, C)),
                                ('block0_attention_proj_shard1_weight', 1, (C, C // 2)),
                                ('block1_fc_shard0_weight', 2, (2 * C, C)),
                                ('block1_out_shard1_weight', 3, (C, 2 * C)),
                                ('embed_token_shard1_weight', 1, (11, C))]:
        assert executor.arg_dict[name].context == mx.cpu(device), name
        assert executor.arg_dict[name].shape == shape, name
    # the attention and the MLP read each shard's heads and units where they are
    ops = [n['op'] for n in json.loads(pipe.symbol().tojson())['nodes']]
    assert 'slice_axis' not in ops and ops.count('Concat') == 1  # the logits' gather


def test_checkpoint_of_a_sharded_run_loads_into_one_device_by_name_and_computes_the_same(
        one_device, tmp_path):
    from mp_symbolic.tools.checkpoint import read_checkpoint, save_checkpoint
    _, init, _, _ = one_device
    X, y = _batch()
    pipe = mp_symbolic.Pipeline(_network(False, 2), 'cpu:0+cpu:1,cpu:2+cpu:3',
                                sample=(BATCH, TINY.block_size))
    sharded = _bound(pipe, init[0])
    sharded.forward_backward(mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)]))
    sharded.update()   # parameters the one-device module has never seen
    save_checkpoint(sharded, str(tmp_path), epoch=1)
    _, saved, _ = read_checkpoint(str(tmp_path)).load()
    assert sorted(saved) == sorted(init[0])   # the unsplit names
    assert saved['embed_token_weight'].shape == (TINY.vocab_size, TINY.num_hiddens)
    one = _bound(mp_symbolic.Pipeline(_network(False), 'cpu:0',
                                      sample=(BATCH, TINY.block_size)), saved)
    X2, y2 = _batch(seed=1)
    batch = mx.io.DataBatch([mx.nd.array(X2)], [mx.nd.array(y2)])
    outputs = []
    for mod in (sharded, one):
        mod.forward(batch, is_train=False)
        outputs.append(mod.get_outputs()[0].asnumpy())
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=TOL, atol=TOL)


def test_sharded_network_starts_from_the_unsharded_networks_initial_values(one_device):
    _, init, _, _ = one_device
    pipe = mp_symbolic.Pipeline(_network(False, 2), 'cpu:0+cpu:1',
                                sample=(BATCH, TINY.block_size))
    arg, _ = loop.initial_values(pipe, seed=0)
    assert 'embed_token_shard1_weight' in arg
    gathered = pipe.gather_params(arg)   # shards joined as NDArrays, the rest as they were
    assert sorted(gathered) == sorted(init[0])
    for name, value in init[0].items():
        whole = gathered[name]
        whole = whole.asnumpy() if isinstance(whole, mx.nd.NDArray) else whole
        np.testing.assert_array_equal(whole, value, err_msg=name)


@pytest.mark.parametrize('args, message', [
    (dict(shards=3), r'shards: expected a divisor of num_heads \(4\), found 3'),
    (dict(shards=0), 'shards: expected a positive integer, found 0'),
])
def test_shard_count_that_cannot_split_the_heads_raises(args, message):
    with pytest.raises(ValueError, match=message):
        lm.task(**args)


@pytest.mark.parametrize('arg, message', [
    ('num_layers=100000', '--task-arg num_layers: expected a positive integer at most 128, '
                          'found 100000'),
    ('num_hiddens=1000000', '--task-arg num_hiddens: expected a positive integer at most 4096, '
                            'found 1000000'),
    ('warmup=1', '--task-arg warmup: expected a number from 0 to 1 (1 excluded), found 1'),
    ('lr_end=-0.5', '--task-arg lr_end: expected a number from 0 to 1, found -0.5'),
], ids=['num_layers', 'num_hiddens', 'warmup', 'lr_end'])
def test_a_model_or_schedule_out_of_range_is_refused_in_one_line_before_any_work(
        tmp_path, capsys, arg, message):
    """100,000 blocks took minutes to build before any line; a width of 10^6
    ended in MXNet's 2^31-element check, a traceback, after the corpus."""
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    from conftest import cli_status  # pylint: disable=import-outside-toplevel
    capsys.readouterr()
    status = cli_status(cli.main, ['train', '--task', 'lm', '--task-arg', arg, '--out',
                                   str(tmp_path / 'out'), '--no-progress', '--no-memory'])
    assert status == 2
    assert capsys.readouterr().err == 'error: %s\n' % message
    assert not (tmp_path / 'out').exists()


def test_learning_rate_rises_over_the_warmup_and_ends_at_lr_end_at_the_runs_last_step():
    # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.symbolic import create_optimizer
    task = lm.task(**dict(SHORT_RUN, warmup=0.25, lr_end=0.1))
    cfg = TrainConfig(task='lm', num_epochs=2, batch_size=16, lr=0.01).with_task(task)
    steps = 2 * ((SHORT_RUN['train_chars'] // SHORT_RUN['block_size']) // 16)   # 2 x 128
    schedule = create_optimizer(cfg, task=task).lr_scheduler
    assert schedule.max_update == steps and schedule.warmup_steps == steps // 4
    assert schedule(steps // 8) == pytest.approx(0.005)          # half way up
    assert schedule(steps // 4) == pytest.approx(0.01)           # the top
    assert 0.001 < schedule(steps - 1) < schedule(steps // 2) < 0.01
    assert schedule(steps) == pytest.approx(0.001)               # lr_end x lr
    assert lm.task(**dict(SHORT_RUN, warmup=0, lr_end=1)).lr_schedule is None   # lr held


class _Counted(mx.lr_scheduler.LRScheduler):
    """The learning rate held, each update the optimizer asked it for noted."""

    def __init__(self, base_lr, steps):
        super().__init__(base_lr)
        self.steps, self.asked = steps, set()

    def __call__(self, num_update):
        self.asked.add(num_update)
        return self.base_lr


@pytest.mark.parametrize('variant,api', [('symbolic', 'module'), ('symbolic', 'executor'),
                                         ('imperative', 'module')])
def test_every_variant_updates_at_the_learning_rate_of_the_tasks_schedule(variant, api):
    made = []

    def schedule(lr, steps):
        made.append(_Counted(lr, steps))
        return made[-1]

    cfg = TrainConfig(task='lm', task_args=tuple(dict(SHORT_RUN, train_chars=4096).items()),
                      devices='cpu:0,cpu:1', num_epochs=2, variant=variant, api=api,
                      progress=False, batch_size=16, lr=0.01, out=None)
    task, cfg = loop.load(cfg)
    task = dataclasses.replace(task, lr_schedule=schedule)
    pipe, _ = loop.build_pipeline(cfg, task)
    stepper = loop.make_stepper(cfg, pipe, task, loop.initial_values(pipe, cfg.seed),
                                task.label_shape, None)
    loop.fit(stepper, *task.data()[:2], cfg, log=lambda line: None)
    assert len(made) == 1 and made[0].steps == 2 * (4096 // 32 // 16)   # 2 epochs of 8 steps
    assert made[0].asked >= set(range(1, made[0].steps + 1))


def _train(out, devices, num_epochs, resume=None, **task_args):
    args = dict(SHORT_RUN, **task_args)
    cfg = TrainConfig(task='lm', task_args=tuple(args.items()), devices=devices,
                      num_epochs=num_epochs, out=None if resume else str(out), resume=resume,
                      progress=False, batch_size=16, lr=0.01, checkpoint_every=1)
    return loop.train(cfg, log=lambda line: None)


class _Stopped(Exception):
    """Ends a run after its first epoch's checkpoint."""


@pytest.fixture(scope='module')
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('lm') / 'short'
    return out, _train(out, 'cpu:0,cpu:1', 2)


def test_short_run_learns_from_the_context(short_run):
    _, result = short_run
    assert result.metrics['val_bits_per_char'] < SHORT_RUN_BOUND
    assert result.metrics['baseline'].startswith('add-k 4-gram, k=')
    assert len(result.metrics['vocabulary']) > 90


def test_resume_onto_another_plan_equals_an_uninterrupted_run(short_run, tmp_path,
                                                               monkeypatch):
    """A 2-epoch run on three stages, stopped after its first epoch's
    checkpoint, resumed on one device: the learning rate's schedule over the
    two epochs goes on from the checkpoint's update count."""
    _, straight = short_run
    first = tmp_path / 'resumed'
    fit = loop.fit

    def stopped(*args):
        def on_epoch(epoch, loss):
            args[-1](epoch, loss)
            raise _Stopped
        return fit(*args[:-1], on_epoch)

    monkeypatch.setattr(loop, 'fit', stopped)
    with pytest.raises(_Stopped):
        _train(first, 'cpu:0,cpu:1,cpu:2', 2)
    monkeypatch.setattr(loop, 'fit', fit)
    resumed = _train(None, 'cpu:0', 2, resume=str(first))
    for name, value in straight.params.items():
        np.testing.assert_allclose(resumed.params[name], value, rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_ngram_baseline_probabilities_sum_to_one():
    ids = np.random.default_rng(0).integers(0, 5, 500)
    model = lm.NGram(ids, 3, 5)
    history = np.array([1, 2])
    total = sum(2 ** -model.bits(np.append(history, c), [2], 0.1) for c in range(5))
    assert abs(total - 1) < 1e-9


@pytest.fixture(scope='module')
def exported(short_run, tmp_path_factory):
    out, _ = short_run
    export_dir = tmp_path_factory.mktemp('lm') / 'export'
    result = subprocess.run([sys.executable, '-m', 'export', '--checkpoint', str(out), '--out',
                             str(export_dir), '--dynamic', '1=seq'], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return out, export_dir / 'current'


def test_onnx_has_dynamic_batch_and_sequence_and_matches_the_checkpoint(exported):
    _, folder = exported
    report = json.loads((folder / 'lm-verification.json').read_text())
    assert report['ok'] and report['dynamic_axes'] == [1]
    assert {tuple(row['shape']) for row in report['parity']} >= {(1, 1), (7, 17), (64, 32)}
    model = onnx.load(str(folder / 'lm.onnx'))
    dims = [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (model.graph.input[0], model.graph.output[0])]
    assert dims[0] == ['batch', 'seq'] and dims[1][:2] == ['batch', 'seq']


def test_sampling_from_onnx_equals_sampling_from_the_checkpoint(exported):
    checkpoint, folder = exported
    from_checkpoint, from_onnx = MXNetModel(str(checkpoint)), OnnxModel(str(folder / 'lm.onnx'))
    vocab = from_checkpoint.summary['vocabulary']
    text = sample(from_checkpoint, vocab, 'def ', 40, temperature=0.8, seed=3)
    assert sample(from_onnx, vocab, 'def ', 40, temperature=0.8, seed=3) == text
    assert text.startswith('def ') and len(text) == 44
    assert sample(from_checkpoint, vocab, 'def ', 40, temperature=0.8, seed=4) != text


def test_sampling_a_prompt_outside_the_vocabulary_is_refused(exported):
    checkpoint, _ = exported
    model = MXNetModel(str(checkpoint))
    with pytest.raises(ValueError, match='--prompt: expected characters of the model'):
        sample(model, model.summary['vocabulary'], 'def \x00', 5)


def test_sample_command_prints_the_prompt_and_its_continuation(exported):
    checkpoint, _ = exported
    result = subprocess.run([sys.executable, '-m', 'mp_symbolic.training.sample', '--checkpoint',
                             str(checkpoint), '--prompt', 'import ', '--length', '30', '--seed',
                             '1'], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('import ') and len(result.stdout) == len('import ') + 31


BAD_DYNAMIC = [
    ('3=seq', '--dynamic: expected an input axis from 1 to 1 (axis 0 is the batch), found 3'),
    ('1=batch', "--dynamic: expected a distinct name other than 'batch' for axis 1"),
    ('seq', "--dynamic: expected AXIS=NAME such as 1=seq, found 'seq'"),
]


@pytest.mark.parametrize('flag, message', BAD_DYNAMIC)
def test_bad_dynamic_axis_is_one_line(exported, tmp_path, capsys, flag, message):
    checkpoint, _ = exported
    argv = ['--checkpoint', str(checkpoint), '--out', str(tmp_path / 'out'), '--dynamic', flag]
    if flag == BAD_DYNAMIC[0][0]:  # one case end to end, as a user runs it
        result = subprocess.run([sys.executable, '-m', 'export'] + argv, cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        status, stderr = result.returncode, result.stderr
    else:  # the same main() in this process, without MXNet's start
        from export.__main__ import main  # pylint: disable=import-outside-toplevel
        capsys.readouterr()
        status, stderr = main(argv), capsys.readouterr().err
    assert status == 2
    assert stderr.count('\n') == 1 and message in stderr, stderr


@pytest.mark.parametrize('loss', ['softmax', 'log_softmax'])
@pytest.mark.parametrize('shape', [(4, 5), (2, 3, 5)])
def test_softmax_head_is_softmax_cross_entropy_over_the_last_axis(shape, loss):
    from mp_symbolic.core.graph.heads import make_head
    head = make_head(loss, mx.sym.var('data'), mx.sym.var('softmax_label'))
    rng = np.random.default_rng(0)
    X = rng.normal(size=shape).astype(np.float32)
    y = rng.integers(0, shape[-1], shape[:-1]).astype(np.float32)
    exe = head.simple_bind(mx.cpu(), data=shape, softmax_label=y.shape)
    exe.forward(is_train=True, data=X, softmax_label=y)
    exe.backward()
    probs = np.exp(X - X.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(exe.outputs[0].asnumpy(), probs, rtol=1e-5, atol=1e-6)
    # the gradient of the summed cross-entropy of every position: p - onehot(y)
    onehot = np.eye(shape[-1])[y.astype(int)]
    np.testing.assert_allclose(exe.grad_dict['data'].asnumpy(), probs - onehot, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize('devices,shards', [('cpu:0,cpu:1', 1),
                                             ('cpu:0+cpu:1,cpu:2+cpu:3', 2)])
def test_imperative_twin_takes_the_step_of_the_symbolic_graph(one_device, devices, shards):
    from mxnet import autograd
    from mp_symbolic.core.graph.heads import gluon_loss
    _, init, _, expected = one_device
    pipe = mp_symbolic.Pipeline(_network(False, shards), devices,
                                sample=(BATCH, TINY.block_size))
    pipe.set_params(init[0], {})
    trainer = mp_symbolic.Trainer(pipe.collect_params(),
                                  mx.optimizer.create('sgd', learning_rate=1.0, rescale_grad=1.0))
    X, y = _batch()
    with autograd.record():  # the label on the last stage's device, where the output is
        loss = gluon_loss(lm.LOSS)(pipe(mx.nd.array(X, ctx=mx.cpu(0))),
                                     mx.nd.array(y, ctx=pipe.plan.last_device))
    loss.backward()
    trainer.step(BATCH)
    params = {n: p.data(p.list_ctx()[0]) for n, p in pipe.collect_params().items()}
    for name, value in pipe.gather_params(params).items():
        np.testing.assert_allclose(value.asnumpy(), expected[name], rtol=TOL, atol=TOL,
                                   err_msg=name)


def test_the_language_model_trains_with_its_embeddings_stage_recomputed(tmp_path, capsys):
    """`--schedule interleaved --mirror` puts the Embedding alone in a mirrored
    stage: MXNet cannot recompute it, and the run ended in its traceback
    ("req[embedding::kOut] == kWriteTo"); the stage now keeps its output."""
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    from conftest import cli_status  # pylint: disable=import-outside-toplevel
    status = cli_status(cli.main, [
        'train', '--task', 'lm', '--schedule', 'interleaved', '--mirror', '--chunks', '2',
        '--devices', 'cpu:0,cpu:1', '--epochs', '1', '--out', str(tmp_path / 'out'),
        '--no-progress', '--no-memory', '--task-arg', 'train_chars=4096',
        '--task-arg', 'val_chars=2048', '--task-arg', 'block_size=16'])
    assert status == 0, capsys.readouterr().err
    assert 'parameters sha256' in capsys.readouterr().out


@pytest.mark.parametrize('devices,replicas', [('cpu:0,cpu:1', 1), ('cpu:0,cpu:1,cpu:2,cpu:3', 2)])
def test_module_updates_each_devices_parameters_in_one_adam_update(one_device, monkeypatch,
                                                                   devices, replicas):
    """The model's trained parameters on each device of each replica are
    views of one array, their gradients of another: an Adam step (after
    the first, which makes the moments) is one adam_update a device of a
    replica, and never Adam.update."""
    from mp_symbolic.core.optim import updater  # pylint: disable=import-outside-toplevel
    _, init, _, _ = one_device
    monkeypatch.setenv('MP_SYMBOLIC_CONTIGUOUS', '1')  # opt-in
    pipe = mp_symbolic.Pipeline(_network(False), devices, sample=(BATCH, TINY.block_size),
                                replicas=replicas)
    mod = _bound(pipe, init[0], replicas)
    mod.init_optimizer(kvstore='local' if replicas > 1 else None, optimizer='adam',
                       optimizer_params={'learning_rate': 3e-3}, force_init=True)
    X, y = _batch()
    batch = mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)])
    mod.forward_backward(batch)
    mod.update()
    calls = []
    invoke = updater._imperative_invoke   # pylint: disable=protected-access
    monkeypatch.setattr(updater, '_imperative_invoke', lambda *a: calls.append(a) or invoke(*a))
    monkeypatch.setattr(mx.optimizer.Adam, 'update', lambda *a: calls.append('Adam.update'))
    mod.forward_backward(batch)
    mod.update()
    flats = mod._exec_group.contiguous   # pylint: disable=protected-access
    assert len(flats) == 2 * replicas   # two stages a replica
    assert sum(len(f.names) for f in flats) == \
        replicas * len(mod._exec_group.param_names)   # pylint: disable=protected-access
    assert len(calls) == len(flats)
    assert all(call[1][0] is flat.weight for call, flat in zip(calls, flats))


def test_views_follow_a_learning_rate_schedule_as_arrays_of_their_own(one_device, monkeypatch):
    """Three Adam steps under a warmup and a cosine on two stages: with the
    parameters as views (one adam_update a device, never adam_step nor
    Adam.update) every parameter ends as without them, to the bit."""
    from mp_symbolic.core.optim import updater  # pylint: disable=import-outside-toplevel
    _, init, _, _ = one_device
    X, y = _batch()
    batch = mx.io.DataBatch([mx.nd.array(X)], [mx.nd.array(y)])

    def trained():
        pipe = mp_symbolic.Pipeline(_network(False), 'cpu:0,cpu:1',
                                    sample=(BATCH, TINY.block_size))
        mod = _bound(pipe, init[0])
        schedule = mx.lr_scheduler.CosineScheduler(3, base_lr=3e-3, final_lr=3e-4,
                                                   warmup_steps=1)
        mod.init_optimizer(optimizer='adam', force_init=True,
                           optimizer_params={'learning_rate': 3e-3, 'lr_scheduler': schedule})
        for _ in range(3):
            mod.forward_backward(batch)
            mod.update()
        return {n: a.asnumpy() for n, a in mod.get_params()[0].items()}

    monkeypatch.delenv('MP_SYMBOLIC_CONTIGUOUS', raising=False)
    off = trained()
    monkeypatch.setenv('MP_SYMBOLIC_CONTIGUOUS', '1')
    monkeypatch.setattr(updater, 'adam_step', lambda *a: pytest.fail('adam_step'))
    monkeypatch.setattr(mx.optimizer.Adam, 'update', lambda *a: pytest.fail('Adam.update'))
    on = trained()
    assert sorted(on) == sorted(off)
    for name, value in off.items():
        np.testing.assert_array_equal(on[name], value, err_msg=name)
