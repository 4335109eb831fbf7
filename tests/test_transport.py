"""The declared interfaces of :mod:`mp_symbolic.core.transport.comm`: a transport
written against :class:`~mp_symbolic.core.transport.comm.Transport` and registered
from outside the library carries a Pipeline's boundary tensors end to end,
by name, with nothing else changed; the choice of a transport refuses in
one line what cannot run.

Run as a script (``python tests/test_transport.py --out F --nodes N``), it
is one node process of the test over nodes: it registers its own transport
between nodes and trains with it, writing ``F<rank>.npz``."""
import argparse
import os
import sys

import mxnet as mx
from mxnet import gluon
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_symbolic import Pipeline  # pylint: disable=wrong-import-position
from mp_symbolic.core.transport import comm, nodes  # pylint: disable=wrong-import-position
from mp_symbolic.training import loop  # pylint: disable=wrong-import-position

BATCH, SAMPLE = 8, (8, 6)


class HostTransport(comm.Transport):
    """Every boundary tensor through host memory: a numpy copy at the send,
    written into the receiver's array at its receive (a test's transport,
    known to the library only by its registration)."""

    def __init__(self):
        self.carried = {'forward': 0, 'backward': 0}
        self._sent, self._posted, self._written = {}, {}, set()

    @classmethod
    def for_route(cls, route):
        transport = cls()
        transport.route = route
        OPENED.append(transport)
        return transport

    def begin(self):
        self._sent, self._posted, self._written = {}, {}, set()

    def send_forward(self, microbatch, values):
        for link, value in values:
            self._sent[(link, microbatch)] = value.asnumpy()
            self.carried['forward'] += 1

    def recv_forward(self, microbatch, dests):
        for link, dest in dests:
            dest[:] = self._sent.pop((link, microbatch))
        return comm.DONE

    def recv_backward(self, microbatch, dests):
        for link, dest in dests:
            self._posted[(link, microbatch)] = dest
        return comm.DONE

    def send_backward(self, microbatch, values):
        for link, value in values:
            dest = self._posted.pop((link, microbatch))
            comm.accumulate(dest, mx.nd.array(value.asnumpy(), dest.context, dtype=value.dtype),
                            self._written, (link.producer, link.tensor, microbatch))
            self.carried['backward'] += 1

    def send_outputs(self, stage, values):
        pass

    def recv_outputs(self, stage, dests):
        raise AssertionError('no stage runs in another process')

    def finish(self):
        assert not self._sent and not self._posted, 'a message was left in flight'


OPENED = []


class CountedTransport(nodes.TorchTransport):
    """gloo's transport registered under a name of its own, counting the
    tensors each node sends (a transport between nodes made outside the
    library)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counted = 0

    def send_forward(self, microbatch, values):
        self.counted += len(values)
        super().send_forward(microbatch, values)

    def send_backward(self, microbatch, values):
        self.counted += len(values)
        super().send_backward(microbatch, values)


@pytest.fixture
def host_transport(monkeypatch):
    """``'host'`` registered for one test."""
    monkeypatch.setattr(comm, 'TRANSPORTS', dict(comm.TRANSPORTS))
    del OPENED[:]
    comm.register_transport('host', HostTransport)
    return 'host'


def _net():
    net = gluon.nn.HybridSequential(prefix='net_')
    with net.name_scope():
        net.add(gluon.nn.Dense(16, in_units=6, activation='relu'),
                gluon.nn.Dense(16, in_units=16, activation='tanh'),
                gluon.nn.Dense(5, in_units=16))
    return net


def _train(transport, schedule='1f1b', steps=3, devices='cpu:0,cpu:1,cpu:2', nodes=None):
    """The Pipeline, the last step's outputs (``None`` on a node without the
    loss head) and the parameters after ``steps`` SGD steps."""
    pipe = Pipeline(_net(), devices, chunks=2, schedule=schedule, transport=transport,
                    nodes=nodes)
    arg_params, aux_params = loop.initial_values(pipe, seed=0)
    mod = pipe.module(loss='softmax')
    mod.bind(data_shapes=[('data', SAMPLE)], label_shapes=[('softmax_label', (BATCH,))])
    mod.init_params(arg_params={k: mx.nd.array(v) for k, v in arg_params.items()},
                    aux_params={k: mx.nd.array(v) for k, v in aux_params.items()})
    mod.init_optimizer(optimizer='sgd', optimizer_params={'learning_rate': 0.5,
                                                          'momentum': 0.9})
    rng = np.random.default_rng(0)
    for _ in range(steps):
        batch = mx.io.DataBatch([mx.nd.array(rng.normal(size=SAMPLE))],
                                [mx.nd.array(rng.integers(0, 5, BATCH))])
        mod.forward_backward(batch)
        mod.update()
    arg, aux = mod.get_params()
    outputs = mod.get_outputs()
    return pipe, outputs[0].asnumpy() if outputs else None, \
        {k: v.asnumpy() for k, v in dict(arg, **aux).items()}, mod


def test_a_transport_registered_outside_the_library_carries_every_boundary_tensor(
        host_transport):
    _, expected_out, expected, _ = _train(None)
    pipe, out, params, _ = _train(host_transport)
    assert pipe.transport == 'host' and len(OPENED) == 1
    transport = OPENED[0]
    assert transport.route.nodes is None and transport.route.microbatches == 2
    # two boundaries, two micro-batches, three steps: each way
    assert transport.carried == {'forward': 12, 'backward': 12}
    np.testing.assert_array_equal(out, expected_out)
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)


def test_the_default_transport_is_local_in_one_process_and_gloo_over_nodes():
    assert comm.check_transport(None) == 'local'
    assert comm.TRANSPORTS['local'] is comm.LocalTransport
    two = nodes.Nodes(count=2, rank=0, timeout=1.0, address='127.0.0.1:1')
    assert comm.check_transport(None, two) == 'gloo'
    assert comm.TRANSPORTS['gloo'] is nodes.TorchTransport
    assert issubclass(nodes.Group, comm.ControlPlane)
    assert isinstance(comm.control(two, 'test'), comm.ControlPlane)


def test_an_unknown_transport_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^transport: expected one of 'local', 'gloo'.*"
                                         r"found 'mpi'$"):
        Pipeline(_net(), 'cpu:0,cpu:1', schedule='1f1b', transport='mpi')


def test_a_transport_within_one_process_is_refused_with_nodes():
    two = nodes.Nodes(count=2, rank=0, timeout=1.0, address='127.0.0.1:1')
    with pytest.raises(ValueError, match=r"expected one that crosses node processes with "
                                         r"nodes=2, found 'local'"):
        comm.check_transport('local', two)


def test_a_transport_on_the_one_graph_is_refused(host_transport):
    with pytest.raises(ValueError, match=r"^transport: expected 'local' under "
                                         r"schedule='gpipe' in one process"):
        Pipeline(_net(), 'cpu:0,cpu:1', schedule='gpipe', transport=host_transport)


def test_only_a_transport_subclass_is_registered(host_transport):
    with pytest.raises(TypeError, match='expected a subclass of comm.Transport'):
        comm.register_transport('other', object)
    with pytest.raises(ValueError, match="transport 'host': expected a new name, found it "
                                         "taken by HostTransport"):
        comm.register_transport('host', comm.LocalTransport)


@pytest.mark.slow
def test_a_transport_between_nodes_registered_outside_the_library_trains_as_one_process(
        tmp_path, port):
    from conftest import run_node_workers  # pylint: disable=import-outside-toplevel
    out = str(tmp_path / 'node')
    run_node_workers(os.path.abspath(__file__), out, 2, port)
    _, expected_out, expected, _ = _train(None, devices='cpu:0,cpu:1')
    held = [np.load('%s%d.npz' % (out, rank)) for rank in (0, 1)]
    for rank, arrays in enumerate(held):
        assert arrays['transport'] == 'counted' and int(arrays['counted']) > 0, rank
        names = [n[len('param:'):] for n in arrays.files if n.startswith('param:')]
        assert names, rank
        for name in names:
            np.testing.assert_array_equal(arrays['param:' + name], expected[name], err_msg=name)
    np.testing.assert_array_equal(held[1]['output'], expected_out)


def _node_main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument('--out', required=True)
    parser.add_argument('--nodes', type=int, required=True)
    args = parser.parse_args(argv)
    comm.register_transport('counted', CountedTransport)
    pipe, out, params, mod = _train('counted', devices='cpu:0,cpu:1', nodes=args.nodes)
    held = {'param:' + k: v for k, v in params.items()}
    if out is not None:
        held['output'] = out
    held['counted'] = np.array(sum(r.transport.counted for r in mod._runtimes))  # pylint: disable=protected-access
    held['transport'] = np.array(pipe.transport)
    np.savez('%s%d.npz' % (args.out, pipe.nodes.rank), **held)


if __name__ == '__main__':
    _node_main()


def test_the_control_plane_of_one_process_answers_as_a_job_of_one_node():
    """``comm.control(None)``: rank 0 of 1, every call answered at once with
    this process's own values, a wrong array shape refused as over nodes."""
    from mp_symbolic.core.transport import comm  # pylint: disable=import-outside-toplevel
    from mp_symbolic.core.transport.nodes import NodeError  # pylint: disable=import-outside-toplevel
    plane = comm.control(None)
    assert isinstance(plane, comm.ControlPlane)
    assert (plane.rank, plane.count) == (0, 1)
    plane.barrier()
    plane.agree({'--seed': 0})
    assert plane.broadcast({'a': [1, 2]}, 0) == {'a': [1, 2]}
    assert plane.gather('mine') == ['mine']
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(plane.broadcast_array(array, 0, (2, 3), np.float32), array)
    with pytest.raises(NodeError, match=r'expected an array of shape \(3, 2\) to send, found '
                                        r'\(2, 3\)'):
        plane.broadcast_array(array, 0, (3, 2), np.float32)
