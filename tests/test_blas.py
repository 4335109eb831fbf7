"""OpenBLAS at the CPU's own kernel (mp_symbolic/tools/blas.py): the choice
from given feature sets, the check against float64 products in a child
process, its cache, the fallback where it fails, and the commands that load
MXNet's OpenBLAS at that kernel before MXNet. Nothing here changes this
process's environment or the cache of the user running the tests: every
verdict goes to a folder of the test's own (``XDG_CACHE_HOME``), every kernel
is loaded in a child process."""
import functools
import json
import os
import subprocess
import sys

import pytest

from mp_symbolic.tools import blas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AVX512 = {'avx512f', 'avx512bw', 'avx512vl', 'avx512dq', 'avx512cd', 'avx2', 'fma', 'avx'}
CHOSEN = blas.choose(blas.cpu()[1])
needs_a_kernel = pytest.mark.skipif(CHOSEN is None or blas.library() is None,
                                    reason='no kernel to choose here (x86_64 Linux with AVX and '
                                           "MXNet's bundled OpenBLAS only)")
NUMPYS = ('import threadpoolctl, numpy\nprint([i["architecture"] for i in '
          'threadpoolctl.threadpool_info() if "numpy" in i["filepath"]][0])\n')
CORENAME = ('import ctypes, mxnet as mx\nf = mx.base._LIB.openblas_get_corename\n'
            'f.restype = ctypes.c_char_p\nprint(f().decode())\n')


@functools.lru_cache(maxsize=None)
def _verdict(coretype):
    """``blas.check(coretype)`` (a child process), run once per kernel for
    every test of this file that reads it."""
    return blas.check(coretype)


def _core(coretype):
    """The kernel OpenBLAS runs for ``coretype`` (``None``: its own choice)."""
    verdict = _verdict(coretype)
    assert verdict['core'], verdict['reason']
    return verdict['core']


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in blas.OWN + (blas.SWITCH,)}
    env.update(PYTHONPATH=ROOT, XDG_CACHE_HOME=str(tmp_path / 'cache'),
               MXNET_SUBGRAPH_VERBOSE='0', **extra)
    return env


def _python(code, env):
    return subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize('flags, kernel', [
    (AVX512, 'SkylakeX'),
    (AVX512 - {'avx512vl'}, 'Haswell'),        # AVX-512 without VL: not SkylakeX's kernels
    ({'avx512f', 'avx', 'fma'}, 'Sandybridge'),  # no AVX2
    ({'avx2', 'fma', 'avx'}, 'Haswell'),
    ({'avx2', 'avx'}, 'Sandybridge'),          # AVX2 without FMA
    ({'avx'}, 'Sandybridge'),
    ({'sse4_2', 'ssse3'}, None),
    (set(), None),
])
def test_the_kernel_is_the_widest_whose_features_the_cpu_has_all_of(flags, kernel):
    assert blas.choose(flags, machine='x86_64', system='linux') == kernel


@pytest.mark.parametrize('machine, system', [('aarch64', 'linux'), ('x86_64', 'darwin'),
                                             ('AMD64', 'win32')])
def test_no_kernel_is_chosen_off_x86_64_linux(machine, system):
    assert blas.choose(AVX512, machine=machine, system=system) is None


def test_the_cpus_model_and_flags_are_read_from_cpuinfo(tmp_path):
    path = tmp_path / 'cpuinfo'
    path.write_text('processor\t: 0\nmodel name\t: Some CPU @ 2GHz\nflags\t\t: fpu avx avx2 fma\n\n'
                    'processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n')
    assert blas.cpu(str(path)) == ('Some CPU @ 2GHz', frozenset({'fpu', 'avx', 'avx2', 'fma'}))
    assert blas.cpu(str(tmp_path / 'missing')) == ('', frozenset())


@pytest.mark.slow
@needs_a_kernel
def test_the_chosen_kernel_computes_dot_and_batch_dot_within_the_float32_bound():
    verdict = _verdict(CHOSEN)
    assert verdict['ok'], verdict['reason']
    assert verdict['core'] and 0 <= verdict['worst'] <= 1
    own = _verdict(None)
    assert own['ok'], own['reason']


@needs_a_kernel
def test_a_check_held_to_no_rounding_at_all_fails_and_names_the_products():
    verdict = blas.check(CHOSEN, tolerance=0)
    assert not verdict['ok'] and not verdict['timed_out']
    assert 'out of the float32 bound: dot ' in verdict['reason']
    assert 'batch_dot' in verdict['reason']


@needs_a_kernel
def test_a_kernel_name_openblas_does_not_know_is_checked_as_what_openblas_runs_instead():
    verdict = blas.check('NoSuchKernel')
    assert verdict['ok'], verdict['reason']
    assert verdict['core'] == _core(None)  # OpenBLAS's own choice, named in the verdict
    assert verdict['reason'].startswith('OpenBLAS runs %s; ' % _core(None))


def test_a_check_that_crashes_fails_with_its_last_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    (tmp_path / 'numpy.py').write_text('raise SystemExit("numpy: broken on purpose")\n')
    verdict = blas.check(None, environ=env)
    assert not verdict['ok']
    assert verdict['reason'] == 'the check exited 1: numpy: broken on purpose'


class _Verifier:
    def __init__(self, ok=True, timed_out=False):
        self.calls, self.ok, self.timed_out = [], ok, timed_out

    def __call__(self, coretype):
        self.calls.append(coretype)
        return {'coretype': coretype, 'ok': self.ok, 'core': 'X', 'config': None, 'worst': 0.5,
                'timed_out': self.timed_out, 'reason': 'stand-in verdict'}


def _cpuinfo(tmp_path, flags):
    path = tmp_path / ('cpuinfo-%d' % len(flags))
    path.write_text('model name\t: Test CPU\nflags\t\t: %s\n' % ' '.join(sorted(flags)))
    return str(path)


needs_mxnet_openblas = pytest.mark.skipif(
    blas.library() is None or not blas._linux_x86_64(),  # pylint: disable=protected-access
    reason="needs MXNet's bundled OpenBLAS on x86_64 Linux")


@needs_mxnet_openblas
def test_a_verdict_is_cached_per_cpu_and_kernel_and_checked_again_on_request(tmp_path):
    environ = {'XDG_CACHE_HOME': str(tmp_path / 'cache')}
    verify = _Verifier()
    skylake, haswell = _cpuinfo(tmp_path, AVX512), _cpuinfo(tmp_path, {'avx2', 'fma', 'avx'})
    first = blas.recommended(environ, verify=verify, cpuinfo=skylake)
    again = blas.recommended(environ, verify=verify, cpuinfo=skylake)
    assert first.coretype == again.coretype == 'SkylakeX' and verify.calls == ['SkylakeX']
    assert blas.recommended(environ, verify=verify, cpuinfo=haswell).coretype == 'Haswell'
    blas.recommended(environ, verify=verify, cpuinfo=skylake, recheck=True)
    assert verify.calls == ['SkylakeX', 'Haswell', 'SkylakeX']
    with open(blas.cache_path(environ)) as f:
        assert len(json.load(f)) == 2


@needs_mxnet_openblas
def test_a_failed_verdict_sets_no_kernel_and_a_timed_out_one_is_not_kept(tmp_path):
    environ = {'XDG_CACHE_HOME': str(tmp_path / 'cache')}
    skylake = _cpuinfo(tmp_path, AVX512)
    failed = blas.recommended(environ, verify=_Verifier(ok=False), cpuinfo=skylake)
    assert failed.coretype is None and 'SkylakeX failed its check' in failed.reason
    verify = _Verifier()
    assert blas.recommended(environ, verify=verify, cpuinfo=skylake).coretype is None
    assert verify.calls == []  # the failed verdict is kept
    environ = {'XDG_CACHE_HOME': str(tmp_path / 'other')}
    verify = _Verifier(ok=False, timed_out=True)
    assert 'not checked' in blas.recommended(environ, verify=verify, cpuinfo=skylake).reason
    blas.recommended(environ, verify=verify, cpuinfo=skylake)
    assert verify.calls == ['SkylakeX', 'SkylakeX']


@pytest.mark.parametrize('name, value', [('OPENBLAS_CORETYPE', 'Sandybridge'),
                                         ('OPENBLAS_L2_SIZE', '1048576'),
                                         ('OPENBLAS_CORETYPE', ''),
                                         ('MP_SYMBOLIC_BLAS', 'default'),
                                         ('MP_SYMBOLIC_BLAS', 'DEFAULT')])
def test_the_users_or_machines_openblas_setting_and_the_switch_leave_the_kernel_alone(
        tmp_path, name, value):
    verify = _Verifier()
    choice = blas.recommended({name: value, 'XDG_CACHE_HOME': str(tmp_path)}, verify=verify,
                              cpuinfo=_cpuinfo(tmp_path, AVX512))
    assert choice.coretype is None and choice.verdict is None and verify.calls == []
    assert name in choice.reason


def test_a_bad_switch_is_refused_in_one_line_with_status_2(tmp_path):
    for argv in (['train', '--task', 'regression'], ['blas']):
        result = subprocess.run([sys.executable, '-m', 'mp_symbolic'] + argv, cwd=ROOT,
                                env=_env(tmp_path, MP_SYMBOLIC_BLAS='fast'), capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 2
        assert result.stderr == "error: MP_SYMBOLIC_BLAS: expected auto or default, found 'fast'\n"
        assert result.stdout == ''


@pytest.mark.slow
@needs_a_kernel
def test_a_kernel_that_fails_its_check_leaves_openblas_its_own_choice_and_says_so_once(tmp_path):
    own = _core(None)
    code = ('import functools\nfrom mp_symbolic.tools import blas\n'
            'choice = blas.apply(verify=functools.partial(blas.check, tolerance=0))\n'
            'print(choice.coretype)\n' + CORENAME)
    result = _python(code, _env(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ['None', own]
    notes = [line for line in result.stderr.splitlines() if line.startswith('note: ')]
    assert len(notes) == 1 and ('OPENBLAS_CORETYPE=%s failed its check' % CHOSEN) in notes[0]
    assert 'MP_SYMBOLIC_BLAS=default' in notes[0]


@pytest.mark.slow
@needs_a_kernel
def test_apply_runs_mxnets_openblas_at_the_kernel_and_leaves_numpy_and_the_environment(tmp_path):
    code = ('import os\nfrom mp_symbolic.tools import blas\nprint(blas.apply().coretype)\n'
            'print(os.environ.get("OPENBLAS_CORETYPE"))\n' + CORENAME + NUMPYS)
    env = _env(tmp_path)
    numpy_own = _python(NUMPYS, env)
    result = _python(code, env)
    assert result.returncode == 0 and numpy_own.returncode == 0, result.stderr[-2000:]
    kernel = _core(CHOSEN)
    assert result.stdout.split() == [CHOSEN, 'None', kernel, numpy_own.stdout.strip()]
    assert result.stderr == ''


_KERNEL_TASK = '''
import ctypes
import numpy as np
import mxnet as mx
from mxnet import gluon
import mp_symbolic


def task(record):
    f = mx.base._LIB.openblas_get_corename
    f.restype = ctypes.c_char_p
    with open(record, 'w') as out:
        out.write(f().decode())
    X = np.random.RandomState(0).normal(size=(40, 2)).astype(np.float32)
    return mp_symbolic.Task(name='kernel', blocks=[gluon.nn.Dense(1, prefix='out_')], loss='l2',
                            train=(X, X.sum(axis=1, keepdims=True)), batch_size=20,
                            num_epochs=1, lr=0.1)
'''


@pytest.mark.slow
@needs_a_kernel
@pytest.mark.parametrize('setting', ['auto', 'default', 'user'])
def test_the_command_line_trains_at_the_chosen_kernel_unless_told_otherwise(tmp_path, setting):
    (tmp_path / 'kernel_task.py').write_text(_KERNEL_TASK)
    record = tmp_path / 'core.txt'
    extra = {'auto': {}, 'default': {'MP_SYMBOLIC_BLAS': 'default'},
             'user': {'OPENBLAS_CORETYPE': 'Sandybridge'}}[setting]
    result = subprocess.run(
        [sys.executable, '-m', 'mp_symbolic', 'train', '--task', str(tmp_path / 'kernel_task.py'),
         '--task-arg', 'record=%s' % record, '--devices', 'cpu:0', '--no-progress',
         '--no-memory', '--out', str(tmp_path / 'out')],
        cwd=ROOT, env=_env(tmp_path, **extra), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = {'auto': _core(CHOSEN), 'default': _core(None),
                'user': 'Sandybridge'}[setting]
    assert record.read_text() == expected
    assert 'note:' not in result.stderr


@pytest.mark.slow
@needs_a_kernel
def test_blas_command_prints_the_choice_its_verdict_and_openblass_own(tmp_path):
    result = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'blas'], cwd=ROOT,
                            env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[2].startswith('choice: OPENBLAS_CORETYPE=%s passed its check: OpenBLAS runs '
                               % CHOSEN)
    assert lines[-1] == "OpenBLAS's own choice: %s" % _core(None)
    assert os.path.exists(blas.cache_path({'XDG_CACHE_HOME': str(tmp_path / 'cache')}))


@needs_mxnet_openblas
@pytest.mark.parametrize('text', ['not json', '[1, 2]', '{"%s": {"ok": true}}'])
def test_a_cache_that_cannot_be_read_is_checked_again_and_rewritten(tmp_path, text):
    environ = {'XDG_CACHE_HOME': str(tmp_path / 'cache')}
    skylake = _cpuinfo(tmp_path, AVX512)
    blas.recommended(environ, verify=_Verifier(), cpuinfo=skylake)
    path = blas.cache_path(environ)
    with open(path) as f:
        key = next(iter(json.load(f)))
    with open(path, 'w') as f:
        f.write(text.replace('%s', key))
    verify = _Verifier()
    assert blas.recommended(environ, verify=verify, cpuinfo=skylake).coretype == 'SkylakeX'
    assert verify.calls == ['SkylakeX']
    with open(path) as f:
        assert json.load(f)[key]['reason'] == 'stand-in verdict'


@pytest.mark.slow
@needs_a_kernel
def test_the_benchmark_times_both_kernels_in_processes_of_their_own(tmp_path):
    result = subprocess.run([sys.executable, '-m', 'bench.blas', '--rounds', '1', '--tasks', '',
                             '--seconds', '0.01'], cwd=ROOT, env=_env(tmp_path),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert 'OpenBLAS runs %s under OPENBLAS_CORETYPE=%s, %s on its own' % (
        _core(CHOSEN), CHOSEN, _core(None)) in lines
    rows = [line for line in lines if line.startswith(('dot ', 'batch_dot '))]
    assert len(rows) == 8 and all(float(row.split()[-1]) > 0 for row in rows)
