"""The task of ``python -m bench.node_networks``'s command-line route:
``python -m mp_symbolic train --task bench.node_task --task-arg network=NAME``.

Network ``NAME`` of :data:`bench.node_networks.PLANS`, given whole, trained
by Adam on :data:`~bench.node_networks.STEPS` batches, each the network's
sample and label (one epoch). What the command line has no flag for is done
here:

- a network of several outputs: the loss is a callable reading the output
  the Python route's ``pipe.module(output=...)`` reads;
- the LSTM language model (``(T, N)`` tokens and ``(1, N, C)`` states, batch
  on axis 1): wrapped to take its tokens and states batch first (the
  command line's data are examples first) and to return its decoder's
  output, ``(N, T, V)``;
- BERT: sharded by :func:`mp_symbolic.core.parallel.autotp.apply` (``'auto'``) over
  ``shards`` devices, as ``Pipeline(..., tensor_parallel='auto')`` shards it
  (the command line takes tensor-parallel layers in the network, given by
  ``cpu:0+cpu:1`` devices).
"""
import mxnet as mx
import numpy as np
from mxnet import gluon

import mp_symbolic
from bench import networks, node_networks

__all__ = ['task', 'outputs_of']


class BatchFirst(gluon.HybridBlock):
    """GluonNLP's ``AWDRNN`` taking ``(N, T)`` tokens and ``(N, 1, C)``
    states, returning its decoder's output ``(N, T, V)``; the parameters
    are the wrapped network's (this block has no prefix of its own)."""

    def __init__(self, net):
        super().__init__(prefix='')
        with self.name_scope():
            self.net = net

    def hybrid_forward(self, F, x, *states):  # pylint: disable=arguments-differ
        pairs = [[F.swapaxes(states[i], 0, 1), F.swapaxes(states[i + 1], 0, 1)]
                 for i in range(0, len(states), 2)]
        out, _ = self.net(F.transpose(x), pairs)
        return F.swapaxes(out, 0, 1)


def _head(loss, output):
    """The callable loss reading output ``output`` of several."""
    def head(outputs, label):
        if loss == 'l2':
            return mx.sym.LinearRegressionOutput(outputs[output], label)
        return mx.sym.SoftmaxOutput(outputs[output], label)
    return head


def _batch_first(spec):
    """``(net, leaves, label)`` of the language model, batch first."""
    x, states = spec['sample']
    leaves = [x.T] + [np.swapaxes(s, 0, 1) for pair in states for s in pair]
    return BatchFirst(spec['net']), leaves, spec['label'].T


def task(network='resnet18_v1b', shards=2):
    """Network ``network`` of :data:`bench.node_networks.PLANS` as a
    :class:`mp_symbolic.Task` (``shards``: BERT's tensor-parallel devices per
    stage)."""
    if network not in node_networks.PLANS:
        raise ValueError('network: expected one of %s, found %r'
                         % (', '.join(node_networks.PLANS), network))
    spec = node_networks.spec_of(network)[0]
    loss = spec['loss']
    if spec.get('batch_axis') == 1:
        net, leaves, label = _batch_first(spec)
    else:
        net, leaves, label = spec['net'], networks._flat(spec['sample']), spec['label']  # pylint: disable=protected-access
        if spec['output'] is not None:
            loss = _head(loss, spec['output'])
    if network == 'bert':
        from mp_symbolic.core.parallel import autotp  # pylint: disable=import-outside-toplevel
        net = autotp.apply([net], 'auto', '+'.join('cpu:%d' % k for k in range(shards)),
                           ('data0', 'data1', 'data2'))[0][0]
    steps = node_networks.STEPS
    data = [np.concatenate([a] * steps) for a in leaves]
    return mp_symbolic.Task(
        name=network.replace('.', '_'), blocks=net,
        train=(tuple(data) if len(data) > 1 else data[0], np.concatenate([label] * steps)),
        loss=loss, batch_size=len(label), num_epochs=1, optimizer='adam',
        lr=spec.get('lr', node_networks.LR),
        description='%s (bench.node_networks), random weights' % network)


def outputs_of(network, runs):
    """The outputs of ``network`` on its sample, on one device, for each
    of ``runs`` (name -> numpy, every parameter of the network): a list of
    output lists."""
    spec = node_networks.spec_of(network)[0]
    names = set(spec['net'].collect_params())
    found = []
    for values in runs:
        if names - set(values):
            raise ValueError('expected values for every parameter of %s, found none for %s'
                             % (network, ', '.join(sorted(names - set(values))[:3])))
        found.append(networks._with_values(spec['net'], values, spec['sample']))  # pylint: disable=protected-access
    return found
