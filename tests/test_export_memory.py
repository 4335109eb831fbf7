"""The export's memory: a GluonNLP BERT (random weights) split by
``Pipeline(..., tensor_parallel='auto')`` exports within a peak resident set
proportional to its parameters and verifies at several batch sizes by default;
the pieces that keep one copy of the weights at a time (the weights written
into the finished ONNX model only, the file written one initializer at a
time, shape inference without the weights' values, activations counted per
sample) each checked on their own.
"""
import json
import os
import subprocess
import sys

import mxnet as mx
from mxnet.onnx.mx2onnx._export_onnx import MXNetGraph
import numpy as np
import onnx
import pytest

import mp_symbolic
from mp_symbolic import Pipeline

from export.exporter import export_checkpoint
from export.inference import activation_bytes
from export.onnx_export import save_onnx, to_onnx, without_weight_values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')

# The peak resident set of `python -m export` is at most K times the
# parameters' bytes plus BASE: Python with MXNet, onnx and onnxruntime imported
# (0.39 GB), and the activations of the largest batch verified. Measured
# (ru_maxrss; 2 shared cores): the BERT below, 133.5 MB of parameters, 1.26 GB
# at batch sizes 1, 7 and 177; BERT-base (12 layers of 768, sequence length
# 128, docs/export.md), 437.9 MB, 2.09 to 2.16 GB at 1, 7 and 16: about 3 bytes
# more at the peak for each byte of parameters, and 0.85 GB at none. Before
# (every runtime held at once, the ONNX conversion's copies of the weights):
# 2.53 GB for this BERT at 1, 7 and 10, 5.3 to 6.0 GB for BERT-base at 1 alone.
K = 4
BASE = 1 << 30
# A BERT of 4 layers of 512 units (8 heads, 2048 hidden) over a vocabulary of 40,000
# at sequence length 64: 33.4 million parameters, enough for them to show
# against BASE, few enough to export in about 15 s.
LAYERS, UNITS, HEADS, HIDDEN, VOCAB, SEQ = 4, 512, 8, 2048, 40000, 64

_MEASURED = """
import resource, subprocess, sys
status = subprocess.run([sys.executable, '-m', 'export'] + sys.argv[1:],
                        stdout=subprocess.DEVNULL).returncode
print(status, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def _bert_checkpoint(folder):
    """The BERT above, split over two stages of two devices and sharded
    automatically, committed by ``mp_symbolic.save_checkpoint``; its
    parameters' bytes and a sample of 8 rows."""
    bert = pytest.importorskip('gluonnlp.model.bert')
    mx.random.seed(0)
    encoder = bert.BERTEncoder(num_layers=LAYERS, units=UNITS, hidden_size=HIDDEN,
                               max_length=SEQ, num_heads=HEADS, prefix='encoder_')
    net = bert.BERTModel(encoder, VOCAB, token_type_vocab_size=2, units=UNITS, embed_size=UNITS,
                         use_pooler=True, use_decoder=False, use_classifier=False, prefix='bert_')
    net.initialize(mx.init.Normal(0.02))
    rng = np.random.default_rng(0)
    xs = [rng.integers(0, VOCAB, (8, SEQ)).astype(np.float32),
          rng.integers(0, 2, (8, SEQ)).astype(np.float32),
          rng.integers(1, SEQ + 1, (8,)).astype(np.float32)]
    net(*[mx.nd.array(x[:1]) for x in xs])
    values = {name: p.data() for name, p in net.collect_params().items()}
    pipe = Pipeline(net, 'cpu:0+cpu:1,cpu:2+cpu:3', sample=tuple(x[:1] for x in xs),
                    tensor_parallel='auto')
    mod = pipe.module(loss=None)
    mod.bind(data_shapes=list(zip(pipe.data_names(), [(1,) + x.shape[1:] for x in xs])),
             for_training=False)
    mod.init_params(arg_params=values, aux_params={}, allow_missing=False, allow_extra=True)
    mp_symbolic.save_checkpoint(mod, folder, epoch=0, name='bert')
    sample = os.path.join(folder, 'sample.npz')
    np.savez(sample, **dict(zip(pipe.input_names, xs)))
    return sum(v.size * 4 for v in values.values()), sample


@pytest.mark.slow
def test_bert_exports_within_a_peak_proportional_to_its_parameters_at_several_batch_sizes(
        tmp_path):
    param_bytes, sample = _bert_checkpoint(str(tmp_path / 'bert'))
    assert param_bytes > 130e6
    proc = subprocess.run([sys.executable, '-c', _MEASURED, '--checkpoint', str(tmp_path / 'bert'),
                           '--out', str(tmp_path / 'out'), '--sample', sample],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    status, peak_kb = (int(v) for v in proc.stdout.split())
    assert status == 0, proc.stderr
    with open(str(tmp_path / 'out' / 'current' / 'bert-verification.json')) as f:
        report = json.load(f)
    assert report['ok']
    assert len(report['batch_sizes']) >= 2 and report['batch_sizes'][:2] == [1, 7]
    assert {row['batch_size'] for row in report['parity']} == set(report['batch_sizes'])
    assert peak_kb * 1024 <= K * param_bytes + BASE, (peak_kb, param_bytes)


def _scaled_weight_graph():
    """Two Dense layers on two stages, the first reading its weight through
    ``_mul_scalar`` (MXNet's converter folds the scalar into the weight's
    values), over 100,000-value weights (dropped by without_weight_values)."""
    with mx.AttrScope(ctx_group='stage0'):
        data = mx.sym.var('data')
        weight = mx.sym.var('dense0_weight') * 2.0
        h = mx.sym.FullyConnected(data, weight=weight, num_hidden=400, name='dense0')
    with mx.AttrScope(ctx_group='stage1'):
        out = mx.sym.FullyConnected(mx.sym.relu(h), num_hidden=250, name='dense1')
    rng = np.random.default_rng(0)
    params = {'dense0_weight': (400, 250), 'dense0_bias': (400,), 'dense1_weight': (250, 400),
              'dense1_bias': (250,)}
    return out, {k: mx.nd.array(rng.normal(0, 0.05, s).astype(np.float32))
                 for k, s in params.items()}


def test_weights_written_into_the_finished_model_equal_mxnets_own_conversion(tmp_path):
    symbol, params = _scaled_weight_graph()
    source = {'symbol': str(tmp_path / 's.json'), 'params': str(tmp_path / 'p.params')}
    symbol.save(source['symbol'])
    mx.nd.save(source['params'], params)
    to_numpy = MXNetGraph.__dict__['convert_weights_to_numpy']
    model = to_onnx(symbol, params, {}, source, (250,))
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for name in ('dense0_bias', 'dense1_weight', 'dense1_bias'):
        np.testing.assert_array_equal(values[name], params[name].asnumpy())
    # the weight read by _mul_scalar was given its values before MXNet folded the scalar in
    folded = [v for v in values.values() if v.shape == (400, 250)]
    assert folded and any(np.allclose(v, 2 * params['dense0_weight'].asnumpy()) for v in folded)
    onnx.checker.check_model(model, full_check=True)
    # outside the export, MXNet's own conversion runs as before, every weight with its values
    assert MXNetGraph.__dict__['convert_weights_to_numpy'] is to_numpy
    path = mx.onnx.export_model(symbol, params, [(1, 250)], [np.float32],
                                str(tmp_path / 'mxnet.onnx'))
    theirs = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    np.testing.assert_array_equal(theirs['dense1_weight'], values['dense1_weight'])


def test_scaled_weight_exports_with_parity(tmp_path):
    symbol, params = _scaled_weight_graph()
    prefix = str(tmp_path / 'scaled')
    mx.model.save_checkpoint(prefix, 1, symbol, params, {})
    _, report = export_checkpoint(prefix, str(tmp_path / 'out'), epoch=1,
                                  input_shape=(250,), log=lambda line: None)
    assert report['ok'] and report['batch_sizes'] == [1, 7, 1000]


def _scaled_weight_model(folder):
    """:func:`_scaled_weight_graph` converted to ONNX, its files in ``folder``."""
    symbol, params = _scaled_weight_graph()
    source = {'symbol': str(folder / 's.json'), 'params': str(folder / 'p.params')}
    symbol.save(source['symbol'])
    mx.nd.save(source['params'], params)
    return to_onnx(symbol, params, {}, source, (250,))


def test_onnx_file_written_one_initializer_at_a_time_reads_back_equal(tmp_path):
    model = _scaled_weight_model(tmp_path)
    save_onnx(model, str(tmp_path / 'm.onnx'))
    assert onnx.load(str(tmp_path / 'm.onnx')) == model
    onnx.save(model, str(tmp_path / 'reference.onnx'))
    assert os.path.getsize(str(tmp_path / 'm.onnx')) == os.path.getsize(
        str(tmp_path / 'reference.onnx'))


def test_shape_inference_without_the_weights_values_infers_the_same_shapes(tmp_path):
    model = _scaled_weight_model(tmp_path)
    light = without_weight_values(model)
    assert light.ByteSize() < model.ByteSize() / 10
    kept = {t.name: bool(t.raw_data or t.float_data) for t in light.graph.initializer}
    assert kept['dense0_bias'] and not kept['dense1_weight']  # 400 values kept, 100,000 not
    assert [t.name for t in light.graph.initializer] == [t.name for t in model.graph.initializer]

    def shapes(m):
        inferred = onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True)
        return [(v.name, str(v.type)) for v in list(inferred.graph.value_info)
                + list(inferred.graph.output)]
    assert shapes(light) == shapes(model)


def test_activation_bytes_leave_out_outputs_computed_from_the_parameters_alone():
    with mx.AttrScope(ctx_group='stage0'):
        weight = mx.sym.transpose(mx.sym.var('w'))                # (6, 4) once, whatever the batch
        h = mx.sym.FullyConnected(mx.sym.var('data'), weight=weight, num_hidden=6,
                                  no_bias=True, name='dense0')  # 6 floats a sample
        out = mx.sym.relu(h)                                      # 6 more
    params = {'w': mx.nd.zeros((4, 6))}
    assert activation_bytes(out, params, {}, {'data': (4,)}) == 12 * 4
