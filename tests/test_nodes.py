"""Stages on several node processes (``Pipeline(..., nodes=N)``), on
127.0.0.1: each node holds only its stages, and the job computes what one
process computes, under every schedule, with micro-batches, replicas,
tensor-parallel shards and a whole network's cut; a plan that cannot run
is refused in one line before any node waits on another."""
import os
import subprocess
import sys

import numpy as np
import pytest

from mp_symbolic import Pipeline
from mp_symbolic.core import nodes as node_processes
from mp_symbolic.training.tasks import gpt, lm

import nodes_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, 'tests', 'nodes_worker.py')


def node_env(rank, count, port, **more):
    """The rendezvous of node ``rank`` of ``count`` on 127.0.0.1."""
    return dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0', MASTER_ADDR='127.0.0.1',
                MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(count), **more)


def run_nodes(tmp_path, port, count, argv, timeout=300):
    """Runs ``nodes_worker.py`` as ``count`` node processes; returns every
    array they hold, by name (asserting no two nodes hold the same one),
    and each node's names."""
    out = str(tmp_path / 'node')
    procs = [subprocess.Popen([sys.executable, WORKER, '--out', out, '--nodes', str(count)]
                              + argv, env=node_env(rank, count, port), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(count)]
    try:
        ended = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, ended):
        assert p.returncode == 0, err[-3000:]
    held, names = {}, []
    for rank in range(count):
        with np.load('%s%d.npz' % (out, rank)) as data:
            mine = dict(data)
        assert not set(mine) & set(held), sorted(set(mine) & set(held))
        names.append(set(mine))
        held.update(mine)
    return held, names


# (devices, schedule, micro-batches, replicas, shards, whole network, virtual)
TABLE = [
    ('cpu:0,cpu:1', '1f1b', 2, 1, 1, False, None),
    ('cpu:0,cpu:1,cpu:2', 'gpipe', 4, 1, 1, False, None),
    ('cpu:0,cpu:1,cpu:2,cpu:3', '1f1b', 2, 2, 1, False, None),
    ('cpu:0+cpu:1,cpu:2+cpu:3', '1f1b', 2, 1, 2, False, None),
    ('cpu:0,cpu:1,cpu:2', 'gpipe', 2, 1, 1, True, None),
    ('cpu:0,cpu:1', 'interleaved', 4, 1, 1, False, 2),
]


@pytest.mark.parametrize('devices, schedule, chunks, replicas, shards, whole, virtual', TABLE)
def test_two_nodes_compute_what_one_process_computes_after_three_adam_steps(
        tmp_path, port, devices, schedule, chunks, replicas, shards, whole, virtual):
    argv = ['--devices', devices, '--schedule', schedule, '--chunks', str(chunks),
            '--replicas', str(replicas), '--shards', str(shards)] + \
        (['--whole'] if whole else []) + (['--virtual', str(virtual)] if virtual else [])
    held, names = run_nodes(tmp_path, port, 2, argv)
    expected, outputs = nodes_worker.train(devices, 1, chunks, replicas, schedule, 3, shards,
                                           whole, virtual=virtual)
    expected['outputs'] = outputs
    # every parameter and optimizer state once, on the node of its stage
    assert sorted(held) == sorted(expected)
    assert all(any(k.startswith('param:') for k in mine) for mine in names)
    for name, value in expected.items():
        # the cross-node copies change no bit; GPipe's one graph of every
        # micro-batch sums the gradients in another order than the stages
        tolerance = 0 if schedule != 'gpipe' else 1e-5
        np.testing.assert_allclose(held[name], value, rtol=tolerance, atol=tolerance,
                                   err_msg=name)


def _net():
    return gpt.build_blocks(nodes_worker.TINY, lm.sharded_layers(1))


SAMPLE = (8, nodes_worker.TINY.block_size)


@pytest.mark.parametrize('environ, message', [
    ({}, r'^nodes: expected a rendezvous for 2 node processes \(MASTER_ADDR, MASTER_PORT, RANK '
         r'and WORLD_SIZE, as torchrun and python -m mp_symbolic launch --nodes set them\), '
         r'found MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE unset$'),
    (dict(MASTER_ADDR='127.0.0.1', MASTER_PORT='1', RANK='0', WORLD_SIZE='3'),
     r'^nodes: expected a job of 2 node processes, found WORLD_SIZE=3'),
    (dict(MASTER_ADDR='127.0.0.1', MASTER_PORT='1', RANK='2', WORLD_SIZE='2'),
     r'^nodes: expected RANK below WORLD_SIZE=2, found 2$'),
    (dict(MASTER_ADDR='127.0.0.1', MASTER_PORT='x', RANK='0', WORLD_SIZE='2'),
     r"^nodes: expected MASTER_PORT to be a number, found 'x'$"),
])
def test_nodes_without_a_rendezvous_are_refused_in_one_line(monkeypatch, environ, message):
    for name in node_processes.RENDEZVOUS:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(node_processes.NodeError, match=message):
        Pipeline(_net(), 'cpu:0,cpu:1', sample=SAMPLE, nodes=2)


@pytest.mark.parametrize('kwargs, message', [
    (dict(devices='cpu:0,cpu:1', nodes=3),
     r'^nodes: expected at most as many nodes as devices per replica \(2\), found 3 \(a node '
     r'would hold no stage\)$'),
    (dict(devices='cpu:0,cpu:0,cpu:1', nodes=2),
     r'^node 0: expected each device once, found cpu:0 twice in cpu:0,cpu:0$'),
    (dict(devices='cpu:0,cpu:1', nodes=2, balance='time'),
     r"^balance: expected blocks per stage or None with nodes"),
    (dict(devices='cpu:0,cpu:1', nodes=2, node_timeout=0),
     r'^node_timeout: expected a positive number of seconds, found 0$'),
])
def test_a_node_plan_that_cannot_run_is_refused_in_one_line_before_any_node_waits(
        monkeypatch, kwargs, message):
    # a rendezvous nobody listens on: a refusal must come before any wait for it
    for name, value in dict(MASTER_ADDR='127.0.0.1', MASTER_PORT='9', RANK='0',
                            WORLD_SIZE=str(kwargs['nodes'])).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        Pipeline(_net(), sample=SAMPLE, **kwargs)


def test_a_device_of_one_node_may_be_listed_again_for_another():
    """``gpu:0`` on node 1 is node 1's GPU: the plan's devices repeat per
    node, each replica's divided evenly in order."""
    from mp_symbolic.core.placement import place  # pylint: disable=import-outside-toplevel
    assert node_processes.node_of_devices(3, 2) == (0, 0, 1)
    nodes = node_processes.Nodes(2, 1, 60.0, '127.0.0.1:9')
    placed = place(tuple(_net()), False, 'cpu:0,cpu:1,cpu:0,cpu:1', sample=SAMPLE, replicas=1,
                   nodes=nodes)
    assert placed.plan.node_of_stage == (0, 0, 1, 1)
    assert placed.plan.stages_of_node(1) == (2, 3)
    # a GPU of another node need not be here; one of this node must
    placed = place(tuple(_net()), False, 'gpu:0,cpu:1', sample=SAMPLE,
                   nodes=node_processes.Nodes(2, 1, 60.0, '127.0.0.1:9'))
    assert placed.plan.node_of_stage == (0, 1)
    with pytest.raises(ValueError, match=r'^node 1: gpu:0 requested but MXNet sees 0 GPU'):
        place(tuple(_net()), False, 'cpu:1,gpu:0', sample=SAMPLE,
              nodes=node_processes.Nodes(2, 1, 60.0, '127.0.0.1:9'))


def test_a_pipeline_of_one_process_never_imports_torch():
    code = '''
import sys
import mxnet as mx
from mp_symbolic import Pipeline
from mp_symbolic.training.tasks import gpt, lm
from tests.nodes_worker import TINY, batch
pipe = Pipeline(gpt.build_blocks(TINY, lm.sharded_layers(1)), 'cpu:0,cpu:1', chunks=2,
                sample=(8, TINY.block_size), schedule='1f1b')
mod = pipe.module(loss='softmax')
mod.bind([('data', (8, TINY.block_size))], [('softmax_label', (8, TINY.block_size))])
mod.init_params(mx.init.Xavier())
mod.init_optimizer(optimizer='adam')
mod.forward_backward(batch(0, 8))
mod.update()
print('torch' in sys.modules)
'''
    result = subprocess.run([sys.executable, '-c', code], env=dict(os.environ, PYTHONPATH=ROOT),
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == 'False', result.stderr[-2000:]


def test_the_makefile_installs_the_torch_the_nodes_extra_pins():
    import re  # pylint: disable=import-outside-toplevel
    with open(os.path.join(ROOT, 'Makefile')) as f:
        makefile = re.search(r'^TORCH := (\S+)$', f.read(), re.M).group(1)
    with open(os.path.join(ROOT, 'pyproject.toml')) as f:
        extra = re.search(r'^nodes = \["([^"]+)"\]$', f.read(), re.M).group(1)
    assert makefile == extra == 'torch==2.13.0'
