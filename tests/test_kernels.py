"""The project's own operators (mp_symbolic/core/kernels): the fused LayerNorm
computes MXNet's LayerNorm, small_batch_dot MXNet's batch_dot and
causal_attention the attention of MXNet's ops, forward and backward; the
library is built once and loaded where a graph holding an op is read; where
it cannot be built the model keeps MXNet's ops (and says why for the norm);
and the export writes MXNet's ops in their place."""
# pylint: disable=protected-access
import json
import os
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from mp_symbolic.core import kernels
from mp_symbolic.core.graph.ir import PlacedGraph
from mp_symbolic.training.tasks import gpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_COMPILER = 'no C++ compiler (g++, or $CXX) on the path'


def _needs_the_op():
    loaded, why = kernels.fused_layer_norm()
    if not loaded:
        pytest.skip(why)


def _run(symbol, values, dy, shapes):
    executor = symbol.simple_bind(mx.cpu(), **shapes)
    for name, value in values.items():
        executor.arg_dict[name][:] = value
    executor.forward(is_train=True)
    executor.backward(mx.nd.array(dy))
    return [executor.outputs[0].asnumpy()] + [executor.grad_dict[n].asnumpy() for n in values]


def test_the_fused_layer_norm_op_is_mxnets_layer_norm_forward_and_backward():
    """Against MXNet's LayerNorm op on rows of 3 to 256 features (a 3-D
    input, gamma and beta away from 1 and 0): the output and every gradient
    to float32 rounding."""
    _needs_the_op()
    rng = np.random.RandomState(0)
    for C in (3, 64, 256):
        shape = (4, 5, C)
        values = {'x': rng.normal(1.0, 2.0, shape), 'g': rng.normal(1.0, 0.3, C),
                  'b': rng.normal(0.0, 0.3, C)}
        dy = rng.normal(size=shape)
        x, g, b = (mx.sym.var(n) for n in 'xgb')
        shapes = dict(x=shape, g=(C,), b=(C,))
        want = _run(mx.sym.LayerNorm(x, g, b, axis=-1, eps=1e-5), values, dy, shapes)
        got = _run(mx.sym.fused_layer_norm(x, g, b, eps=1e-5), values, dy, shapes)
        for w, o in zip(want, got):
            np.testing.assert_allclose(o, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())


def test_the_op_refuses_other_types_and_gamma_of_another_width_in_one_line():
    _needs_the_op()
    x, g, b = (mx.sym.var(n) for n in 'xgb')
    norm = mx.sym.fused_layer_norm(x, g, b)
    with pytest.raises(mx.base.MXNetError, match='expected gamma and beta of the input'):
        norm.infer_shape(x=(2, 3, 8), g=(7,), b=(8,))
    with pytest.raises(mx.base.MXNetError, match='expected float32 inputs, found type'):
        norm.infer_type(x='float64', g='float64', b='float64')


def test_the_model_norm_is_the_fused_op_where_it_builds_and_equals_the_products():
    """gpt.LayerNorm() takes the fused op here; its results and its
    parameters' gradients are those of fused=False to float32 rounding."""
    _needs_the_op()
    rng = np.random.default_rng(1)
    X = mx.nd.array(rng.normal(0.5, 1.5, (3, 7, 16)))
    dy = mx.nd.array(rng.normal(size=(3, 7, 16)))
    results = []
    for fused in (None, False):
        norm = gpt.LayerNorm(16, fused=fused, prefix='ln_')
        assert norm.fused is (fused is None)
        norm.initialize()
        norm.gamma.set_data(mx.nd.array(np.linspace(0.5, 1.5, 16)))
        norm.beta.set_data(mx.nd.array(np.linspace(-1, 1, 16)))
        norm.hybridize()
        x = X.copy()
        x.attach_grad()
        with mx.autograd.record():
            out = norm(x)
        out.backward(dy)
        results.append([out.asnumpy(), x.grad.asnumpy(), norm.gamma.grad().asnumpy(),
                        norm.beta.grad().asnumpy()])
        ops = {n['op'] for n in json.loads(norm(mx.sym.var('data')).tojson())['nodes']}
        assert ('fused_layer_norm' in ops) is (fused is None)
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_environment_chooses_and_a_bad_choice_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv(kernels.ENV, '0')
    assert not kernels.use_fused_norm() and not gpt.LayerNorm(8).fused
    monkeypatch.setenv(kernels.ENV, 'yes')
    with pytest.raises(kernels.KernelError,
                       match=r"^MP_SYMBOLIC_FUSED_NORM: expected auto, 0 or 1, found 'yes'$"):
        kernels.use_fused_norm()
    monkeypatch.setitem(kernels._LOADED, kernels._KEY, (False, NO_COMPILER))
    monkeypatch.setenv(kernels.ENV, 'auto')
    monkeypatch.setattr(kernels, '_SAID', [])
    with pytest.warns(RuntimeWarning, match=r'^the fused LayerNorm op is not available \(no C\+\+ '
                      r'compiler .*\): the norm runs as matrix products, about 3 times slower; '
                      r'MP_SYMBOLIC_FUSED_NORM=0 chooses them without this note$'):
        assert not kernels.use_fused_norm()
    assert not gpt.LayerNorm(8).fused  # the products, and the note once a process
    monkeypatch.setenv(kernels.ENV, '1')
    with pytest.raises(kernels.KernelError, match=r'^MP_SYMBOLIC_FUSED_NORM=1: the fused '
                       r'LayerNorm op is not available: no C\+\+ compiler'):
        kernels.use_fused_norm()
    with pytest.raises(kernels.KernelError, match=r'^LayerNorm\(fused=True\): the fused op '
                       r'is not available: no C\+\+ compiler'):
        gpt.LayerNorm(8, fused=True)


def test_a_library_that_cannot_be_built_is_left_out_with_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
    monkeypatch.setenv('CXX', 'false')
    loaded, why = kernels._build_and_load()
    assert not loaded and why.startswith('building libmp_symbolic_ops-') and \
        why.endswith('failed: no output'), why
    assert os.listdir(str(tmp_path / 'mp_symbolic')) == []  # nothing half-built left
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'file'))
    (tmp_path / 'file').write_text('a file where the cache folder would be')
    loaded, why = kernels._build_and_load()
    assert not loaded and why.startswith('building in %s failed: '
                                         % (tmp_path / 'file' / 'mp_symbolic')), why


def test_a_library_that_mxnet_cannot_load_is_left_out_with_one_line(monkeypatch):
    _needs_the_op()

    def refuse(path, verbose=True):
        raise mx.base.MXNetError('library version mismatch\nmore lines')

    monkeypatch.setattr(mx.library, 'load', refuse)
    loaded, why = kernels._build_and_load()
    assert not loaded and why.startswith('loading libmp_symbolic_ops-') and \
        why.endswith('failed: library version mismatch'), why


READ_BACK = '''
import sys
import mxnet as mx
text = open(sys.argv[1]).read()
try:
    mx.sym.load_json(text)
except mx.base.MXNetError:
    print('plain MXNet refuses it')
from mp_symbolic.core import kernels
symbol = kernels.load_symbol_json(text)
print(sorted(symbol.list_arguments()))
'''


def test_a_graph_holding_the_op_is_read_back_in_a_fresh_process(tmp_path):
    """A process that never built the model reads the graph (a node, a
    checkpoint's reader, the memory estimate's children): the library is
    loaded first."""
    _needs_the_op()
    norm = gpt.LayerNorm(8, prefix='ln_')
    path = tmp_path / 'norm.json'
    path.write_text(norm(mx.sym.var('data')).tojson())
    out = subprocess.run([sys.executable, '-c', READ_BACK, str(path)], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert out == ['plain MXNet refuses it', "['data', 'ln_beta', 'ln_gamma']"]


def test_a_graph_holding_the_op_where_it_cannot_be_loaded_is_refused_in_one_line(monkeypatch):
    _needs_the_op()
    text = gpt.LayerNorm(8, prefix='ln_')(mx.sym.var('data')).tojson()
    monkeypatch.setitem(kernels._LOADED, kernels._KEY, (False, NO_COMPILER))
    with pytest.raises(kernels.KernelError, match=r'^x\.json holds the fused_layer_norm op, which '
                       r'cannot be loaded here: no C\+\+ compiler'):
        kernels.load_symbol_json(text, 'x.json')


def test_the_export_form_is_mxnets_layer_norm_with_the_same_inputs_and_results():
    _needs_the_op()
    x, g, b = (mx.sym.var(n) for n in 'xgb')
    fused = mx.sym.fused_layer_norm(x, g, b, eps=1e-3, name='ln')
    plain = kernels.with_mxnet_ops(PlacedGraph.from_symbol(fused)).to_symbol()
    node = json.loads(plain.tojson())['nodes'][-1]
    assert (node['op'], node['name'], node['attrs']) == \
        ('LayerNorm', 'ln', {'eps': '0.001', 'axis': '-1'})
    rng = np.random.RandomState(2)
    values = {'x': rng.normal(size=(2, 3, 5)), 'g': rng.normal(1, 0.2, 5), 'b': rng.normal(size=5)}
    dy = rng.normal(size=(2, 3, 5))
    shapes = dict(x=(2, 3, 5), g=(5,), b=(5,))
    for w, o in zip(_run(plain, values, dy, shapes), _run(fused, values, dy, shapes)):
        np.testing.assert_allclose(o, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())
    graph = PlacedGraph.from_symbol(plain)
    assert kernels.with_mxnet_ops(graph) is graph  # nothing of ours: as it is


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_the_norms_gradients_add_up_where_grad_req_is_add(hybridize):
    """MXNet hands a library's op no write request, so its gradients would
    overwrite; micro-batches add theirs (grad_req='add'). Two backward
    passes give twice one's gradients, for the input and both parameters."""
    _needs_the_op()
    rng = np.random.default_rng(4)
    X = mx.nd.array(rng.normal(size=(2, 3, 8)))
    dy = mx.nd.array(rng.normal(size=(2, 3, 8)))
    grads = []
    for passes in (1, 2):
        norm = gpt.LayerNorm(8, fused=True, prefix='ln_')
        norm.initialize()
        norm.gamma.set_data(mx.nd.array(np.linspace(0.5, 1.5, 8)))
        if hybridize:
            norm.hybridize()
        norm.collect_params().setattr('grad_req', 'add')
        x = X.copy()
        x.attach_grad(grad_req='add')
        for _ in range(passes):
            with mx.autograd.record():
                out = norm(x)
            out.backward(dy)
        grads.append([x.grad.asnumpy(), norm.gamma.grad().asnumpy(), norm.beta.grad().asnumpy()])
    for one, two in zip(*grads):
        np.testing.assert_allclose(two, 2 * one, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('name, expected', [('MP_SYMBOLIC_FUSED_NORM', 'auto, 0 or 1'),
                                            ('MP_SYMBOLIC_FUSED_ADAM', 'auto or 0'),
                                            ('MP_SYMBOLIC_SMALL_BATCH_DOT', 'auto, 0 or 1'),
                                            ('MP_SYMBOLIC_FUSED_ATTENTION', 'auto, 0 or 1')])
def test_the_command_line_refuses_a_bad_choice_of_op_in_one_line_before_any_work(
        tmp_path, name, expected):
    env = dict(os.environ, PYTHONPATH=ROOT, **{name: 'yes'})
    done = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'train', '--task', 'lm',
                           '--devices', 'cpu:0', '--out', str(tmp_path / 'out')], cwd=ROOT,
                          env=env, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 2 and done.stdout == ''
    assert done.stderr.strip().splitlines() == [
        "error: %s: expected %s, found 'yes'" % (name, expected)]
    assert not (tmp_path / 'out').exists()


def test_the_environment_turns_the_fused_adam_off_and_refuses_a_bad_choice(monkeypatch):
    monkeypatch.setenv('MP_SYMBOLIC_FUSED_ADAM', '0')
    assert not kernels.use_fused_adam()
    monkeypatch.setenv('MP_SYMBOLIC_FUSED_ADAM', 'auto')
    assert kernels.use_fused_adam() == kernels.library()[0]
    monkeypatch.setitem(kernels._LOADED, kernels._KEY, (False, NO_COMPILER))
    assert not kernels.use_fused_adam()   # no library: one adam_update a parameter, no note
    monkeypatch.setenv('MP_SYMBOLIC_FUSED_ADAM', '1')
    with pytest.raises(kernels.KernelError,
                       match=r"^MP_SYMBOLIC_FUSED_ADAM: expected auto or 0, found '1'$"):
        kernels.use_fused_adam()


def _adam_arrays(rng, shapes):
    return [mx.nd.array(rng.normal(0.0, 0.1, s).astype(np.float32)) for s in shapes]


@pytest.mark.parametrize('clip', [None, 0.05], ids=['plain', 'clipped'])
@pytest.mark.parametrize('in_place', [True, False], ids=['in place', 'into other arrays'])
def test_the_fused_adam_update_is_adam_update_bit_for_bit(clip, in_place):
    """50 steps over six arrays (one of one element, one of a length no vector
    width divides), each step with learning rates drawn from 1e-6 to 0.1 (so
    their strings take exponents, and many read as a float other than the
    nearest) and a weight decay on every other array: every weight and both
    moments are adam_update's, bit for bit, written over the weights or into
    other arrays."""
    _needs_the_op()
    rng = np.random.default_rng(5)
    shapes = [(64, 64), (64,), (3, 5), (1,), (166, 64), (37,)]
    n = len(shapes)
    ours = [_adam_arrays(rng, shapes)] + [[mx.nd.zeros(s) for s in shapes] for _ in range(2)]
    theirs = [[a.copy() for a in part] for part in ours]
    outs = ours[0] if in_place else [mx.nd.zeros(s) for s in shapes]
    extra = {} if clip is None else {'clip_gradient': clip}
    for _ in range(50):
        grads = _adam_arrays(rng, shapes)
        lrs = [float(x) for x in 10 ** rng.uniform(-6, -1, n)]
        wds = [0.01 * (k % 2) for k in range(n)]
        for k in range(n):
            weight, mean, var = (part[k] for part in theirs)
            mx.nd.adam_update(weight, grads[k], mean, var, out=weight, lr=lrs[k], wd=wds[k],
                              beta1=0.9, beta2=0.999, epsilon=1e-8, rescale_grad=0.5, **extra)
        arrays = [a for k in range(n) for a in (ours[0][k], grads[k], ours[1][k], ours[2][k])]
        mx.nd.fused_adam_update(*arrays, num_weights=n, lrs=lrs, wds=wds, beta1=0.9,
                                beta2=0.999, epsilon=1e-8, rescale_grad=0.5, out=outs, **extra)
        if not in_place:
            for k in range(n):
                outs[k].copyto(ours[0][k])
    for mine, want in zip(sum(ours, []), sum(theirs, [])):
        assert (mine.asnumpy().view(np.uint32) == want.asnumpy().view(np.uint32)).all()


def test_the_fused_adam_update_refuses_what_it_cannot_read_in_one_line():
    _needs_the_op()
    w, g, m, v = (mx.nd.ones((3,)) for _ in range(4))
    for kwargs, message in (
            (dict(lrs=[0.1, 0.2], wds=[0.0]), r'expected 1 lrs and wds, found 2 and 1'),
            (dict(lrs=['0.1x'], wds=[0.0]), r"expected a number for lrs, found '\['0.1x'\]'"),
            (dict(lrs=[0.1], wds=[0.0], momentum=0.9), r'no argument named momentum')):
        with pytest.raises(mx.base.MXNetError, match='fused_adam_update: ' + message):
            mx.nd.fused_adam_update(w, g, m, v, num_weights=1, out=w, **kwargs).wait_to_read()
    with pytest.raises(mx.base.MXNetError, match=r'fused_adam_update: expected float32 arrays, '
                       r'found type 1 at input 1'):
        mx.nd.fused_adam_update(w, g.astype('float64'), m, v, num_weights=1, lrs=[0.1],
                                wds=[0.0], out=w).wait_to_read()


@pytest.mark.parametrize('transpose_a', [False, True])
@pytest.mark.parametrize('transpose_b', [False, True])
def test_small_batch_dot_is_mxnets_batch_dot_forward_and_backward(transpose_a, transpose_b):
    """Against MXNet's batch_dot, bound in a graph: the output and both
    gradients to float32 rounding, at the language model's attention shapes
    (4 axes, widths 64 and 256 and a shard's two heads) and at sizes that
    leave rows and vector columns over (3 axes)."""
    _needs_the_op()
    rng = np.random.RandomState(1)
    for batch, m, k, n in (((16, 4), 64, 16, 64), ((16, 4), 64, 64, 16), ((16, 2), 64, 64, 64),
                           ((3,), 5, 7, 9), ((2,), 33, 20, 50), ((2,), 19, 3, 40)):
        shapes = dict(a=batch + ((k, m) if transpose_a else (m, k)),
                      b=batch + ((n, k) if transpose_b else (k, n)))
        values = {name: rng.normal(size=shape) for name, shape in shapes.items()}
        dy = rng.normal(size=batch + (m, n))
        a, b = mx.sym.var('a'), mx.sym.var('b')
        flags = dict(transpose_a=transpose_a, transpose_b=transpose_b)
        want = _run(mx.sym.batch_dot(a, b, **flags), values, dy, shapes)
        got = _run(mx.sym.small_batch_dot(a, b, **flags), values, dy, shapes)
        for w, o in zip(want, got):
            np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_small_batch_dot_refuses_other_shapes_and_types_in_one_line():
    _needs_the_op()
    a, b = mx.sym.var('a'), mx.sym.var('b')
    product = mx.sym.small_batch_dot(a, b, transpose_b=True)
    with pytest.raises(mx.base.MXNetError, match=r"small_batch_dot: expected the products' "
                                                  r"inner axes equal, found 16 and 8"):
        product.infer_shape(a=(4, 64, 16), b=(4, 64, 8))
    with pytest.raises(mx.base.MXNetError, match=r'small_batch_dot: expected two arrays of 3 or '
                                                  r'more axes, the same but the last two, '
                                                  r'found 2 and 2 axes'):
        product.infer_shape(a=(64, 16), b=(64, 16))
    with pytest.raises(mx.base.MXNetError, match=r'small_batch_dot: expected two arrays of 3 or '
                                                  r'more axes, the same but the last two, '
                                                  r'found 3 and 3 axes'):
        product.infer_shape(a=(4, 64, 16), b=(5, 64, 16))
    with pytest.raises(mx.base.MXNetError, match='small_batch_dot: expected float32 inputs'):
        product.infer_type(a='float64', b='float64')


def test_the_attention_with_small_batch_dot_is_the_models_and_names_its_kernel():
    """gpt._Attend with its products by small_batch_dot computes the model's
    attention (batch_dot's) to float32 rounding, forward and backward; the
    library names the loop this CPU runs."""
    _needs_the_op()
    assert kernels.small_batch_dot_kernel() in ('avx512', 'avx2', 'baseline')
    rng = np.random.RandomState(2)
    shape = (4, 16, 32)
    values = {n: rng.normal(size=shape) for n in 'qkv'}
    dy = rng.normal(size=shape)
    q, k, v = (mx.sym.var(n) for n in 'qkv')
    shapes = {n: shape for n in 'qkv'}
    attend = gpt._Attend  # pylint: disable=protected-access
    want = _run(attend(8)(mx.sym, q, k, v), values, dy, shapes)
    got = _run(attend(8, product=kernels.SMALL_BATCH_DOT)(mx.sym, q, k, v), values, dy, shapes)
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


@pytest.mark.parametrize('kernel', ['avx2', 'baseline'])
def test_each_of_small_batch_dots_loops_is_batch_dot(kernel):
    """The loops for other CPUs than this one's fastest, asked for by
    MP_SYMBOLIC_SMALL_BATCH_DOT_KERNEL in a process of their own: each
    equals batch_dot to float32 rounding (a loop the CPU cannot run is not
    chosen, and the test says which ran), and the language model keeps
    batch_dot under it."""
    _needs_the_op()
    code = (
        "import numpy as np, mxnet as mx\n"
        "from mp_symbolic.core import kernels\n"
        "kernels.library()\n"
        "rng = np.random.RandomState(3)\n"
        "for (m, k, n, ta, tb) in ((64, 16, 64, 0, 1), (33, 20, 50, 1, 0), (19, 3, 40, 1, 1)):\n"
        "    a = mx.nd.array(rng.normal(size=(2, k, m) if ta else (2, m, k)))\n"
        "    b = mx.nd.array(rng.normal(size=(2, n, k) if tb else (2, k, n)))\n"
        "    flags = dict(transpose_a=bool(ta), transpose_b=bool(tb))\n"
        "    want = mx.nd.batch_dot(a, b, **flags).asnumpy()\n"
        "    got = mx.nd.small_batch_dot(a, b, **flags).asnumpy()\n"
        "    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())\n"
        "print(kernels.use_small_batch_dot(), kernels.small_batch_dot_kernel())\n")
    env = dict(os.environ, MP_SYMBOLIC_SMALL_BATCH_DOT_KERNEL=kernel,
               MP_SYMBOLIC_SMALL_BATCH_DOT='auto')
    done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    used, ran = done.stdout.split()[-2:]
    assert ran == kernel or (kernel == 'avx2' and ran == 'baseline'), ran
    assert used == 'False'  # auto: batch_dot where the loop is not AVX-512's


def test_the_environment_chooses_the_attentions_products(monkeypatch):
    """MP_SYMBOLIC_SMALL_BATCH_DOT: unset or 0 keeps batch_dot, 1 asks for
    the op (one line where it cannot be built), auto takes it where the
    library loads with its AVX-512 loop; anything else is refused in one
    line. The language model's attention follows."""
    cfg = gpt.GPTConfig(num_layers=1, num_hiddens=16, num_heads=2, block_size=8, vocab_size=11)
    monkeypatch.delenv('MP_SYMBOLIC_SMALL_BATCH_DOT', raising=False)
    assert not kernels.use_small_batch_dot()
    monkeypatch.setenv('MP_SYMBOLIC_SMALL_BATCH_DOT', '0')
    assert not kernels.use_small_batch_dot()
    assert gpt.CausalSelfAttention(cfg).attend.product == 'batch_dot'
    monkeypatch.setenv('MP_SYMBOLIC_SMALL_BATCH_DOT', 'yes')
    with pytest.raises(kernels.KernelError, match=r"^MP_SYMBOLIC_SMALL_BATCH_DOT: expected auto, "
                                                  r"0 or 1, found 'yes'$"):
        kernels.use_small_batch_dot()
    monkeypatch.setenv('MP_SYMBOLIC_SMALL_BATCH_DOT', 'auto')
    vector = kernels.small_batch_dot_kernel() == 'avx512'
    assert kernels.use_small_batch_dot() == vector
    assert gpt.CausalSelfAttention(cfg).attend.product == (
        kernels.SMALL_BATCH_DOT if vector else 'batch_dot')
    monkeypatch.setitem(kernels._LOADED, kernels._KEY, (False, NO_COMPILER))
    assert not kernels.use_small_batch_dot()  # auto: batch_dot, nothing said
    monkeypatch.setenv('MP_SYMBOLIC_SMALL_BATCH_DOT', '1')
    with pytest.raises(kernels.KernelError, match=r'^MP_SYMBOLIC_SMALL_BATCH_DOT=1: the '
                       r'small_batch_dot op is not available: no C\+\+ compiler'):
        kernels.use_small_batch_dot()


def test_the_export_form_of_small_batch_dot_is_batch_dot_with_the_same_attributes():
    _needs_the_op()
    a, b = mx.sym.var('a'), mx.sym.var('b')
    ours = mx.sym.small_batch_dot(a, b, transpose_b=True, name='scores')
    plain = kernels.with_mxnet_ops(PlacedGraph.from_symbol(ours)).to_symbol()
    node = json.loads(plain.tojson())['nodes'][-1]
    assert (node['op'], node['name'], node['attrs']) == \
        ('batch_dot', 'scores', {'transpose_b': 'True'})
    rng = np.random.RandomState(4)
    shapes = dict(a=(2, 3, 6, 5), b=(2, 3, 7, 5))
    values = {n: rng.normal(size=s) for n, s in shapes.items()}
    dy = rng.normal(size=(2, 3, 6, 7))
    for w, o in zip(_run(plain, values, dy, shapes), _run(ours, values, dy, shapes)):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_a_graph_holding_both_ops_where_they_cannot_be_loaded_names_both_in_one_line(
        monkeypatch):
    """The graph's ops are read from its nodes: a parameter merely named like
    the op does not count."""
    _needs_the_op()
    x = mx.sym.var('data')
    norm = gpt.LayerNorm(8, prefix='ln_')(x)
    both = mx.sym.small_batch_dot(norm, norm, transpose_b=True)
    named = mx.sym.var('small_batch_dot') + x
    monkeypatch.setitem(kernels._LOADED, kernels._KEY, (False, NO_COMPILER))
    with pytest.raises(kernels.KernelError, match=r'^x\.json holds the fused_layer_norm and '
                       r'small_batch_dot op, which cannot be loaded here: no C\+\+ compiler'):
        kernels.load_symbol_json(both.tojson(), 'x.json')
    assert kernels.load_symbol_json(named.tojson()).list_arguments() == ['small_batch_dot', 'data']


def _attention_values(rng, shape):
    return {n: rng.normal(size=shape) for n in 'qkv'}, rng.normal(size=shape)


@pytest.mark.parametrize('shape, head_dim', [
    ((16, 64, 64), 16), ((4, 64, 256), 64),  # the language model's widths, 4 heads
    ((2, 33, 40), 20), ((3, 17, 24), 8), ((2, 5, 12), 3), ((2, 1, 8), 8), ((1, 130, 64), 32)])
def test_causal_attention_is_the_attention_of_mxnets_ops_forward_and_backward(shape, head_dim):
    """Against kernels.attention_of_mxnet_ops (the model's attention where the
    op is not chosen: batch_dot, the mask, softmax), bound in a graph: the
    result and the three gradients to float32 rounding, at heads whose width
    is or is not a multiple of 16 and sequences of 1 to 130 positions."""
    _needs_the_op()
    rng = np.random.RandomState(5)
    values, dy = _attention_values(rng, shape)
    q, k, v = (mx.sym.var(n) for n in 'qkv')
    shapes = {n: shape for n in 'qkv'}
    want = _run(kernels.attention_of_mxnet_ops(mx.sym, q, k, v, head_dim), values, dy, shapes)
    got = _run(mx.sym.causal_attention(q, k, v, head_dim=head_dim), values, dy, shapes)
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_causal_attention_sees_no_later_position_and_takes_the_scale_given():
    """A change to the keys and values of the last position changes only the
    last position's result; scale=0 averages the values seen so far."""
    _needs_the_op()
    rng = np.random.RandomState(6)
    q, k, v = (mx.nd.array(rng.normal(size=(2, 9, 8))) for _ in range(3))
    out = mx.nd.causal_attention(q, k, v, head_dim=4).asnumpy()
    k2, v2 = k.copy(), v.copy()
    k2[:, -1] += 3
    v2[:, -1] -= 2
    moved = mx.nd.causal_attention(q, k2, v2, head_dim=4).asnumpy()
    np.testing.assert_array_equal(moved[:, :-1], out[:, :-1])
    assert np.abs(moved[:, -1] - out[:, -1]).min() > 0
    mean = np.cumsum(v.asnumpy(), axis=1) / np.arange(1, 10)[None, :, None]
    np.testing.assert_allclose(mx.nd.causal_attention(q, k, v, head_dim=4, scale=0).asnumpy(),
                               mean, rtol=1e-5, atol=1e-6)


def test_causal_attention_refuses_what_it_cannot_compute_in_one_line():
    _needs_the_op()
    q, k, v = (mx.sym.var(n) for n in 'qkv')
    for head_dim in ('x', '0', '-4', '99999999999999999999'):
        with pytest.raises(mx.base.MXNetError, match=r'causal_attention: expected head_dim, a '
                           r"whole number from 1 to 1048576, found '%s'" % head_dim):
            mx.sym.causal_attention(q, k, v, head_dim=head_dim)
    with pytest.raises(mx.base.MXNetError, match=r'causal_attention: expected head_dim, a '
                                                  r'whole number from 1 to 1048576, found none'):
        mx.sym.causal_attention(q, k, v)
    for scale in ('x', '0.5y', 'inf', 'nan'):
        with pytest.raises(mx.base.MXNetError, match=r'causal_attention: expected scale, a '
                           r"finite number, found '%s'" % scale):
            mx.sym.causal_attention(q, k, v, head_dim=4, scale=scale)
    attention = mx.sym.causal_attention(q, k, v, head_dim=16)
    with pytest.raises(mx.base.MXNetError, match=r'causal_attention: expected C a multiple of '
                                                  r'head_dim 16, found C 40'):
        attention.infer_shape(q=(2, 8, 40), k=(2, 8, 40), v=(2, 8, 40))
    with pytest.raises(mx.base.MXNetError, match=r'causal_attention: expected queries, keys and '
                                                  r'values of one shape \(N, T, C\), found '
                                                  r'\(2, 8, 32\), \(2, 7, 32\) and \(2, 8, 32\)'):
        attention.infer_shape(q=(2, 8, 32), k=(2, 7, 32), v=(2, 8, 32))
    with pytest.raises(mx.base.MXNetError, match=r'causal_attention: expected queries, keys and '
                                                  r'values of one shape \(N, T, C\), found '
                                                  r'\(8, 32\), \(8, 32\) and \(8, 32\)'):
        attention.infer_shape(q=(8, 32), k=(8, 32), v=(8, 32))
    with pytest.raises(mx.base.MXNetError, match='causal_attention: expected float32 inputs'):
        attention.infer_type(q='float64', k='float64', v='float64')


@pytest.mark.parametrize('kernel', ['avx2', 'baseline'])
def test_each_of_causal_attentions_loops_is_the_attention_of_mxnets_ops(kernel):
    """The op's loops for other CPUs than this one's fastest
    (MP_SYMBOLIC_SMALL_BATCH_DOT_KERNEL, in a process of their own), forward
    and backward, to float32 rounding; the model takes the op under each."""
    _needs_the_op()
    code = (
        "import numpy as np, mxnet as mx\n"
        "from mp_symbolic.core import kernels\n"
        "kernels.library()\n"
        "rng = np.random.RandomState(7)\n"
        "for shape, D in (((3, 64, 64), 16), ((2, 19, 36), 12), ((2, 40, 128), 64)):\n"
        "    results = []\n"
        "    for attend in (lambda q, k, v: kernels.attention_of_mxnet_ops(mx.nd, q, k, v, D),\n"
        "                   lambda q, k, v: mx.nd.causal_attention(q, k, v, head_dim=D)):\n"
        "        rng = np.random.RandomState(8)\n"
        "        xs = [mx.nd.array(rng.normal(size=shape)) for _ in range(3)]\n"
        "        for x in xs:\n"
        "            x.attach_grad()\n"
        "        with mx.autograd.record():\n"
        "            out = attend(*xs)\n"
        "        out.backward(mx.nd.array(rng.normal(size=shape)))\n"
        "        results.append([out.asnumpy()] + [x.grad.asnumpy() for x in xs])\n"
        "    for want, got in zip(*results):\n"
        "        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())\n"
        "print(kernels.use_fused_attention(), kernels.small_batch_dot_kernel())\n")
    env = dict(os.environ, MP_SYMBOLIC_SMALL_BATCH_DOT_KERNEL=kernel)
    env.pop('MP_SYMBOLIC_FUSED_ATTENTION', None)
    env.pop('MP_SYMBOLIC_SMALL_BATCH_DOT', None)
    done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    used, ran = done.stdout.split()[-2:]
    assert ran == kernel or (kernel == 'avx2' and ran == 'baseline'), ran
    assert used == str(not mx.runtime.Features().is_enabled('CUDA'))


def test_the_environment_chooses_the_attention_op(monkeypatch):
    """MP_SYMBOLIC_FUSED_ATTENTION: unset or auto takes the op where the
    library loads (unless MP_SYMBOLIC_SMALL_BATCH_DOT asks for the products
    with MXNet's softmax), 0 keeps MXNet's ops, 1 requires it (one line where
    it cannot be built, or where the products are required too); anything
    else is refused in one line. The language model's attention follows."""
    _needs_the_op()
    cfg = gpt.GPTConfig(num_layers=1, num_hiddens=16, num_heads=2, block_size=8, vocab_size=11)
    monkeypatch.delenv('MP_SYMBOLIC_FUSED_ATTENTION', raising=False)
    monkeypatch.delenv('MP_SYMBOLIC_SMALL_BATCH_DOT', raising=False)
    cpu = not mx.runtime.Features().is_enabled('CUDA')
    assert kernels.use_fused_attention() == cpu
    assert gpt.CausalSelfAttention(cfg).attend.fused == cpu
    monkeypatch.setenv('MP_SYMBOLIC_FUSED_ATTENTION', '0')
    assert not kernels.use_fused_attention() and not gpt.CausalSelfAttention(cfg).attend.fused
    monkeypatch.setenv('MP_SYMBOLIC_FUSED_ATTENTION', 'on')
    with pytest.raises(kernels.KernelError, match=r"^MP_SYMBOLIC_FUSED_ATTENTION: expected auto, "
                                                  r"0 or 1, found 'on'$"):
        kernels.use_fused_attention()
    monkeypatch.setenv('MP_SYMBOLIC_FUSED_ATTENTION', 'auto')
    monkeypatch.setenv('MP_SYMBOLIC_SMALL_BATCH_DOT', '1')
    attend = gpt.CausalSelfAttention(cfg).attend
    assert not attend.fused and attend.product == kernels.SMALL_BATCH_DOT
    monkeypatch.setenv('MP_SYMBOLIC_FUSED_ATTENTION', '1')
    with pytest.raises(kernels.KernelError, match=r'^MP_SYMBOLIC_FUSED_ATTENTION=1 and '
                                                  r'MP_SYMBOLIC_SMALL_BATCH_DOT=1: the attention '
                                                  r'is one op or'):
        kernels.use_fused_attention()
    monkeypatch.delenv('MP_SYMBOLIC_SMALL_BATCH_DOT')
    assert kernels.use_fused_attention()
    monkeypatch.setitem(kernels._LOADED, kernels._KEY, (False, NO_COMPILER))
    with pytest.raises(kernels.KernelError, match=r'^MP_SYMBOLIC_FUSED_ATTENTION=1: the '
                       r'causal_attention op is not available: no C\+\+ compiler'):
        kernels.use_fused_attention()
    monkeypatch.setenv('MP_SYMBOLIC_FUSED_ATTENTION', 'auto')
    assert not kernels.use_fused_attention()  # MXNet's ops, nothing said
    attend = gpt.CausalSelfAttention(cfg).attend
    assert not attend.fused and attend.product == 'batch_dot'


def test_the_export_form_of_causal_attention_is_mxnets_ops_in_its_group():
    """with_mxnet_ops writes the op as attention_of_mxnet_ops's nodes, named
    from it and in its ctx_group, reading the op's inputs and read by its
    readers: the same results, forward and backward."""
    _needs_the_op()
    q, k, v = (mx.sym.var(n) for n in 'qkv')
    with mx.AttrScope(ctx_group='stage1'):
        ours = mx.sym.causal_attention(mx.sym.identity(q), k, v, head_dim=4, name='attend')
    ours = mx.sym.FullyConnected(ours * 2, num_hidden=3, flatten=False, name='fc')
    plain = kernels.with_mxnet_ops(PlacedGraph.from_symbol(ours)).to_symbol()
    nodes = json.loads(plain.tojson())['nodes']
    assert kernels.CAUSAL_ATTENTION not in {n['op'] for n in nodes}
    inner = [n for n in nodes if n['name'].startswith('attend_')]
    assert {n['op'] for n in inner} >= {'batch_dot', 'softmax', 'transpose'}
    assert {n['attrs']['__ctx_group__'] for n in inner} == {'stage1'}
    assert sorted(plain.list_arguments()) == sorted(ours.list_arguments())
    rng = np.random.RandomState(9)
    shapes = {n: (2, 7, 12) for n in 'qkv'}
    values = {n: rng.normal(size=s) for n, s in shapes.items()}
    values.update(fc_weight=rng.normal(size=(3, 12)), fc_bias=rng.normal(size=(3,)))
    shapes.update(fc_weight=(3, 12), fc_bias=(3,))
    dy = rng.normal(size=(2, 7, 3))
    for w, o in zip(_run(plain, values, dy, shapes), _run(ours, values, dy, shapes)):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


class _Attention(mx.gluon.HybridBlock):
    def __init__(self, head_dim, **kwargs):
        super().__init__(**kwargs)
        self.attend = gpt._Attend(head_dim, fused=True)

    def hybrid_forward(self, F, q, k, v):  # pylint: disable=arguments-differ
        return self.attend(F, q, k, v)


@pytest.mark.parametrize('hybridize', [False, True], ids=['imperative', 'hybridized'])
def test_the_attentions_gradients_add_up_where_grad_req_is_add(hybridize):
    """MXNet hands a library's op no write request; the model's attention
    with the op reads its inputs through identities, so that two backward
    passes into arrays of grad_req='add' give twice one's gradients."""
    _needs_the_op()
    rng = np.random.default_rng(10)
    inputs = [mx.nd.array(rng.normal(size=(2, 8, 16))) for _ in range(3)]
    dy = mx.nd.array(rng.normal(size=(2, 8, 16)))
    grads = []
    for passes in (1, 2):
        attention = _Attention(8)
        if hybridize:
            attention.hybridize()
        xs = [x.copy() for x in inputs]
        for x in xs:
            x.attach_grad(grad_req='add')
        for _ in range(passes):
            with mx.autograd.record():
                out = attention(*xs)
            out.backward(dy)
        grads.append([x.grad.asnumpy() for x in xs])
    for one, two in zip(*grads):
        assert np.abs(one).max() > 0
        np.testing.assert_allclose(two, 2 * one, rtol=1e-6, atol=1e-6)
