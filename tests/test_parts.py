"""Checkpoints read and written one array at a time: a node's part (``.npz``,
read without unpickling anything), MXNet's own ``.params`` written array by
array, and a checkpoint of either layout read only for the arrays asked for."""
import os
import zipfile

import mxnet as mx
import numpy as np
import pytest

from mp_symbolic import read_checkpoint
from mp_symbolic.core.optim.optstate import FORMAT
from mp_symbolic.core.base import parts
from mp_symbolic.tools.checkpoint import Checkpoint, commit_checkpoint, load_checkpoint
from mp_symbolic.tools.store import Store

ARRAYS = {'arg:w': np.arange(6, dtype=np.float32).reshape(2, 3),
          'aux:m': np.array([1.5], np.float32), 'arg:s': np.float32(3).reshape(()),
          'arg:i': np.arange(4, dtype=np.int64), 'arg:h': np.ones((2, 2), np.float16)}


def test_mxnet_params_written_one_array_at_a_time_are_the_bytes_mx_nd_save_writes(tmp_path):
    mx.nd.save(str(tmp_path / 'a.params'),
               {k: mx.nd.array(v, dtype=v.dtype) for k, v in ARRAYS.items()})
    made = []

    def lazily(key):
        def make():
            made.append(key)
            return ARRAYS[key]
        return make

    written = parts.write_mxnet_params(str(tmp_path / 'b.params'),
                                       [(k, lazily(k)) for k in ARRAYS])
    assert made == list(ARRAYS)  # each made in its turn
    assert (tmp_path / 'a.params').read_bytes() == (tmp_path / 'b.params').read_bytes()
    assert parts.mxnet_params_index(str(tmp_path / 'a.params')) == written
    params = parts.MxnetParams(str(tmp_path / 'a.params'))
    for key, value in ARRAYS.items():
        found = params.read(key)
        assert found.dtype == value.dtype
        np.testing.assert_array_equal(found, value)


def test_a_truncated_mxnet_params_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / 'a.params'
    parts.write_mxnet_params(str(path), list(ARRAYS.items()))
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(parts.PartError, match=r'a\.params: expected an MXNet params file, '
                                              r'found it truncated$'):
        parts.mxnet_params_index(str(path))


def test_a_part_reads_back_one_array_at_a_time_with_numpy_and_no_pickle(tmp_path):
    path = str(tmp_path / 'p.npz')
    written = parts.write_npz(path, [(k, (lambda v=v: v)) for k, v in ARRAYS.items()])
    assert parts.npz_index(path) == written
    with zipfile.ZipFile(path) as zf:  # stored, so a member is read without the others
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
    with np.load(path, allow_pickle=False) as data:
        assert sorted(data.files) == sorted(ARRAYS)
        np.testing.assert_array_equal(data['arg:w'], ARRAYS['arg:w'])
    with pytest.raises(FileExistsError):  # never over a file
        parts.write_npz(path, [])


class OneNode:
    """The group of a job of one node (what commit_across takes)."""
    rank, count = 0, 1

    @staticmethod
    def broadcast(value, source):
        assert source == 0
        return value

    @staticmethod
    def gather(value):
        return [value]


def _checkpoint(folder, group):
    data = mx.sym.Variable('data', shape=(0, 3))
    symbol = mx.sym.FullyConnected(mx.sym.FullyConnected(data, mx.sym.Variable('w0'),
                                                         num_hidden=4, no_bias=True),
                                   mx.sym.Variable('w1'), num_hidden=2, no_bias=True)
    arg = {'w0': np.full((4, 3), 1, np.float32), 'w1': np.full((2, 4), 2, np.float32)}
    states = {'format': FORMAT, 'optimizer': 'sgd', 'num_update': 5,
              'params': {n: {'count': 5, 'state': {'t': 'nd', 'a': i}}
                         for i, n in enumerate(arg)},
              'arrays': [v / 10 for v in arg.values()]}
    arg = {k: mx.nd.array(v) for k, v in arg.items()}
    with Store(folder, kind='training').locked() as store:
        commit_checkpoint(store, 'm', 5, symbol, arg, {}, states, {}, True, group=group)
    return read_checkpoint(folder)


@pytest.mark.parametrize('group', [None, OneNode()], ids=['pair', 'parts'])
def test_a_checkpoint_of_either_layout_reads_only_the_arrays_asked_for(tmp_path, monkeypatch,
                                                                        group):
    checkpoint = _checkpoint(str(tmp_path / 'run'), group)
    assert (checkpoint.params_path is None) == (group is not None)
    read = []
    for kind in (parts.NpzReader, parts.MxnetParams):
        real = kind.read
        monkeypatch.setattr(kind, 'read', lambda self, name, real=real: read.append(name) or
                            real(self, name))
    _, arg, aux = checkpoint.load(['w1'])
    assert sorted(arg) == ['w1'] and not aux and read == ['arg:w1']
    np.testing.assert_array_equal(arg['w1'].asnumpy(), 2)
    states = checkpoint.load_states(['w1'])
    assert sorted(states['params']) == ['w1'] and states['num_update'] == 5
    assert len(states['arrays']) == 1
    np.testing.assert_array_equal(states['arrays'][0], 0.2)
    assert 'arg:w0' not in read and 'state:0' not in read
    with pytest.raises(ValueError, match=r'expected arrays for nope, found none$'):
        checkpoint.load(['nope'])
    _, arg, _ = checkpoint.load()  # all of them, checked against the symbol
    assert sorted(arg) == ['w0', 'w1']


def test_a_pair_read_whole_is_read_one_array_at_a_time(tmp_path, monkeypatch):
    """load_checkpoint (export's prefix pairs, Checkpoint.load of a pair) never
    holds the file's arrays twice: each is read from its offset, not through
    mx.nd.load, and equals what mx.nd.load reads."""
    checkpoint = _checkpoint(str(tmp_path / 'run'), None)
    whole = mx.nd.load(checkpoint.params_path)
    read = []
    real = parts.MxnetParams.read
    monkeypatch.setattr(parts.MxnetParams, 'read',
                        lambda self, name: read.append(name) or real(self, name))
    monkeypatch.setattr(mx.nd, 'load', lambda *a, **k: pytest.fail('mx.nd.load called'))
    for _, arg, aux in (load_checkpoint(checkpoint.symbol_path, checkpoint.params_path),
                        checkpoint.load()):
        assert sorted(arg) == ['w0', 'w1'] and not aux
        for name, value in arg.items():
            assert value.dtype == whole['arg:' + name].dtype
            np.testing.assert_array_equal(value.asnumpy(), whole['arg:' + name].asnumpy())
    assert sorted(read) == ['arg:w0', 'arg:w0', 'arg:w1', 'arg:w1']


def test_a_part_that_does_not_fit_the_symbol_is_one_line_naming_it(tmp_path):
    """A part of another model (its manifest made to match) is refused by
    the shapes its headers hold, before any array is read."""
    checkpoint = _checkpoint(str(tmp_path / 'run'), OneNode())
    path = checkpoint.part_paths[0]
    os.remove(path)
    parts.write_npz(path, [('arg:w0', np.zeros((5, 3), np.float32)),
                           ('arg:w1', np.zeros((2, 5), np.float32))])
    forged = Checkpoint(checkpoint.snapshot)  # as read before the part was swapped
    with pytest.raises(ValueError, match=r'm-0005-node0\.npz does not match its symbol: w0 has '
                                         r'shape \(5, 3\), the symbol expects \(4, 3\)'):
        forged.load()


@pytest.mark.parametrize('devices, shards, replicas', [
    ('cpu:0+cpu:1,cpu:2+cpu:3', 2, 1), ('cpu:0,cpu:1,cpu:2,cpu:3', 1, 2)],
    ids=['tensor-parallel', 'replicas'])
def test_lazy_params_and_states_are_get_params_and_optimizer_states_array_by_array(
        devices, shards, replicas):
    """What a node's part is written from, one array at a time: the values
    ``get_params`` and ``optimizer_states`` give, bit for bit, each made only
    when called (a tensor-parallel layer's shards joined, replicas averaged)."""
    # pylint: disable=import-outside-toplevel
    from mp_symbolic import Pipeline
    from mp_symbolic.core.optim.optstate import Deferred, gather_states
    from mp_symbolic.training.tasks import gpt, lm
    import nodes_worker
    shape = (8, nodes_worker.TINY.block_size)
    pipe = Pipeline(gpt.build_blocks(nodes_worker.TINY, lm.sharded_layers(shards)), devices,
                    sample=shape, chunks=2, replicas=replicas, schedule='1f1b')
    mod = pipe.module(loss='softmax')
    mod.bind([('data', shape)], [('softmax_label', shape)])
    mx.random.seed(0)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(kvstore='local' if replicas > 1 else None, optimizer='adam')
    for step in range(2):
        mod.forward_backward(nodes_worker.batch(step, 8))
        mod.update()
    arg, aux = mod.get_params()
    lazy_arg, lazy_aux = mod.lazy_params()
    assert list(lazy_arg) == list(arg) and list(lazy_aux) == list(aux)
    if shards > 1:
        assert any(p.name in lazy_arg for p in pipe.sharded.values())  # by unsplit names
    for name, make in list(lazy_arg.items()) + list(lazy_aux.items()):
        np.testing.assert_array_equal(make(), dict(arg, **aux)[name].asnumpy(), err_msg=name)
    states = mod.optimizer_states()
    lazy = gather_states(mod.optimizer_states(lazy=True), pipe.sharded)
    assert lazy['params'] == states['params']
    assert all(isinstance(a, Deferred) for a in lazy['arrays'])
    assert len(lazy['arrays']) == len(states['arrays'])
    for made, value in zip(lazy['arrays'], states['arrays']):
        np.testing.assert_array_equal(made(), value)
