"""Stages on several node processes (``Pipeline(..., nodes=N)``), on
127.0.0.1: each node holds only its stages, and the job computes what one
process computes, under every schedule, with micro-batches, replicas,
tensor-parallel shards and a whole network's cut; a plan that cannot run
is refused in one line before any node waits on another."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mp_symbolic import Pipeline
from mp_symbolic.core.transport import nodes as node_processes
from mp_symbolic.training.tasks import gpt, lm

import nodes_worker
from conftest import node_env, reserved_port, run_node_workers
from tests.killpoints import killed_points

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, 'tests', 'nodes_worker.py')


def run_nodes(folder, port, count, table, timeout=300):
    """Runs ``nodes_worker.py`` as ``count`` node processes over every
    configuration of ``table`` (dicts of ``nodes_worker.train``'s keywords);
    returns per configuration every array they hold, by name (asserting no
    two nodes hold the same one, but the last batch's outputs and what
    ``every:`` names, which every node holds alike), and each node's names."""
    out = os.path.join(folder, 'node')
    run_node_workers(WORKER, out, count, port, table, timeout)
    results = []
    for k in range(len(table)):
        held, names = {}, []
        alike = []  # {name: array} of each node, of the arrays every node holds
        for rank in range(count):
            with np.load('%s%d_%d.npz' % (out, k, rank)) as data:
                mine = dict(data)
            alike.append({n: mine.pop(n) for n in list(mine)
                          if n == 'outputs' or n.startswith('every:')})
            assert not set(mine) & set(held), sorted(set(mine) & set(held))
            names.append(set(mine))
            held.update(mine)
        assert 'outputs' in alike[0] and all(sorted(a) == sorted(alike[0]) for a in alike), \
            [sorted(a) for a in alike]
        for rank, theirs in enumerate(alike[1:], 1):
            for name, value in theirs.items():
                np.testing.assert_array_equal(value, alike[0][name],
                                              err_msg='%s of node %d' % (name, rank))
        held.update(alike[0])
        results.append((held, names))
    return results


# (devices, schedule, micro-batches, replicas, shards, whole network, virtual)
TABLE = [
    dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2),
    dict(devices='cpu:0,cpu:1,cpu:2', schedule='gpipe', chunks=4),
    dict(devices='cpu:0,cpu:1,cpu:2,cpu:3', schedule='1f1b', chunks=2, replicas=2),
    dict(devices='cpu:0+cpu:1,cpu:2+cpu:3', schedule='1f1b', chunks=2, shards=2),
    dict(devices='cpu:0,cpu:1,cpu:2', schedule='gpipe', chunks=2, whole=True),
    dict(devices='cpu:0,cpu:1', schedule='interleaved', chunks=4, virtual=2),
]


@pytest.fixture(scope='module')
def node_job(tmp_path_factory):
    """Every configuration of :data:`TABLE`, :data:`ZOO` and :data:`TIED`
    (with what each node sent), then :data:`DEFERRED`, in that order,
    trained by one job of two node processes (the first saved by both with
    ``mp_symbolic.save_checkpoint``): one start of two nodes for all four
    tables. Returns :func:`run_nodes`'s results and the saved folder."""
    folder = str(tmp_path_factory.mktemp('nodes'))
    table = [dict(TABLE[0], save=os.path.join(folder, 'saved'))] + TABLE[1:] + ZOO + \
        [dict(config, stats=True) for config, _ in TIED] + [DEFERRED]
    with reserved_port() as port:
        return run_nodes(folder, port, 2, table, timeout=900), os.path.join(folder, 'saved')


@pytest.fixture(scope='module')
def two_nodes(node_job):
    """:data:`TABLE`'s results of :func:`node_job`, and the saved folder."""
    return node_job[0][:len(TABLE)], node_job[1]


@pytest.mark.parametrize('k', range(len(TABLE)),
                         ids=['-'.join('%s=%s' % i for i in c.items()) for c in TABLE])
def test_two_nodes_compute_what_one_process_computes_after_three_adam_steps(two_nodes, k):
    held, names = two_nodes[0][k]
    expected, outputs = nodes_worker.train(**TABLE[k])
    expected['outputs'] = outputs
    # every parameter and optimizer state once, on the node of its stage
    assert sorted(held) == sorted(expected)
    assert all(any(key.startswith('param:') for key in mine) for mine in names)
    for name, value in expected.items():
        # the cross-node copies change no bit; GPipe's one graph of every
        # micro-batch (the reference in one process) sums the gradients in
        # another order than the stages
        tolerance = 0 if TABLE[k]['schedule'] != 'gpipe' else 1e-5
        np.testing.assert_allclose(held[name], value, rtol=tolerance, atol=tolerance,
                                   err_msg=name)


def test_save_checkpoint_on_every_node_commits_one_part_per_node_each_reads_back_its_own(
        two_nodes):
    """Each node's part holds its stages' arrays and states, no node reads
    another's; read back whole (one array at a time) they are the model."""
    from mp_symbolic import read_checkpoint  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.base.parts import npz_index  # pylint: disable=import-outside-toplevel
    held, names = two_nodes[0][0]
    checkpoint = read_checkpoint(two_nodes[1])
    _, arg, aux = checkpoint.load()
    params = {k[len('param:'):]: v for k, v in held.items() if k.startswith('param:')}
    assert sorted(dict(arg, **aux)) == sorted(params)
    for name, value in dict(arg, **aux).items():
        np.testing.assert_array_equal(value.asnumpy(), params[name], err_msg=name)
    states = checkpoint.load_states()
    assert sorted(states['params']) == sorted(k[len('count:'):] for k in held
                                              if k.startswith('count:'))
    assert sorted(checkpoint.summary['parameters']) == sorted(params)  # every node's named
    assert [os.path.basename(p) for p in checkpoint.part_paths] == ['lm-0003-node0.npz',
                                                                    'lm-0003-node1.npz']
    for rank, path in enumerate(checkpoint.part_paths):
        own = {k[len('param:'):] for k in names[rank] if k.startswith('param:')}
        stored = {k[4:] for k in npz_index(path) if k.startswith(('arg:', 'aux:'))}
        assert stored == own, rank  # the node's own arrays, whole
        with open('%s-read-node%d.json' % (two_nodes[1], rank)) as f:
            read = json.load(f)  # PipelineModule.restore on that node
        arrays = [k[4:] for k in read if k.startswith(('arg:', 'aux:'))]
        assert sorted(arrays) == sorted(own), rank  # each of its own once, no other
        # of the other node's part, its optimizer state's fields (JSON) alone
        assert len([k for k in read if k.startswith('state:')]) == \
            sum(len(e['state'].get('items', [e['state']])) for n, e in states['params'].items()
                if n in own), rank


# GluonCV networks of random weights on 32x32 images, cut whole: their
# convolutions hand oneDNN's own layouts to the transport, their BatchNorms
# update running statistics in the backward pass
ZOO = [dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2, network='resnet18_v1b',
            evaluate=True),
       dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2, network='vgg11_bn')]


@pytest.fixture(scope='module')
def zoo_nodes(node_job):
    """:data:`ZOO`'s results of :func:`node_job`."""
    return node_job[0][len(TABLE):len(TABLE) + len(ZOO)]


@pytest.mark.slow
@pytest.mark.parametrize('k', range(len(ZOO)), ids=[c['network'] for c in ZOO])
def test_gluoncv_networks_over_two_nodes_hold_one_process_values_running_statistics_included(
        zoo_nodes, k):
    """Three Adam steps under 1F1B, a network cut whole: the parameters,
    running statistics, optimizer states and outputs equal one process's
    bit for bit; every node reads the outputs, and ResNet's ``predict``
    and ``score`` after (:func:`run_nodes` asserts them alike on every
    node)."""
    held, names = zoo_nodes[k]
    expected, outputs = nodes_worker.train(**ZOO[k])
    expected['outputs'] = outputs
    assert sorted(held) == sorted(expected)
    assert all(any(key.startswith('param:') for key in mine) for mine in names)
    assert any('running_mean' in key for key in names[0])
    for name, value in expected.items():
        np.testing.assert_array_equal(held[name], value, err_msg=name)


# (devices, schedule, micro-batches, replicas, whole network, virtual), each
# with the boundary tensors each node sends per micro-batch beside the tie
TIED = [
    (dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2), 1),
    (dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=4), 1),
    (dict(devices='cpu:0,cpu:1', schedule='stage-gpipe', chunks=4), 1),
    (dict(devices='cpu:0,cpu:1,cpu:2,cpu:3', schedule='1f1b', chunks=4, replicas=2), 1),
    # the whole GPT in 4 stages on 2 devices: the tie crosses stages 0 and 3
    (dict(devices='cpu:0,cpu:1', schedule='interleaved', chunks=4, virtual=2, whole=True), 3),
]
SAMPLE_BYTES = nodes_worker.TINY.block_size * nodes_worker.TINY.num_hiddens * 4  # a sequence's
# activation; the token embedding the output layer reads:
TIED_BYTES = nodes_worker.TINY.vocab_size * nodes_worker.TINY.num_hiddens * 4


@pytest.fixture(scope='module')
def tied_nodes(node_job):
    """:data:`TIED`'s results of :func:`node_job`, with what each node sent."""
    return node_job[0][len(TABLE) + len(ZOO):len(TABLE) + len(ZOO) + len(TIED)]


@pytest.mark.parametrize('k', range(len(TIED)),
                         ids=['-'.join('%s=%s' % i for i in c.items()) for c, _ in TIED])
def test_a_tied_weight_crosses_nodes_once_per_step_each_way_and_ends_as_in_one_process(
        tied_nodes, k):
    """The language model's token embedding (first stage) tied to its output
    layer (last stage, on the other node): per step each node sends the
    activations (or their gradients) of every micro-batch and the tie once
    per replica (the weight one way, its gradients' sum the other), however
    many micro-batches; after three Adam steps every array equals one
    process's bit for bit."""
    config, crossings = TIED[k]
    held, _ = tied_nodes[k]
    steps, replicas = 3, config.get('replicas', 1)
    for rank in range(2):
        sent = held.pop('stats:%d:sent' % rank) // steps
        sent_bytes = held.pop('stats:%d:sent_bytes' % rank) // steps
        assert sent == replicas * (config['chunks'] * crossings + 1), (rank, sent)
        assert sent_bytes == crossings * 8 * SAMPLE_BYTES + replicas * TIED_BYTES, \
            (rank, sent_bytes)
    expected, outputs = nodes_worker.train(**config)
    expected['outputs'] = outputs
    assert sorted(held) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(held[name], value, err_msg=name)


# MobileNetV2 under 1F1B in two micro-batches, its running statistics updated
# once per batch (batchnorm='deferred')
DEFERRED = dict(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2, network='mobilenetv2_0.25',
                batchnorm='deferred')


def test_deferred_statistics_over_two_nodes_are_one_process_bit_for_bit(node_job):
    """MobileNetV2 over two node processes under 1F1B in two micro-batches,
    ``batchnorm='deferred'``: each node updates the running statistics of
    its own stages once per batch, nothing about them crosses, and every
    array (statistics included) equals one process's bit for bit after
    three Adam steps; the statistics are not the default rule's."""
    held, names = node_job[0][-1]
    expected, outputs = nodes_worker.train(**DEFERRED)
    expected['outputs'] = outputs
    assert sorted(held) == sorted(expected)
    assert all(any('running_mean' in key for key in mine) for mine in names)
    for name, value in expected.items():
        np.testing.assert_array_equal(held[name], value, err_msg=name)
    default, _ = nodes_worker.train(**dict(DEFERRED, batchnorm='micro-batch'))
    running = [sorted(k for k in arrays if 'running' in k) for arrays in (held, default)]
    assert len(running[0]) == len(running[1]) > 0  # the same arrays, named by another model
    assert any(not np.array_equal(held[a], default[b]) for a, b in zip(*running))


def test_get_params_reads_the_running_statistics_the_last_backward_updated():
    """MXNet's BatchNorm updates its running statistics in its backward
    pass, as an input it reads: ``get_params`` right after a step holds the
    values the arrays hold once every queued operation is done."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    config = dict(ZOO[0], devices='cpu:0')
    pipe = Pipeline(nodes_worker.model_zoo.get_model(config['network'], pretrained=False,
                                                     classes=nodes_worker.CLASSES),
                    config['devices'], sample=(8,) + nodes_worker.IMAGE, chunks=2,
                    schedule='1f1b')
    mod = pipe.module(loss='softmax')
    mod.bind(data_shapes=[('data', (8,) + nodes_worker.IMAGE)],
             label_shapes=[('softmax_label', (8,))])
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(optimizer='adam')
    mod.forward_backward(nodes_worker.image_batch(0, 8))
    mod.update()
    _, aux = mod.get_params()
    mx.nd.waitall()
    devices = mod.executors[0].aux_dict
    assert sorted(aux) == sorted(devices) and aux
    for name, value in aux.items():
        np.testing.assert_array_equal(value.asnumpy(), devices[name].asnumpy(), err_msg=name)


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
    # pylint: disable-next=import-outside-toplevel
    from mp_symbolic.core.placement.place import place, replica_devices
    assert node_processes.node_of_devices(3, 2) == (0, 0, 1)
    nodes = node_processes.Nodes(2, 1, 60.0, '127.0.0.1:9')
    placed = place(tuple(_net()), False, replica_devices('cpu:0,cpu:1,cpu:0,cpu:1', 1, nodes),
                   (0, 1, 2, 3), sample=SAMPLE)
    assert placed.plan.node_of_stage == (0, 0, 1, 1)
    assert placed.plan.stages_of_node(1) == (2, 3)
    # a GPU of another node need not be here; one of this node must
    other = replica_devices('gpu:0,cpu:1', 1, node_processes.Nodes(2, 1, 60.0, '127.0.0.1:9'))
    placed = place(tuple(_net()), False, other, (0, 1), sample=SAMPLE)
    assert placed.plan.node_of_stage == (0, 1)
    with pytest.raises(ValueError, match=r'^node 1: gpu:0 requested but MXNet sees 0 GPU'):
        replica_devices('cpu:1,gpu:0', 1, node_processes.Nodes(2, 1, 60.0, '127.0.0.1:9'))


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


@pytest.mark.slow
def test_a_gluoncv_network_builds_after_the_nodes_imported_torch():
    # a node's Pipeline imports torch; GluonCV refuses to import after torch 2
    code = '''
from mp_symbolic.core.transport import nodes
nodes.torch('distributed')
from gluoncv import model_zoo
net = model_zoo.get_model('resnet18_v1b', pretrained=False, classes=10)
print(type(net).__name__)
'''
    result = subprocess.run([sys.executable, '-c', code], env=dict(os.environ, PYTHONPATH=ROOT),
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == 'ResNetV1b', result.stderr[-2000:]


def test_the_makefile_installs_the_torch_the_nodes_extra_pins():
    import re  # pylint: disable=import-outside-toplevel
    with open(os.path.join(ROOT, 'Makefile')) as f:
        makefile = re.search(r'^TORCH := (\S+)$', f.read(), re.M).group(1)
    with open(os.path.join(ROOT, 'pyproject.toml')) as f:
        extra = re.search(r'^nodes = \["([^"]+)"\]$', f.read(), re.M).group(1)
    assert makefile == extra == 'torch==2.13.0'


# -- the command line over nodes: launch, faults, torchrun ---------------------------------

REGRESSION = ['train', '--devices', 'cpu:0,cpu:1', '--schedule', '1f1b', '--chunks', '2',
              '--optimizer', 'adam', '--no-memory', '--no-progress', '--num-examples', '400']
LAUNCH_TIMEOUT = 180


def _digest(text):
    found = [line.split()[-1] for line in text.splitlines() if 'parameters sha256:' in line]
    assert found, text[-3000:]
    return found


def _launch(argv, port, **kwargs):
    return subprocess.run([sys.executable, '-m', 'mp_symbolic', 'launch', '--port', str(port)]
                          + argv, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT,
                                                     MXNET_SUBGRAPH_VERBOSE='0'),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, **kwargs)


def _train_here(argv, capsys):
    """``python -m mp_symbolic`` ``argv`` run in this process: its stdout."""
    from conftest import cli_status  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    capsys.readouterr()
    status = cli_status(cli.main, argv)
    out = capsys.readouterr()
    assert status == 0, out.err[-3000:]
    return out.out


@pytest.fixture(scope='module')
def launched(tmp_path_factory):
    """``(result, folder)`` of two node processes under ``launch --nodes 2``
    training the regression 2 epochs (with its memory table) into
    ``folder``, which the tests below copy before writing beside it."""
    folder = tmp_path_factory.mktemp('launched') / 'nodes'
    with_memory = [a for a in REGRESSION if a != '--no-memory']
    with reserved_port() as port:
        result = _launch(['--nodes', '2', '--'] + with_memory + ['--epochs', '2', '--out',
                                                                  str(folder)], port)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, folder


@pytest.mark.slow
def test_launch_nodes_trains_as_one_process_and_its_checkpoint_resumes_in_one_and_exports(
        launched, tmp_path, capsys):
    """Two node processes under ``launch --nodes 2``: every node reports the
    one process's parameters; the checkpoint the nodes committed together is
    the unsplit model, resumed in one process as an uninterrupted run and
    exported."""
    from mp_symbolic import read_checkpoint  # pylint: disable=import-outside-toplevel
    result = launched[0]
    shutil.copytree(launched[1], tmp_path / 'nodes', symlinks=True)
    assert result.stdout.splitlines()[-1].startswith('launch: 2 nodes: all exited 0 in')
    assert '[node 1] regression: symbolic (module API) model-parallel training' in result.stdout
    # each node's table holds its own stages' parameters: together, the model's 15 floats
    held = {}
    for k in (0, 1):
        assert "[node %d] memory per device of node %d's stages" % (k, k) in result.stdout
        row = next(l for l in result.stdout.splitlines() if l.startswith('[node %d]     all ' % k))
        held[k] = int(row.split()[3])  # '[node k]', 'all', params, 'B', ...
    assert held[0] + held[1] == 15 * 4 and min(held.values()) > 0, held
    nodes = _digest(result.stdout)
    one = _digest(_train_here(REGRESSION + ['--epochs', '2', '--out', str(tmp_path / 'one')],
                              capsys))
    assert len(nodes) == 2 and set(nodes) == set(one)
    nodes_checkpoint = read_checkpoint(str(tmp_path / 'nodes'))
    assert [os.path.basename(p) for p in nodes_checkpoint.part_paths] == [
        'regression-0002-node0.npz', 'regression-0002-node1.npz']  # one part per node
    _, arg, aux = nodes_checkpoint.load()
    _, ref, _ = read_checkpoint(str(tmp_path / 'one')).load()
    assert sorted(arg) == sorted(ref) and not aux
    for name, value in ref.items():
        np.testing.assert_array_equal(arg[name].asnumpy(), value.asnumpy(), err_msg=name)
    # resumed in one process: the run of 3 epochs in one process
    resumed = _digest(_train_here(['train', '--resume', str(tmp_path / 'nodes'), '--epochs', '3',
                                   '--no-progress', '--no-memory'], capsys))
    whole = _digest(_train_here(REGRESSION + ['--epochs', '3', '--out', str(tmp_path / 'three')],
                                capsys))
    assert resumed == whole
    from export.__main__ import main as export_main  # pylint: disable=import-outside-toplevel
    from conftest import cli_status  # pylint: disable=import-outside-toplevel
    assert cli_status(export_main, ['--checkpoint', str(tmp_path / 'nodes'), '--out',
                                    str(tmp_path / 'export')]) == 0


def test_pair_writes_a_checkpoint_of_parts_as_mxnets_own_pair_that_resumes_as_the_parts(
        launched, tmp_path, capsys):
    """``python -m mp_symbolic pair``: the parts of a 2-node checkpoint as
    one ``.params`` file ``mx.model.load_checkpoint`` reads, with the same
    arrays, and a ``.states`` file: resumed, it ends where the parts resumed
    end."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from conftest import cli_status  # pylint: disable=import-outside-toplevel
    from mp_symbolic import read_checkpoint  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    shutil.copytree(launched[1], tmp_path / 'nodes', symlinks=True)
    capsys.readouterr()
    assert cli_status(cli.main, ['pair', '--checkpoint', str(tmp_path / 'nodes'), '--out',
                                 str(tmp_path / 'pair')]) == 0
    prefix = str(tmp_path / 'pair' / 'current' / 'regression')
    assert capsys.readouterr().out.splitlines() == [
        "%s: regression-symbol.json, regression-0002.params and regression-0002.states from 2 "
        "parts (mx.model.load_checkpoint(%r, 2))" % (tmp_path / 'pair' / 'current', prefix)]
    _, arg, aux = mx.model.load_checkpoint(prefix, 2)
    _, parts, _ = read_checkpoint(str(tmp_path / 'nodes')).load()
    assert sorted(arg) == sorted(parts) and not aux
    for name, value in parts.items():
        np.testing.assert_array_equal(arg[name].asnumpy(), value.asnumpy(), err_msg=name)
    resumed = [_digest(_train_here(['train', '--resume', str(tmp_path / k), '--epochs', '3',
                                    '--out', str(tmp_path / (k + '3')), '--no-progress',
                                    '--no-memory'], capsys)) for k in ('pair', 'nodes')]
    assert resumed[0] == resumed[1]
    # a pair already: one line, exit 2, nothing written
    assert cli_status(cli.main, ['pair', '--checkpoint', str(tmp_path / 'pair'), '--out',
                                 str(tmp_path / 'again')]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: expected a checkpoint of one part per node, found MXNet's pair already in %s "
        "(mx.model.load_checkpoint reads it as it is)"
        % read_checkpoint(str(tmp_path / 'pair')).folder)
    assert not os.path.exists(tmp_path / 'again' / 'current')


@pytest.mark.slow
def test_a_checkpoint_resumes_on_two_nodes_from_parts_onto_other_stages_and_from_a_pair(
        launched, tmp_path, port, capsys):
    """Each node reads its own stages' arrays: from the parts of 2 nodes
    onto 3 stages over 2 nodes, and from one process's pair (the layout a
    one-process run writes) onto 2 nodes, each ending where one process
    ends."""
    shutil.copytree(launched[1], tmp_path / 'nodes', symlinks=True)  # 2 epochs
    three = ['--devices', 'cpu:0,cpu:1,cpu:2']
    result = _launch(['--nodes', '2', '--', 'train', '--resume', str(tmp_path / 'nodes'),
                      '--epochs', '3', '--out', str(tmp_path / 'moved'), '--no-progress',
                      '--no-memory'] + three, port)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[node 0] resume: plan changed from the checkpoint's: --devices cpu:0,cpu:1,cpu:2 " \
        "(was cpu:0,cpu:1)" in result.stdout
    moved = _digest(result.stdout)
    _train_here(REGRESSION + ['--epochs', '2', '--out', str(tmp_path / 'one')], capsys)
    alone = _digest(_train_here(['train', '--resume', str(tmp_path / 'one'), '--epochs', '3',
                                 '--out', str(tmp_path / 'one2'), '--no-progress',
                                 '--no-memory'] + three, capsys))
    assert set(moved) == set(alone)
    # today's layout, one process's pair, resumed on two nodes
    assert os.path.isfile(tmp_path / 'one' / 'current' / 'regression-0002.params')
    result = _launch(['--nodes', '2', '--', 'train', '--resume', str(tmp_path / 'one'),
                      '--epochs', '3', '--out', str(tmp_path / 'from-pair'), '--no-progress',
                      '--no-memory'], port)
    assert result.returncode == 0, result.stderr[-3000:]
    whole = _digest(_train_here(REGRESSION + ['--epochs', '3', '--out', str(tmp_path / 'w')],
                                capsys))
    assert set(_digest(result.stdout)) == set(whole)


REPORT_WORKER = os.path.join(ROOT, 'tests', 'report_nodes_worker.py')
REPORT_LINES = ('full-data MSE:', 'learned map:', 'parameters sha256:')


@pytest.mark.slow
def test_the_report_and_digest_over_two_nodes_read_one_parameter_at_a_time_as_one_process(
        tmp_path, port, capsys):
    """Over two nodes no gather carries a parameter: the end-of-run report
    (regression's learned map reads every layer's weights) and the
    ``parameters sha256`` read each from the node that holds it, one array
    at a time, and every node prints what one process prints."""
    argv = REGRESSION + ['--epochs', '2', '--nodes', '2', '--out', str(tmp_path / 'nodes')]
    procs = [subprocess.Popen([sys.executable, REPORT_WORKER] + argv,
                              env=node_env(rank, 2, port), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        ended = [p.communicate(timeout=LAUNCH_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, ended):
        assert p.returncode == 0, err[-3000:]
    one = _train_here(REGRESSION + ['--epochs', '2', '--out', str(tmp_path / 'one')], capsys)
    expected = [l for l in one.splitlines() if l.startswith(REPORT_LINES)]
    assert len(expected) == len(REPORT_LINES), one[-3000:]
    largest = 2 * 2 * 4  # bytes of regression's largest parameter, a 2x2 float32 weight
    for out, _ in ended:
        assert [l for l in out.splitlines() if l.startswith(REPORT_LINES)] == expected, out
        carried = json.loads(out.splitlines()[-1][len('carried: '):])
        assert max(carried['gathered']) == 0, carried  # names, shapes, a commit's steps
        assert carried['read'] and max(carried['read']) <= largest, carried


def _gone(pids):
    return all(not os.path.exists('/proc/%d' % pid) or
               open('/proc/%d/stat' % pid).read().split(') ')[-1].startswith('Z')
               for pid in pids)


def _pids(text):
    line = next(l for l in text.splitlines() if l.startswith('launch: pids: '))
    return {name: int(pid) for name, pid in
            (entry.rsplit(' ', 1) for entry in line[len('launch: pids: '):].split(', '))}


@pytest.mark.slow
def test_a_node_killed_ends_the_other_in_one_line_naming_it_and_keeps_the_checkpoint(
        tmp_path, port):
    from mp_symbolic.tools.store import Store  # pylint: disable=import-outside-toplevel
    out = tmp_path / 'run'
    proc = subprocess.Popen(
        [sys.executable, '-m', 'mp_symbolic', 'launch', '--port', str(port), '--nodes', '2',
         '--'] + REGRESSION + ['--epochs', '100000', '--out', str(out)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0'),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while Store(str(out)).current() is None and proc.poll() is None:
            time.sleep(0.2)  # until the nodes committed their first checkpoint together
        assert proc.poll() is None, proc.communicate()
        first = proc.stdout.readline()
        while not first.startswith('launch: pids: '):
            first = proc.stdout.readline()
        pids = _pids(first)
        os.kill(pids['node 1'], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    own = [l for l in stderr.splitlines() if not l.startswith('[')]
    # node 0 is stopped by the launcher, or has ended by itself on noticing its peer gone
    assert own in [['error: node 1 (pid %d) was killed by SIGKILL; %s' % (pids['node 1'], rest)]
                   for rest in ('stopped the other 1 process of the job',
                                'no other process of the job was running')], stderr[-3000:]
    node0 = [l for l in (stdout + stderr).splitlines() if l.startswith('[node 0] error: ')]
    # the survivor names the node that died, if it noticed before the launcher stopped it
    assert not node0 or node0[0].startswith('[node 0] error: nodes: node 1 (stage 1) hung up '
                                            '(its process died or its host is unreachable)') \
        or 'terminated (SIGTERM)' in node0[0], node0
    assert _gone(pids.values())
    assert Store(str(out)).current().meta['epoch'] >= 1  # the last commit, whole


@pytest.mark.slow
def test_a_stopped_node_ends_the_others_at_the_node_timeout_in_one_line(tmp_path, port):
    """Without a launcher watching: node 1 stopped (SIGSTOP), node 0 ends at
    ``--node-timeout`` naming it."""
    procs = [subprocess.Popen([sys.executable, '-m', 'mp_symbolic'] + REGRESSION +
                              ['--epochs', '100000', '--nodes', '2', '--node-timeout', '3',
                               '--out', str(tmp_path / 'run')],
                              env=node_env(rank, 2, port), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        for line in procs[1].stdout:
            if line.startswith('epoch 1/'):
                break
        os.kill(procs[1].pid, signal.SIGSTOP)
        _, stderr = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 1
    lines = stderr.strip().splitlines()
    # node 0 was waiting on node 1 for a tensor (naming its stage) or for a commit
    assert len(lines) == 1 and re.match(
        r'error: nodes: node 1 \(stage 1\) did not answer within 3 s \(--node-timeout\): it is '
        r'stopped, wedged or unreachable( \(waited for by node 0 to [a-z ]+\))?; node 0 ended',
        lines[0]), stderr[-3000:]


@pytest.mark.slow
def test_torchrun_restarts_a_killed_node_from_the_last_checkpoint_to_the_uninterrupted_result(
        tmp_path, port, capsys):
    out = tmp_path / 'run'
    argv = [sys.executable, '-m', 'mp_symbolic.tools.torchrun', '--nnodes', '1',
            '--nproc-per-node', '2', '--max-restarts', '1', '--rdzv-backend', 'c10d',
            '--rdzv-endpoint', '127.0.0.1:%d' % port, '-m', 'mp_symbolic'] + REGRESSION + \
        ['--epochs', '4', '--nodes', '2', '--out', str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')
    for name in node_processes.RENDEZVOUS:
        env.pop(name, None)
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        from mp_symbolic.tools.store import Store  # pylint: disable=import-outside-toplevel
        while (Store(str(out)).current() is None or
               Store(str(out)).current().meta['epoch'] < 1) and proc.poll() is None:
            time.sleep(0.1)
        node1 = [pid for pid in map(int, filter(str.isdigit, os.listdir('/proc')))
                 if _environ(pid).get('RANK') == '1' and str(out) in _cmdline(pid)]
        assert len(node1) == 1
        os.kill(node1[0], signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout[-3000:]
    assert 'torchrun restart 1: resuming from the last checkpoint committed in %s' % out \
        in stdout
    restarted = _digest(stdout)
    whole = _digest(_train_here(REGRESSION + ['--epochs', '4', '--out', str(tmp_path / 'one')],
                                capsys))
    assert set(restarted) == set(whole), stdout[-3000:]


def _environ(pid):
    try:
        with open('/proc/%d/environ' % pid, 'rb') as f:
            items = f.read().split(b'\0')
    except OSError:
        return {}
    return dict(i.decode('utf-8', 'replace').split('=', 1) for i in items if b'=' in i)


def _cmdline(pid):
    try:
        with open('/proc/%d/cmdline' % pid, 'rb') as f:
            return f.read().decode('utf-8', 'replace')
    except OSError:
        return ''


@pytest.mark.parametrize('argv, message', [
    (['train', '--nodes', '2'], 'error: --nodes: expected a rendezvous for 2 node processes'),
    (['train', '--nodes', '2', '--variant', 'imperative'],
     "error: --nodes: expected variant 'symbolic' with them"),
    (['launch', '--nodes', '2', '--workers', '1', '--', 'train'],
     'error: --nodes: expected it alone or --workers and --servers'),
])
def test_nodes_the_command_line_cannot_run_are_refused_in_one_line(monkeypatch, capsys, argv,
                                                                   message):
    from conftest import cli_status  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    for name in node_processes.RENDEZVOUS:
        monkeypatch.delenv(name, raising=False)
    assert cli_status(cli.main, argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


@pytest.mark.parametrize('argv, message', [
    (['--nodes', '100000', '--', 'train', '--devices', 'cpu:0,cpu:1'],
     'error: --nodes: expected at most 1024 node processes, found 100000'),
    (['--nodes', '2000', '--', 'python', 'w.py'],
     'error: --nodes: expected at most 1024 node processes, found 2000'),
    (['--nodes', '3', '--', 'train', '--devices', 'cpu:0,cpu:1'],
     'error: worker command: --nodes: expected at most as many nodes as devices per replica '
     '(2), found 3 (a node would hold no stage)'),
    (['--nodes', '3', '--', 'train', '--devices', 'cpu:0,cpu:1,cpu:2,cpu:3', '--replicas', '2'],
     'error: worker command: --nodes: expected at most as many nodes as devices per replica '
     '(2), found 3 (a node would hold no stage)'),
    (['--nodes', '4', '--', 'train'],
     'error: worker command: --nodes: expected at most as many nodes as devices per replica (at '
     'most 3 where the devices are not given), found 4 (a node would hold no stage)'),
], ids=['limit', 'limit-script', 'devices', 'devices-of-a-replica', 'default-devices'])
def test_launch_refuses_nodes_each_node_would_refuse_within_a_second_starting_none(argv,
                                                                                  message):
    """The launcher's first line (stdout) comes before the first process:
    none, and the refusal within seconds, is no process started (0.15 s
    here on an idle machine; starting the processes took 5.5 s for 3 nodes
    and never ended for 100000; the bound leaves room for a loaded one)."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'launch'] + argv, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                            text=True, timeout=60)
    assert time.monotonic() - start < 3.0
    assert (result.returncode, result.stdout, result.stderr) == (2, '', message + '\n')


def test_the_node_count_is_checked_without_mxnet_as_the_nodes_check_it():
    """What the launcher and TrainConfig refuse, without MXNet, is what
    ``node_of_devices`` refuses inside each node, in its words."""
    from mp_symbolic.core.base import checks  # pylint: disable=import-outside-toplevel
    assert checks.MAX_NODES == node_processes.MAX_NODES
    for devices, nodes in ((2, 3), (4, checks.MAX_NODES + 1), (2, 0)):
        with pytest.raises(ValueError) as theirs:
            node_processes.node_of_devices(devices, nodes)
        with pytest.raises(ValueError) as ours:
            checks.node_count(nodes, devices)
        assert str(ours.value) == str(theirs.value)
    assert checks.node_count(2, 2) == 2 and checks.node_count(3, None, 3) == 3


def _base_config():
    from mp_symbolic.training.config import TrainConfig  # pylint: disable=import-outside-toplevel
    return TrainConfig(devices='cpu:0,cpu:1', schedule='1f1b', chunks=2, batch_size=100,
                       num_epochs=2, optimizer='sgd', lr=0.02, momentum=0.0, nodes=2,
                       task_args=(('num_examples', 400),), out='run', progress=False)


def test_every_config_field_is_compared_across_nodes_or_named_as_alike_or_a_nodes_own():
    """A field added to TrainConfig is placed by a decision, not left out."""
    from dataclasses import fields  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training.config import NODE_FIELDS, TrainConfig  # pylint: disable=C0415
    groups = [set(NODE_FIELDS[k]) for k in ('compared', 'plan', 'fixed', 'own')]
    assert sum(map(len, groups)) == len(fields(TrainConfig))
    assert set().union(*groups) == {f.name for f in fields(TrainConfig)}


@pytest.mark.parametrize('name, value, flag', [
    ('seed', 1, '--seed'), ('batch_size', 50, '--batch-size'), ('num_epochs', 3, '--epochs'),
    ('checkpoint_every', 2, '--checkpoint-every'), ('optimizer', 'adam', '--optimizer'),
    ('lr', 0.05, '--lr'), ('momentum', 0.5, '--momentum'), ('task', 'lm', '--task'),
    ('task_args', (('num_examples', 500),), '--task-arg'), ('kvstore', 'device', '--kvstore'),
    ('mirror', True, '--mirror'),
])
def test_the_run_facts_the_nodes_compare_tell_each_compared_flag_apart(name, value, flag):
    from dataclasses import replace  # pylint: disable=import-outside-toplevel
    facts = _base_config().node_facts()
    theirs = replace(_base_config(), **{name: value}).node_facts()
    assert [key for key in facts if facts[key] != theirs[key]] == [flag]
    assert json.loads(json.dumps(theirs)) == theirs  # as the nodes exchange them


def test_the_run_facts_leave_out_what_is_each_nodes_own():
    from dataclasses import replace  # pylint: disable=import-outside-toplevel
    own = dict(devices='cpu:2,cpu:3', out='elsewhere', resume='there', progress=True,
               profile=True, memory=True, node_timeout=5)
    assert replace(_base_config(), **own).node_facts() == _base_config().node_facts()


def _nodes_given(tmp_path, port, flags, timeout=LAUNCH_TIMEOUT):
    """Two node processes of ``train`` over the regression, node ``k`` given
    :data:`REGRESSION`, ``--nodes 2`` and ``flags[k]``; returns ``[(status,
    stderr lines, seconds from the start to its exit)]``."""
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, '-m', 'mp_symbolic'] + REGRESSION +
                              ['--nodes', '2', '--out', str(tmp_path / 'run')] + more,
                              env=node_env(rank, 2, port), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank, more in enumerate(flags)]
    ended = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            ended.append((proc.returncode, err.splitlines(), time.monotonic() - start))
    finally:
        for proc in procs:
            proc.kill()
    return ended


RUN_DIFFERS = ("error: --nodes: expected every node to make the same plan, found node 1's %s "
               "where node 0's is %s (are the flags the same on every host?)")


@pytest.mark.slow
@pytest.mark.parametrize('flags, shown', [
    # several flags differ: the first compared is named
    ([[], ['--seed', '1', '--epochs', '3', '--lr', '0.05', '--optimizer', 'sgd',
           '--checkpoint-every', '2']], ('--seed 1', '0')),
    # gloo aborted node 1 (SIGABRT) at the first tensor of another size
    ([['--batch-size', '100'], ['--batch-size', '50']], ('--batch-size 50', '100')),
], ids=['seed-and-more', 'batch-size'])
def test_nodes_given_other_run_flags_both_exit_2_in_one_line_naming_the_flag(
        tmp_path, port, flags, shown):
    ended = _nodes_given(tmp_path, port, flags)
    for status, lines, _ in ended:
        assert (status, lines) == (2, [RUN_DIFFERS % shown]), lines[-20:]
    assert not (tmp_path / 'run' / 'current').exists()


@pytest.mark.slow
def test_nodes_resuming_from_other_epochs_both_exit_2_in_one_line(tmp_path, port, capsys):
    """``--resume`` is each node's path: the epoch it resumes from is compared."""
    first = str(tmp_path / 'first')
    _train_here(REGRESSION + ['--epochs', '1', '--out', first], capsys)
    ended = _nodes_given(tmp_path, port, [['--resume', first, '--epochs', '2'],
                                          ['--epochs', '2']])
    for status, lines, _ in ended:
        assert (status, lines) == (2, [RUN_DIFFERS % ('--resume epoch 0', '1')]), lines[-20:]


@pytest.mark.slow
def test_the_nodes_benchmark_sends_each_activation_per_microbatch_and_the_tie_once_per_step(
        tmp_path):
    """``python -m bench.nodes --quick``: the two nodes hold the whole
    model's parameters between them, and each sends, per micro-batch, the
    activation its neighbour reads (or its gradient), and per step the tied
    embedding (or its gradients' sum) once, as many bytes and messages as the
    model says."""
    out = tmp_path / 'nodes.json'
    result = subprocess.run([sys.executable, '-m', 'bench.nodes', '--quick', '--out', str(out)],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures['step_ratio'] > 0 and len(figures['ratios']) == 2
    assert sum(figures['params_fraction']) == pytest.approx(1, abs=1e-9)
    chunks, micro, width, vocab, context = 2, 16, 32, 166, 64
    expected = chunks * 4 * micro * context * width + 4 * vocab * width
    assert [s['sent_bytes'] / 2 for s in figures['node_stats']] == [expected, expected]
    assert [s['sent'] / 2 for s in figures['node_stats']] == [chunks + 1, chunks + 1]


def test_launch_nodes_in_manual_mode_prints_each_nodes_command_for_its_host(tmp_path, capsys):
    """``launch --nodes 2 --mode manual --hostfile``: one line per node for
    its host, each with the rendezvous on the first host, its rank and the
    command with ``--nodes 2``."""
    from conftest import cli_status  # pylint: disable=import-outside-toplevel
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('127.0.0.1\nlocalhost\n')
    assert cli_status(cli.main, ['launch', '--nodes', '2', '--mode', 'manual', '--port', '29555',
                                 '--hostfile', str(hostfile), '--', 'train', '--devices',
                                 'cpu:0,cpu:1']) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [l for l in lines if not l.startswith('#')]
    assert [l for l in lines if l.startswith('# node')] == ['# node 0 on 127.0.0.1',
                                                            '# node 1 on localhost']
    for rank, line in enumerate(commands):
        assert 'MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 RANK=%d WORLD_SIZE=2' % rank in line
        assert line.endswith('-m mp_symbolic train --devices cpu:0,cpu:1 --nodes 2'), line


# -- the commit of a checkpoint over nodes, killed at each of its file operations -----------

# Two node processes, forked for k = 1, 2, ...: both commit checkpoint A (epoch 1)
# together, then checkpoint B (epoch 2), node R SIGKILLing itself at its k-th file
# operation of B's commit (each open, and after each write, fsync, close, rename,
# symlink or removal), until a k where the commit ends first. The commit is
# commit_checkpoint's over nodes: each node writes its part, node 0 the symbol and
# the summary. The nodes talk through tests.killpoints.Pipes.
COMMIT_CHILD = r"""
import sys
import mxnet as mx
import numpy as np
from mp_symbolic.core.optim.optstate import FORMAT
from mp_symbolic.tools.checkpoint import commit_checkpoint
from mp_symbolic.tools.store import Store
from tests.killpoints import arm, kill_each, two
base, R = sys.argv[1], int(sys.argv[2])

data = mx.sym.Variable('data', shape=(0, 3))
hidden = mx.sym.FullyConnected(data, mx.sym.Variable('w0'), num_hidden=4, no_bias=True,
                               name='fc0')
SYMBOL = mx.sym.FullyConnected(hidden, mx.sym.Variable('w1'), num_hidden=2, no_bias=True,
                               name='fc1')
SHAPES = {'w0': (4, 3), 'w1': (2, 4)}

def values(epoch, rank):
    name = 'w%d' % rank
    weight = np.full(SHAPES[name], epoch * 10 + rank, dtype=np.float32)
    states = {'format': FORMAT, 'optimizer': 'adam', 'num_update': epoch,
              'params': {name: {'count': epoch, 'state': {'t': 'tuple', 'items': [
                  {'t': 'nd', 'a': 0}, {'t': 'nd', 'a': 1}]}}},
              'arrays': [weight / 2, weight / 4]}
    return {name: weight}, states

def both(epoch, k, folder):
    def node(rank, group):
        arg, states = values(epoch, rank)
        if k is not None and rank == R:
            arm(k, opens=True)
        if rank == 0:
            with Store(folder, kind='training').locked() as store:
                commit_checkpoint(store, 'm', epoch, SYMBOL, arg, {}, states, {'e': epoch},
                                  True, group=group)
        else:
            commit_checkpoint(None, 'm', epoch, SYMBOL, arg, {}, states, {'e': epoch}, True,
                              group=group)
    return two(node)

def attempt(k, folder):
    if any(both(1, None, folder)):
        sys.exit('k=%d: expected checkpoint A committed' % k)
    return both(2, k, folder)

kill_each(base, attempt, victim=R)
"""


@pytest.mark.slow
@pytest.mark.parametrize('killed_node', [0, 1])
def test_a_node_killed_at_any_file_operation_of_a_checkpoint_commit_leaves_one_whole_and_resumable(
        tmp_path, killed_node):
    """The commit of :func:`~mp_symbolic.tools.checkpoint.commit_checkpoint`
    over two nodes (a part each, no merge), either node killed at each of
    its file operations: the folder holds the previous checkpoint or the new
    one, whole, read back array by array with its optimizer state, and the
    next writer commits over it."""
    from mp_symbolic import read_checkpoint  # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.checkpoint import commit_checkpoint  # pylint: disable=import-outside-toplevel
    from mp_symbolic.tools.store import Store  # pylint: disable=import-outside-toplevel
    killed = killed_points(COMMIT_CHILD, [tmp_path, killed_node], timeout=600)
    # node 0: its part, the symbol, the summary, the seal, the switch, the cleaning;
    # node 1: its part (open, writes, fsync, hash)
    assert len(killed) >= (30 if killed_node == 0 else 4), killed
    seen = {1: 0, 2: 0}
    for k in killed:
        folder = str(tmp_path / ('k%03d' % k))
        with read_checkpoint(folder) as checkpoint:
            epoch = checkpoint.epoch
            assert len(checkpoint.part_paths) == 2 and checkpoint.summary['e'] == epoch
            symbol, arg, aux = checkpoint.load()
            states = checkpoint.load_states()
        assert sorted(arg) == ['w0', 'w1'] and not aux, 'k=%d' % k
        for rank in (0, 1):  # every array of one commit: never a mix of A and B
            value = epoch * 10 + rank
            np.testing.assert_array_equal(arg['w%d' % rank].asnumpy(), value)
            entry = states['params']['w%d' % rank]
            assert entry['count'] == epoch
            first, second = (states['arrays'][s['a']] for s in entry['state']['items'])
            np.testing.assert_array_equal(first, value / 2)
            np.testing.assert_array_equal(second, value / 4)
        assert states['num_update'] == epoch
        seen[epoch] += 1
        with Store(folder, kind='training').locked() as store:  # the next writer goes on
            commit_checkpoint(store, 'm', 3, symbol, {n: v * 0 for n, v in arg.items()}, {},
                              states, {'e': 3}, True)
        names = sorted(os.listdir(folder))
        assert names[:3] == ['.kind', '.lock', 'current'] and len(names) == 4, names
        assert read_checkpoint(folder).load()[1]['w1'].asnumpy().sum() == 0
    # a kill of node 1 always comes before the switch: the old checkpoint stays
    assert seen[1] > 0 and (seen[2] > 0 or killed_node == 1), seen


class _Posted:
    """torch.distributed's ``isend``/``irecv`` as a list of what was posted,
    each transfer complete at once (a received tensor filled with its tag)."""

    def __init__(self):
        self.posted = []

    def isend(self, tensor, dst, tag):
        self.posted.append(('send', tensor, dst, tag))
        return self

    def irecv(self, tensor, src, tag):
        tensor.fill_(tag)
        self.posted.append(('receive', tensor, src, tag))
        return self

    def wait(self):
        return True


def test_the_gloo_transport_sends_and_receives_through_one_buffer_a_tag_kept_across_batches(
        monkeypatch):
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.transport.comm import Link  # pylint: disable=import-outside-toplevel
    posted = _Posted()
    real = node_processes.torch
    monkeypatch.setattr(node_processes, 'torch',
                        lambda part=None: posted if part == 'distributed' else real(part))
    link = Link(0, 1, 'x')
    me = node_processes.Nodes(2, 0, 1.0, '127.0.0.1:1')
    transport = node_processes.TorchTransport(me, (0, 1), [(link, None)], microbatches=2)
    seen = []
    for batch in range(3):
        transport.begin()
        # on cpu(1): a DLPack view of a CPU tensor is an NDArray on cpu(0)
        values = [mx.nd.full((2, 3), batch * 10 + i, ctx=mx.cpu(1)) for i in range(2)]
        dests = [mx.nd.zeros((2, 3), ctx=mx.cpu(1)) for _ in range(2)]
        for i in range(2):
            transport.send_forward(i, [(link, values[i])])
            transport.recv_backward(i, [(link, dests[i])]).wait()
        transport.finish()
        sent = [p for p in posted.posted if p[0] == 'send']
        received = [p for p in posted.posted if p[0] == 'receive']
        # what went out is each micro-batch's value; what came in landed in its array
        for i in range(2):
            np.testing.assert_array_equal(sent[i][1].numpy(), values[i].asnumpy())
            assert (dests[i].asnumpy() == received[i][3]).all()
        seen.append([t for _, t, _, _ in posted.posted])   # kept: none is freed and reused
        posted.posted.clear()
    for later in seen[1:]:                                # the same tensors every batch
        assert all(a is b for a, b in zip(seen[0], later)), (seen[0], later)
    assert len({t.data_ptr() for t in seen[0]}) == 4      # one buffer a tag and direction
    # a tensor of another shape on the same tag gets a buffer of its own shape
    transport.begin()
    transport.send_forward(0, [(link, mx.nd.ones((4, 3)))])
    transport.finish()
    assert tuple(posted.posted[-1][1].shape) == (4, 3)
