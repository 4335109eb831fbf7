"""A block whose ``hybrid_forward`` fails on Symbols (it calls what only
NDArrays take) is refused in one line naming the block and the call, from
Python and from the command line, instead of MXNet's traceback from its
symbol creator (GluonCV's GroupNorm, GluonNLP's LSTM language model with
dropout); the imperative twin of a block list still runs it."""
import subprocess
import sys

import mxnet as mx
from mxnet import gluon
import numpy as np
import pytest

from mp_symbolic import Pipeline
from mp_symbolic.core.base.compat import NotSymbolSafe


class ReadsShape(gluon.HybridBlock):
    """``x / x.shape[1]``: runs on NDArrays only (a Symbol has no ``shape``)."""

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return x / x.shape[1]


MESSAGE = r'^blocks: expected every hybrid_forward to run on Symbols \(the split traces the ' \
          r'network\), found %s \(%s\) failing: %s: '


def test_gluoncv_group_norm_is_refused_in_one_line_naming_the_block():
    import gluoncv  # pylint: disable=import-outside-toplevel
    net = gluoncv.model_zoo.get_model('resnet50_v1b_gn', classes=10, pretrained=False)
    with pytest.raises(NotSymbolSafe, match=MESSAGE % ('resnetv1b_groupnorm0', 'GroupNorm',
                                                       'MXNetError')) as err:
        Pipeline(net, 'cpu:0,cpu:1', sample=(1, 3, 32, 32))
    assert '\n' not in str(err.value) and 'keep_highest' in str(err.value)


class Logits(gluon.HybridBlock):
    """A language model's logits without its states (GluonNLP returns both)."""

    def __init__(self, lm, **kwargs):
        super().__init__(**kwargs)
        self.lm = lm

    def hybrid_forward(self, F, tokens):  # pylint: disable=arguments-differ
        return self.lm(tokens)[0]


def _standard_lstm_lm_200(dropout=0.2):
    """GluonNLP's ``standard_lstm_lm_200`` (embedding and hidden 200, two
    layers, tied weights) with random weights and a vocabulary of 50."""
    from gluonnlp.model.language_model import StandardRNN, standard_lstm_lm_200_hparams  # pylint: disable=import-outside-toplevel
    return StandardRNN(vocab_size=50, prefix='lm_',
                       **dict(standard_lstm_lm_200_hparams, dropout=dropout))


CALL = r'; at `encoded = nd.Dropout\(encoded, p=self._dropout, axes=\(0,\)\)` ' \
       r'\(language_model.py, line \d+\)$'


def test_gluonnlp_lstm_lm_with_dropout_is_refused_in_one_line_naming_the_block_and_the_call():
    """``StandardRNN.hybrid_forward`` calls ``nd.Dropout`` on whatever it is
    given: MXNet's ``AssertionError: Argument data must have NDArray type,
    but got <Symbol ...>`` traceback, now one line."""
    with pytest.raises(NotSymbolSafe, match=MESSAGE % ('lm', 'StandardRNN', 'AssertionError')
                       + 'Argument data must have NDArray type, but got <Symbol .*>' + CALL) \
            as err:
        Pipeline(_standard_lstm_lm_200(), 'cpu:0,cpu:1', sample=(5, 4))  # (T, N) tokens
    assert '\n' not in str(err.value)


def test_the_twin_of_a_block_list_runs_the_lstm_lm_the_module_refuses():
    pipe = Pipeline([Logits(_standard_lstm_lm_200(), prefix='logits_'),
                     gluon.nn.Dense(8, flatten=False, in_units=50, prefix='out_')],
                    'cpu:0,cpu:1')
    pipe.initialize()
    tokens = mx.nd.array(np.random.default_rng(0).integers(0, 50, size=(5, 4)), ctx=mx.cpu(0))
    assert pipe(tokens).shape == (5, 4, 8)  # imperatively it runs
    with pytest.raises(NotSymbolSafe, match=MESSAGE % ('lm', 'StandardRNN', 'AssertionError')):
        pipe.module(loss='softmax')


def _tokens_and_states():
    rng = np.random.default_rng(0)
    tokens = mx.nd.array(rng.integers(0, 50, size=(5, 4)), ctx=mx.cpu(0))  # (T, N)
    return tokens, [mx.nd.array(rng.normal(size=(2, 4, 200))) for _ in range(2)]  # (L, N, C)


def test_gluonnlp_lm_given_whole_with_its_states_is_refused_in_one_line_naming_the_call():
    """``get_model('standard_lstm_lm_200')`` (dropout 0.2) with ``sample=(x,
    [h, c])``: the states are taken, and the ``nd.Dropout`` is what refuses."""
    import gluonnlp  # pylint: disable=import-outside-toplevel
    vocab = gluonnlp.Vocab(gluonnlp.data.count_tokens([str(i) for i in range(46)]))
    net, _ = gluonnlp.model.get_model('standard_lstm_lm_200', dataset_name=None, vocab=vocab,
                                      pretrained=False, prefix='lm_')
    tokens, states = _tokens_and_states()
    with pytest.raises(NotSymbolSafe, match=MESSAGE % ('lm', 'StandardRNN', 'AssertionError')
                       + 'Argument data must have NDArray type, but got <Symbol .*>' + CALL) \
            as err:
        Pipeline(net, 'cpu:0,cpu:1', sample=(tokens, states), batch_axis=1)
    assert '\n' not in str(err.value)


def test_a_block_of_a_list_is_refused_when_its_graph_is_built():
    pipe = Pipeline([gluon.nn.Dense(4, in_units=3), ReadsShape(prefix='odd_')], 'cpu:0,cpu:1')
    pipe.initialize()
    assert pipe(mx.nd.ones((2, 3))).shape == (2, 4)  # imperatively it runs
    with pytest.raises(NotSymbolSafe, match=MESSAGE % ('odd', 'ReadsShape', 'AttributeError')):
        pipe.module()


TASK = '''
import numpy as np
from mxnet import gluon
import mp_symbolic

class ReadsShape(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return x / x.shape[1]

def task():
    return mp_symbolic.Task(name='odd', blocks=[gluon.nn.Dense(4), ReadsShape(prefix='odd_')],
                            loss='l2', train=(np.zeros((16, 3)), np.zeros((16, 4))), batch_size=8)
'''


def test_train_refuses_a_task_with_such_a_block_in_one_line(tmp_path):
    path = tmp_path / 'odd_task.py'
    path.write_text(TASK)
    run = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'train', '--task', str(path),
                          '--devices', 'cpu:0,cpu:1', '--out', str(tmp_path / 'out'),
                          '--no-progress'], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        'error: blocks: expected every hybrid_forward to run on Symbols') and 'found odd (ReadsShape)' in lines[0]
    assert not (tmp_path / 'out').exists()
