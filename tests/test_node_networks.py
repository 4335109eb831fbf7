"""Real GluonCV and GluonNLP networks over two node processes, as
``python -m bench.node_networks`` trains them (its small sizes): after
``mx.random.seed(0)`` and ``fit(initializer=mx.init.Xavier())`` with Adam
under 1F1B with micro-batches, the nodes hold one process's parameters,
running statistics and outputs bit for bit. The table's other networks
(ResNet-152 v1d, VGG-16 with BatchNorm, DenseNet-121, Inception-v3,
YOLOv3, the LSTM language model) and its command-line route are run by the
benchmark only (docs/nodes.md)."""
import os

import numpy as np
import pytest

from bench import node_networks
from conftest import reserved_port, run_node_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, 'tests', 'node_networks_worker.py')
# BERT sharded by tensor_parallel='auto' (two devices per stage), SimplePose's heatmaps
NETWORKS = ['bert', 'simple_pose_resnet18_v1b']


@pytest.fixture(scope='module')
def two_nodes(tmp_path_factory):
    """What the two nodes hold after each network of :data:`NETWORKS`, merged."""
    out = os.path.join(str(tmp_path_factory.mktemp('node-networks')), 'node')
    with reserved_port() as port:
        run_node_workers(WORKER, out, 2, port, NETWORKS)
    merged = []
    for k in range(len(NETWORKS)):
        parts = []
        for rank in range(2):
            with np.load('%s%d_%d.npz' % (out, k, rank)) as data:
                parts.append(dict(data))
        merged.append((parts, node_networks.merge(parts)))
    return merged


@pytest.mark.slow
@pytest.mark.parametrize('k', range(len(NETWORKS)), ids=NETWORKS)
def test_real_networks_fitted_over_two_nodes_hold_one_process_parameters_statistics_and_outputs(
        two_nodes, k):
    parts, held = two_nodes[k]
    expected = node_networks.fitted(NETWORKS[k], quick=True)
    # each node holds its own stages' parameters; both read the outputs
    assert all(any(key.startswith('param:') for key in part) for part in parts)
    assert all(any(key.startswith('output:') for key in part) for part in parts)
    assert sorted(held) == sorted(expected)
    if NETWORKS[k] != 'bert':
        assert any(key.startswith('aux:') for key in expected)
    found = node_networks.differences(held, expected)
    assert found == {'params': 0.0, 'aux': 0.0, 'outputs': 0.0}, found
