"""Shared fixtures. Every test runs on ``cpu(i)`` stand-in devices, as MXNet's
own model-parallel tests do, so no GPU is needed."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

os.environ.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The signal dispositions every test starts with. A suite started as a script's
# background job (`make test &`) inherits SIGINT ignored, and so would every
# command a test starts (an ignored signal stays ignored across exec, and the
# commands leave it so): the tests that interrupt a command need it delivered.
SIGNAL_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                   signal.SIGALRM: signal.SIG_DFL}


def _reset_signals():
    signal.setitimer(signal.ITIMER_REAL, 0)
    for signum, handler in SIGNAL_HANDLERS.items():
        signal.signal(signum, handler)


_reset_signals()  # before the commands' modules load: they note what was ignored at start

THREE_DEVICES = 'cpu:0,cpu:1,cpu:2'


def chain(blocks, **kwargs):
    """The blocks one after the other as one whole network (a Pipeline cuts
    it by its graph; the blocks keep their own parameter names): the
    language model's own chain, :class:`~mp_symbolic.training.tasks.gpt.GPT`."""
    from mp_symbolic.training.tasks.gpt import GPT  # pylint: disable=import-outside-toplevel
    return GPT(blocks, **kwargs)

# The files whose tests take the longest in either half of the suite (`make
# test`, or `make test-slow`: the tests marked slow), longest first, each by the
# longer of its two halves (the seconds of its tests' set-up, call and tear-down
# under pytest-xdist): started first (--dist loadfile --no-loadscope-reorder keeps
# this order), so that no long file starts last and ends the run alone on one
# worker while the short files, after them, fill both workers to the end. A file
# of 15 seconds or more in either half belongs here.
HEAVY_FIRST = ('test_nodes.py', 'test_process_memory.py', 'test_plan_auto.py',
               'test_walkthrough.py', 'test_estimate.py', 'test_estimate_nodes.py',
               'test_node_rendezvous.py',
               'test_peer.py', 'test_readme.py', 'test_export_layers.py', 'test_blas.py',
               'test_zero.py', 'test_export_memory.py', 'test_pipeline_bench.py', 'test_tasks.py',
               'test_launch.py', 'test_lm.py', 'test_node_networks.py',
               'test_export_detectors.py', 'test_mxnet_traps.py', 'test_stages.py',
               'test_export_outputs.py', 'test_buckets.py', 'test_checkpoints.py',
               'test_train.py', 'test_audit.py', 'test_bench_networks.py', 'test_graphcut.py',
               'test_export_inputs.py', 'test_initial_values.py', 'test_bounds.py',
               'test_task_buckets.py', 'test_batchnorm.py', 'test_export_dynamic.py',
               'test_transport.py', 'test_constants.py', 'test_autotp.py')


def pytest_collection_modifyitems(items):
    """Moves :data:`HEAVY_FIRST`'s files to the front, in that order; the rest
    keep their order."""
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)
    items.sort(key=rank)


SLOW_LEFT_OUT = []  # the count of tests marked slow that `-m 'not slow'` left out


def pytest_deselected(items):
    """Counts the tests marked slow that were left out; a pytest-xdist worker
    sends the count to the controller, which collects nothing itself."""
    SLOW_LEFT_OUT.append(sum(1 for item in items if item.get_closest_marker('slow')))
    config = items[0].config if items else None
    if config is not None and hasattr(config, 'workeroutput'):
        config.workeroutput['deselected'] = sum(SLOW_LEFT_OUT)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # pylint: disable=unused-argument
    """pytest-xdist's controller: each worker collected every test, so any
    one's count is the run's."""
    count = getattr(node, 'workeroutput', {}).get('deselected')
    if count is not None and not SLOW_LEFT_OUT:
        SLOW_LEFT_OUT.append(count)


def pytest_terminal_summary(terminalreporter, config):
    """Says, at the end of a run that left the tests marked slow out (`make
    test`), how many there were and the command that runs them."""
    if (config.getoption('markexpr') or '').strip() != 'not slow':
        return
    terminalreporter.write_line('%d tests marked slow left out: `make test-slow` runs them '
                                '(`make test-all`: everything)' % sum(SLOW_LEFT_OUT))


@pytest.fixture(autouse=True)
def signals_as_the_session_started():
    """Resets SIGINT, SIGTERM and SIGALRM before each test. A command's
    ``main()`` run in-process (here or in a module fixture) sets its own
    handlers, and ignores both signals once it has finished; on the same
    pytest worker, a later test's commands would inherit them ignored and
    never see the signal the test sends (which test runs after which depends
    on how ``-n`` shares the tests out)."""
    _reset_signals()


@contextlib.contextmanager
def reserved_port():
    """A port of the kernel's choosing, kept bound (not listening) until the
    block ends: no other pick of a free port on the machine (another xdist
    worker's job, the launcher's default) gets it meanwhile, while a job's
    scheduler can still listen on it, as ZeroMQ binds with SO_REUSEADDR."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(('', 0))
        yield sock.getsockname()[1]


@pytest.fixture
def port():
    """A :func:`reserved_port` for the test's duration."""
    with reserved_port() as number:
        yield number


@pytest.fixture(scope='session')
def small_data():
    """400 examples of the seed's regression problem."""
    from mp_symbolic.training.tasks.regression import make_dataset  # pylint: disable=import-outside-toplevel
    return make_dataset(num_examples=400, seed=1)


@pytest.fixture(scope='session')
def digits_data():
    """The digits split: ``(X_train, y_train, X_held_out, y_held_out)``."""
    from mp_symbolic.training.tasks import digits  # pylint: disable=import-outside-toplevel
    return digits.split(*digits.load_digits(), seed=0)


def make_config(**fields):
    """A ``TrainConfig``; the regression's ``widths`` and ``num_examples`` go to
    its task arguments, as ``--widths`` and ``--num-examples`` do."""
    from mp_symbolic.training.config import TrainConfig  # pylint: disable=import-outside-toplevel
    task_args = dict(fields.pop('task_args', {}))
    for name in ('widths', 'num_examples'):
        if name in fields:
            task_args[name] = fields.pop(name)
    return TrainConfig(task_args=task_args, **fields)


def load_config(**fields):
    """``(task, config)``: :func:`make_config`'s config with its task loaded
    and the task's defaults filled in."""
    from mp_symbolic.training.loop import load  # pylint: disable=import-outside-toplevel
    return load(make_config(**fields))


def small_bert(values=None, num_heads=2, scale=0.02):
    """GluonNLP's BERT, two layers of 16 units (fixed names), its parameters
    made by one forward pass of :func:`bert_batch`; ``values`` (name ->
    NDArray) then replace them. Skips the test without GluonNLP."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    bert = pytest.importorskip('gluonnlp.model.bert')
    mx.random.seed(0)
    encoder = bert.BERTEncoder(num_layers=2, units=16, hidden_size=32, max_length=16,
                               num_heads=num_heads, prefix='encoder_')
    net = bert.BERTModel(encoder, vocab_size=50, token_type_vocab_size=2, units=16,
                         embed_size=16, use_pooler=True, use_decoder=False, use_classifier=True,
                         prefix='bert_')
    net.initialize(mx.init.Normal(scale))
    net(*[mx.nd.array(x) for x in bert_batch()])
    for name, value in (values or {}).items():
        net.collect_params()[name].set_data(value)
    return net


def bert_batch(batch_size=4, seq_len=8):
    """BERT's three inputs: token ids, token types, valid lengths (float32)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    return [rng.integers(0, 50, (batch_size, seq_len)).astype(np.float32),
            rng.integers(0, 2, (batch_size, seq_len)).astype(np.float32),
            rng.integers(1, seq_len + 1, (batch_size,)).astype(np.float32)]


def cli_status(main, argv):
    """The exit status of a command's ``main(argv)`` run in this process: what
    it returns, or the status of the ``SystemExit`` argparse raises on a bad
    flag (stderr is what the test's ``capsys`` captured). The signal
    handlers are put back as they were: the command leaves SIGINT and SIGTERM
    ignored, and so would every process the test starts after it."""
    handlers = {signum: signal.getsignal(signum) for signum in SIGNAL_HANDLERS}
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def bert_trainer_steps(pipeline, make_bert=small_bert):
    """One SGD step of a loss on BERT's classifier output: on one device with
    ``gluon.Trainer``, and through ``pipeline(net)`` (a Pipeline of the same
    values) with ``mp_symbolic.Trainer``.

    Returns:
        ``(pipe, its outputs, the one-device outputs, the one-device network,
        the values both started from)``, outputs as numpy arrays.
    """
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mxnet import autograd, gluon  # pylint: disable=import-outside-toplevel
    from mp_symbolic import Trainer  # pylint: disable=import-outside-toplevel
    xs = bert_batch()
    label = mx.nd.array([0, 1, 1, 0])
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def step(net, trainer, inputs, target):
        with autograd.record():
            outputs = net(*inputs)
            loss = loss_fn(outputs[2], target)
        loss.backward()
        trainer.step(len(xs[0]))
        return [o.asnumpy() for o in outputs]

    start = {name: p.data().copy() for name, p in make_bert().collect_params().items()}
    reference = make_bert(start)
    ref_out = step(reference, gluon.Trainer(reference.collect_params(), 'sgd',
                                            {'learning_rate': 0.5}),
                   [mx.nd.array(x) for x in xs], label)
    pipe = pipeline(make_bert(start))
    pipe.initialize()  # moves the values already there onto their stages' devices
    out = step(pipe, Trainer(pipe.collect_params(), 'sgd', {'learning_rate': 0.5}),
               [mx.nd.array(x, ctx=mx.cpu(0)) for x in xs],
               label.as_in_context(pipe.plan.last_device))
    return pipe, out, ref_out, reference, start


def file_tree(folder, folders=False):
    """Every path under ``folder`` with its bytes (links as their target;
    with ``folders``, folders too, as ``'folder'``): what a command must leave
    as it found."""
    found = {}
    for base, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                found[rel] = 'link:' + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, 'rb') as f:
                    found[rel] = f.read()
            elif folders:
                found[rel] = 'folder'
    return found


def bn_mlp():
    """Three dense layers, BatchNorm after the first two (auxiliary states,
    read as they are: ``use_global_stats``), 6 inputs, 4 classes; fixed
    names. (BatchNorm that updates its running statistics is no good for
    comparing bytes: the first one's differed between two equal fits in one
    process now and then, MXNet's own Module too, on a loaded machine.)"""
    from mxnet.gluon import nn  # pylint: disable=import-outside-toplevel
    return [nn.Dense(16, in_units=6, prefix='fc0_'),
            nn.BatchNorm(in_channels=16, use_global_stats=True, prefix='bn0_'),
            nn.Activation('relu', prefix='relu0_'), nn.Dense(16, in_units=16, prefix='fc1_'),
            nn.BatchNorm(in_channels=16, use_global_stats=True, prefix='bn1_'),
            nn.Dense(4, in_units=16, prefix='fc2_')]


def fit_and_save(pipe, folder, num_epoch=2, **module_kwargs):
    """``pipe.module(**module_kwargs)`` (of :func:`bn_mlp`) trained by MXNet's
    own ``fit`` on 32 seeded examples from a seed (SGD with momentum, batches
    of 16; the running statistics given, the rest initialised), each epoch
    saved by MXNet's checkpoint callback (``epoch_end_callback``), then by
    ``save_checkpoint`` and :func:`mp_symbolic.save_checkpoint`.

    Returns:
        ``(module, {file: bytes})``: the parameter, optimizer state and graph
        files written (the store's as ``store/current/...``).
    """
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import mp_symbolic  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(0)
    X, y = rng.uniform(0, 1, (32, 6)).astype(np.float32), rng.integers(0, 4, 32).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    mod = pipe.module(**module_kwargs)
    mx.random.seed(0)
    stats = {'bn%d_running_%s' % (i, kind): mx.nd.array(rng.uniform(0.5, 1.5, 16))
             for i in (0, 1) for kind in ('mean', 'var')}
    mod.fit(mx.io.NDArrayIter(X, y, batch_size=16), num_epoch=num_epoch,
            optimizer='sgd', optimizer_params={'learning_rate': 0.1, 'momentum': 0.9},
            initializer=mx.init.Xavier(), aux_params=stats, allow_missing=True,
            epoch_end_callback=mx.callback.do_checkpoint(os.path.join(folder, 'callback')))
    mod.save_checkpoint(os.path.join(folder, 'module'), num_epoch, save_optimizer_states=True)
    mp_symbolic.save_checkpoint(mod, os.path.join(folder, 'store'), num_epoch)
    written = {}
    for place in (folder, os.path.join(folder, 'store', 'current')):
        for name in sorted(os.listdir(place)):
            if name.endswith(('.params', '.states', '-symbol.json')):
                with open(os.path.join(place, name), 'rb') as f:
                    written[os.path.relpath(os.path.join(place, name), folder)] = f.read()
    return mod, written


def assert_host_params_are_the_devices(mod):
    """``get_params`` gives host arrays equal to every replica's device
    arrays, by name; without the host copy, fresh ones at each call."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    arg_params, aux_params = mod.get_params()
    group = mod._exec_group  # pylint: disable=protected-access
    assert set(arg_params) == set(group.param_names) and set(aux_params) == set(group.aux_names)
    for exe in group.execs:
        for name, value in arg_params.items():
            assert value.context == mx.cpu(0)
            np.testing.assert_array_equal(value.asnumpy(), exe.arg_dict[name].asnumpy(), name)
        for name, value in aux_params.items():
            np.testing.assert_array_equal(value.asnumpy(), exe.aux_dict[name].asnumpy(), name)
    again = mod.get_params()[0]
    assert all((again[n] is v) == mod.host_copy for n, v in arg_params.items())


def assert_host_copy_changes_no_value_or_byte(pipe, folder):
    """``pipe``'s Module with and without ``host_copy``: the host copy on
    cpu(0) only with it, ``get_params`` equal to the devices either way, and
    the same bytes in every checkpoint file (:func:`fit_and_save`)."""
    from mp_symbolic.tools.memory import device_memory  # pylint: disable=import-outside-toplevel
    written = {}
    for host_copy in (False, True):
        mod, written[host_copy] = fit_and_save(pipe, folder / str(host_copy),
                                               host_copy=host_copy)
        arg_params, aux_params = mod.get_params()
        kept = sum(a.size * 4 for a in list(arg_params.values()) + list(aux_params.values()))
        assert device_memory(mod)['cpu(0)']['module_copy'] == (kept if host_copy else 0)
        assert (mod.host_params == (None, None)) != host_copy
        assert_host_params_are_the_devices(mod)
    assert sorted(written[False]) == sorted(written[True]) and len(written[False]) == 9
    for name, data in written[False].items():
        assert data == written[True][name], name


def node_env(rank, count, port, **more):
    """The rendezvous of node ``rank`` of ``count`` on 127.0.0.1."""
    return dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0', MASTER_ADDR='127.0.0.1',
                MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(count), **more)


def run_node_workers(worker, out, count, port, table=None, timeout=300):
    """Runs the script ``worker`` as ``count`` node processes (``--out out
    --nodes count``, and ``--table JSON`` of ``table``'s configurations where
    given), asserting each exits 0; every process is gone when it returns."""
    more = [] if table is None else ['--table', json.dumps(table)]
    procs = [subprocess.Popen([sys.executable, worker, '--out', out, '--nodes', str(count)]
                              + more,
                              env=node_env(rank, count, port), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(count)]
    try:
        ended = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, ended):
        assert p.returncode == 0, err[-3000:]
