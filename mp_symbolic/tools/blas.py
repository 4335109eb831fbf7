"""OpenBLAS at the CPU's own kernel, chosen before MXNet loads.

MXNet's CPU wheels bundle an OpenBLAS built for many CPUs (``DYNAMIC_ARCH``)
that picks its kernel when the library loads; an OpenBLAS older than the CPU
does not know it and falls back to a generic kernel (MXNet 1.9.1's OpenBLAS
0.3.13 runs ``Prescott`` on Sapphire Rapids and on some EPYCs). ``dot`` and
``batch_dot`` run there (``FullyConnected`` and convolutions run in oneDNN).
OpenBLAS reads ``OPENBLAS_CORETYPE`` once, when it loads, so the choice has
to be in the environment before ``import mxnet``:

* :func:`choose` maps the CPU's features to a kernel name: ``SkylakeX``
  (AVX-512 F, BW, VL, DQ, CD), ``Haswell`` (AVX2 and FMA), ``Sandybridge``
  (AVX), on x86_64 Linux only; else none.
* :func:`check` runs that kernel in a child process: ``mx.nd.dot`` and
  ``mx.nd.batch_dot`` on float32 matrices of several shapes (odd ones, and
  transposed operands) against float64 products (``numpy.einsum``, which
  calls no BLAS), each element within
  the float32 bound ``(K + 2) * 2**-24 * (|A| @ |B|)``; a crash, an error or
  an element out of bound fails it.
* :func:`recommended` is the choice with its check's verdict, cached per CPU
  (model and flags), MXNet (version and folder) and kernel in
  ``$XDG_CACHE_HOME/mp_symbolic/blas.json`` (``~/.cache`` by default);
  nothing in the environment changes.
* :func:`apply` loads MXNet's own OpenBLAS (``libopenblas.so.0`` beside
  ``libmxnet.so``) with ``OPENBLAS_CORETYPE`` set to that kernel where it
  passed, then restores the environment: MXNet, loading later, finds the
  library loaded (the dynamic loader matches it by its soname) and runs that
  kernel, while numpy's and SciPy's OpenBLAS keep their own choice (the
  variable, inherited, would change theirs, and with them the float64
  rounding of the data a task makes with numpy). The commands call it first
  thing (:func:`at_start`); the commands a command starts call it in turn.
  Where the check fails it leaves OpenBLAS's own choice and says so in one
  line.

Never changed: an ``OPENBLAS_CORETYPE`` or ``OPENBLAS_L2_SIZE`` already in
the environment (the user's, or the machine's for an OpenBLAS known to fail
there), a process that has loaded MXNet already, and
``MP_SYMBOLIC_BLAS=default``, which turns the choice off. Standard library only.
"""
from collections import namedtuple
import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys

from ..core.base.checks import cache_dir

__all__ = ['choose', 'check', 'recommended', 'load', 'apply', 'at_start', 'cpu', 'library',
           'Choice', 'KERNELS']

VARIABLE = 'OPENBLAS_CORETYPE'
# Either set by the user or the machine: left as it is, and so is the kernel.
OWN = ('OPENBLAS_CORETYPE', 'OPENBLAS_L2_SIZE')
SWITCH = 'MP_SYMBOLIC_BLAS'  # auto (the default) | default (OpenBLAS's own choice)
SWITCH_VALUES = ('auto', 'default')

# Kernel names as OpenBLAS spells them, with the CPU flags (/proc/cpuinfo)
# each needs: the first whose flags the CPU has all of is chosen.
KERNELS = (('SkylakeX', frozenset(('avx512f', 'avx512bw', 'avx512vl', 'avx512dq', 'avx512cd'))),
           ('Haswell', frozenset(('avx2', 'fma'))),
           ('Sandybridge', frozenset(('avx',))))

CHECK_TIMEOUT = 300.0  # seconds: MXNet's import on a loaded machine
_CACHE_FORMAT = 1

# The child's program: argv[1] is the tolerance (a factor on the float32 bound),
# argv[2] and argv[3] the kernel and MXNet's OpenBLAS, loaded as apply() does.
# It prints one JSON line: the kernel OpenBLAS runs, its configuration, the
# worst error as a fraction of the bound, and the products out of bound.
_CHECK = r'''
import ctypes, json, os, sys
if len(sys.argv) > 2:  # as apply() loads it: MXNet's OpenBLAS alone sees the kernel
    os.environ['OPENBLAS_CORETYPE'] = sys.argv[2]
    ctypes.CDLL(sys.argv[3], mode=os.RTLD_LOCAL)
    del os.environ['OPENBLAS_CORETYPE']
import numpy as np
sys.modules.setdefault('sklearn', None)  # MXNet loads as the commands load it (tools/startup.py)
import mxnet as mx

def name(function):
    try:
        f = getattr(mx.base._LIB, function)
    except AttributeError:
        return None
    f.restype = ctypes.c_char_p
    return f().decode('ascii', 'replace').strip()

tolerance = float(sys.argv[1])
rng = np.random.RandomState(0)
u = 2.0 ** -24
cases = [('dot', (1, 1, 1), False), ('dot', (7, 13, 5), False), ('dot', (33, 65, 17), False),
         ('dot', (64, 64, 64), True), ('dot', (127, 129, 255), False),
         ('dot', (256, 256, 256), True), ('dot', (500, 301, 257), False),
         ('batch_dot', (3, 7, 13, 5), False), ('batch_dot', (16, 64, 16, 64), True),
         ('batch_dot', (16, 64, 64, 16), False), ('batch_dot', (5, 65, 33, 129), True)]
worst, failed = 0.0, []
for op, shape, transposed in cases:
    m, k, n = shape[-3:]
    lead = shape[:-3]
    a = rng.uniform(-1, 1, lead + (m, k)).astype(np.float32)
    b = rng.uniform(-1, 1, lead + ((n, k) if transposed else (k, n))).astype(np.float32)
    f = getattr(mx.nd, op)
    c = f(mx.nd.array(a), mx.nd.array(b), transpose_b=transposed).asnumpy().astype(np.float64)
    b64 = b.astype(np.float64)
    b64 = np.swapaxes(b64, -1, -2) if transposed else b64
    # einsum without optimize: no BLAS, so no OpenBLAS of numpy's in the reference
    exact = np.einsum('...ik,...kj->...ij', a.astype(np.float64), b64)
    bound = tolerance * (k + 2) * u * np.einsum('...ik,...kj->...ij',
                                                np.abs(a.astype(np.float64)), np.abs(b64))
    error = np.abs(c - exact)
    if c.shape != exact.shape or not np.all(error <= bound):
        failed.append('%s %s%s' % (op, 'x'.join(map(str, shape)), ' (B transposed)' * transposed))
    with np.errstate(divide='ignore', invalid='ignore'):
        ratio = np.where(bound > 0, error / bound, np.where(error > 0, np.inf, 0.0))
    worst = max(worst, float(np.nan_to_num(ratio, nan=np.inf).max()) if ratio.size else 0.0)
print(json.dumps({'core': name('openblas_get_corename'), 'config': name('openblas_get_config'),
                  'worst': worst, 'failed': failed, 'cases': len(cases)}))
'''

Choice = namedtuple('Choice', 'coretype verdict reason')
Choice.__doc__ = """What the command line does with ``OPENBLAS_CORETYPE``.

``coretype`` is the kernel to set (``None``: set nothing); ``verdict`` the
check's (a dict, see :func:`check`) or ``None`` where no check ran; ``reason``
one line saying why."""


def _linux_x86_64(machine=None, system=None):
    machine = platform.machine() if machine is None else machine
    system = sys.platform if system is None else system
    return machine.lower() in ('x86_64', 'amd64') and system.startswith('linux')


def choose(flags, machine=None, system=None):
    """The OpenBLAS kernel for a CPU of these features, or ``None``.

    Args:
        flags: The CPU's feature flags as ``/proc/cpuinfo`` names them
            (``'avx2'``, ``'avx512f'``, ...), any iterable of strings.
        machine: ``platform.machine()`` (default: this machine's).
        system: ``sys.platform`` (default: this one's).
    Returns:
        The first name of :data:`KERNELS` whose flags are all in ``flags``, on
        x86_64 Linux; ``None`` elsewhere or where none fits.
    """
    if not _linux_x86_64(machine, system):
        return None
    flags = frozenset(flags)
    for name, needs in KERNELS:
        if needs <= flags:
            return name
    return None


def cpu(path='/proc/cpuinfo'):
    """``(model name, frozenset of flags)`` of this machine's first CPU;
    ``('', frozenset())`` where ``path`` cannot be read."""
    model, flags = '', frozenset()
    try:
        with open(path, errors='replace') as f:
            for line in f:
                key, _, value = line.partition(':')
                key = key.strip()
                if key == 'model name' and not model:
                    model = value.strip()
                elif key == 'flags' and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def _mxnet():
    """``(version, folder)`` of the MXNet this interpreter would import,
    without importing it; ``None`` where there is none."""
    try:
        spec = importlib.util.find_spec('mxnet')
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    folder = os.path.dirname(spec.origin)
    version = ''
    try:
        with open(os.path.join(folder, 'libinfo.py')) as f:
            found = re.search(r'''^__version__\s*=\s*['"]([^'"]+)['"]''', f.read(), re.M)
        version = found.group(1) if found else ''
    except OSError:
        pass
    return version, folder


def _signal_name(status):
    try:
        return signal.Signals(-status).name
    except ValueError:
        return 'signal %d' % -status


def library():
    """The OpenBLAS MXNet's wheel bundles (``libopenblas.so.0`` beside
    ``libmxnet.so``) of the MXNet this interpreter would import, found
    without importing it; ``None`` where there is none."""
    mxnet = _mxnet()
    path = mxnet and os.path.join(mxnet[1], 'libopenblas.so.0')
    return path if path and os.path.isfile(path) else None


def check(coretype, tolerance=1.0, timeout=CHECK_TIMEOUT, environ=None):
    """Runs MXNet's ``dot`` and ``batch_dot`` under ``coretype`` in a child
    process and compares them with float64 products.

    Args:
        coretype: The kernel, loaded in the child as :func:`apply` loads it;
            ``None`` for OpenBLAS's own choice.
        tolerance: A factor on the float32 bound ``(K + 2) * 2**-24 *
            (|A| @ |B|)`` each element must be within (0 fails any rounding).
        timeout: Seconds the child may take.
        environ: The child's environment, less ``OPENBLAS_CORETYPE``
            (default: ``os.environ``).
    Returns:
        A dict: ``coretype``; ``ok`` (every product within bound, no crash);
        ``core`` and ``config``, what OpenBLAS reports it runs (``None`` if
        MXNet has no OpenBLAS, or the child failed); ``worst``, the largest
        error as a fraction of the bound; ``reason``, one line; and
        ``timed_out``, true where the child did not finish in ``timeout``
        (a verdict about the machine's load, not the kernel).
    """
    env = dict(os.environ if environ is None else environ)
    env.pop(VARIABLE, None)
    env.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')
    verdict = {'coretype': coretype, 'ok': False, 'core': None, 'config': None, 'worst': None,
               'timed_out': False}
    argv = [sys.executable, '-c', _CHECK, repr(float(tolerance))]
    if coretype is not None:
        path = library()
        if path is None:
            verdict['reason'] = 'no libopenblas.so.0 beside libmxnet.so to load it in'
            return verdict
        argv += [coretype, path]
    try:
        result = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                text=True, errors='replace', timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        verdict.update(timed_out=True, reason='the check took over %g s' % timeout)
        return verdict
    except OSError as err:
        verdict['reason'] = 'the check could not start: %s' % (err.strerror or err)
        return verdict
    lines = result.stdout.strip().splitlines()
    if result.returncode or not lines:
        last = (result.stderr.strip().splitlines() or ['no output'])[-1]
        how = ('ended by %s' % _signal_name(result.returncode) if result.returncode < 0
               else 'exited %d' % result.returncode)
        verdict['reason'] = 'the check %s: %s' % (how, ' '.join(last.split())[:200])
        return verdict
    try:
        found = json.loads(lines[-1])
    except ValueError:
        verdict['reason'] = 'the check printed %r' % lines[-1][:200]
        return verdict
    verdict.update(core=found['core'], config=found['config'], worst=found['worst'])
    runs = 'OpenBLAS runs %s' % (found['core'] or 'no known kernel')
    if found['failed']:
        verdict['reason'] = '%s; out of the float32 bound: %s' % (runs, ', '.join(found['failed']))
    else:
        verdict.update(ok=True, reason='%s; %d products of dot and batch_dot within %.2g of '
                                       'the float32 bound' % (runs, found['cases'], found['worst']))
    return verdict


def cache_path(environ=None):
    """``$XDG_CACHE_HOME/mp_symbolic/blas.json`` (an absolute
    ``XDG_CACHE_HOME`` only), else ``~/.cache/mp_symbolic/blas.json``."""
    return os.path.join(cache_dir(environ), 'blas.json')


def _key(coretype, model, flags, mxnet):
    text = json.dumps([_CACHE_FORMAT, model, sorted(flags), list(mxnet), coretype, _CHECK])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _read(path):
    try:
        with open(path) as f:
            found = json.load(f)
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _locked(path):
    """Holds ``path + '.lock'`` (so that processes starting at once check
    once); goes on unlocked where the folder cannot be written."""
    try:
        import fcntl  # pylint: disable=import-outside-toplevel
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path + '.lock', os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write(path, entries):
    from .files import write_json  # pylint: disable=import-outside-toplevel
    try:
        write_json(path, entries)
    except OSError:
        pass  # a cache that cannot be written: the check runs again next time


def _switch(environ):
    value = environ.get(SWITCH, 'auto').strip().lower() or 'auto'
    if value not in SWITCH_VALUES:
        raise ValueError('%s: expected %s, found %r'
                         % (SWITCH, ' or '.join(SWITCH_VALUES), environ[SWITCH]))
    return value


def recommended(environ=None, recheck=False, verify=None, cpuinfo='/proc/cpuinfo'):
    """The kernel the command line would set, with its check's verdict;
    changes no environment.

    Args:
        environ: The environment to read (default: ``os.environ``).
        recheck: Run the check even where a verdict is cached.
        verify: ``verify(coretype) -> verdict``, the check (default:
            :func:`check` with ``environ``).
        cpuinfo: The file the CPU's model and flags are read from.
    Returns:
        A :class:`Choice`. A verdict is cached (see :func:`cache_path`)
        unless the check timed out.
    Raises:
        ValueError: ``MP_SYMBOLIC_BLAS`` is neither ``auto`` nor ``default``.
    """
    environ = os.environ if environ is None else environ
    if _switch(environ) == 'default':
        return Choice(None, None, '%s=default: OpenBLAS chooses its own kernel' % SWITCH)
    own = ['%s=%s' % (name, environ[name]) for name in OWN if name in environ]
    if own:
        return Choice(None, None, '%s set in the environment: left as it is' % ', '.join(own))
    model, flags = cpu(cpuinfo)
    coretype = choose(flags)
    if coretype is None:
        return Choice(None, None, 'no kernel to choose on %s %s (x86_64 Linux with AVX or '
                                  'later only)' % (platform.machine(), sys.platform))
    mxnet = _mxnet()
    if mxnet is None or library() is None:
        return Choice(None, None, 'no OpenBLAS bundled with MXNet to set %s in' % coretype)
    verify = verify or (lambda name: check(name, environ=environ))
    path = cache_path(environ)
    key = _key(coretype, model, flags, mxnet)
    with _locked(path):
        verdict = None if recheck else _read(path).get(key)
        if not isinstance(verdict, dict) or not {'ok', 'reason'} <= set(verdict):
            verdict = dict(verify(coretype), checked=True)
            if not verdict.get('timed_out'):
                entries = _read(path)
                entries[key] = dict(verdict, checked=False, cpu=model, mxnet=mxnet[0])
                _write(path, entries)
    if verdict['ok']:
        return Choice(coretype, verdict, 'OPENBLAS_CORETYPE=%s passed its check: %s'
                                         % (coretype, verdict['reason']))
    return Choice(None, verdict, 'OPENBLAS_CORETYPE=%s %s: %s' % (
        coretype, 'not checked' if verdict.get('timed_out') else 'failed its check',
        verdict['reason']))


def load(coretype):
    """Loads MXNet's own OpenBLAS (:func:`library`) with
    ``OPENBLAS_CORETYPE=coretype`` in the environment, then restores it.

    An OpenBLAS picks its kernel when it loads; MXNet, imported later, finds
    this library loaded and runs that kernel. Other OpenBLAS copies (numpy's,
    SciPy's) and the processes this one starts do not see the variable.

    Raises:
        OSError: There is no such library, or it cannot be loaded.
    """
    import ctypes  # pylint: disable=import-outside-toplevel
    path = library()
    if path is None:
        raise OSError('no libopenblas.so.0 beside libmxnet.so')
    before = os.environ.get(VARIABLE)
    os.environ[VARIABLE] = coretype
    try:
        return ctypes.CDLL(path, mode=os.RTLD_LOCAL)
    finally:
        if before is None:
            del os.environ[VARIABLE]
        else:
            os.environ[VARIABLE] = before


def apply(stream=None, verify=None):
    """Has MXNet run OpenBLAS at the CPU's kernel where it passed its check;
    what a command does first, before MXNet loads (see :func:`load`).

    Nothing changes where MXNet is loaded already (too late for OpenBLAS),
    where ``OPENBLAS_CORETYPE`` or ``OPENBLAS_L2_SIZE`` is set, or with
    ``MP_SYMBOLIC_BLAS=default``. Where a check made now fails (or does not
    finish), one line on ``stream`` says so and OpenBLAS keeps its own choice.

    Args:
        stream: Where the fallback's line goes (default: ``sys.stderr``).
        verify: As for :func:`recommended`.
    Returns:
        The :class:`Choice` (``None`` where MXNet was loaded already).
    Raises:
        ValueError: ``MP_SYMBOLIC_BLAS`` is neither ``auto`` nor ``default``.
    """
    if 'mxnet' in sys.modules:
        return None
    choice = recommended(verify=verify)
    failed = None
    if choice.coretype is not None:
        try:
            load(choice.coretype)
        except OSError as err:
            failed = 'OPENBLAS_CORETYPE=%s could not be loaded: %s' % (choice.coretype, err)
            choice = Choice(None, choice.verdict, failed)
    elif choice.verdict is not None and choice.verdict.get('checked'):
        failed = choice.reason
    if failed:
        stream = sys.stderr if stream is None else stream
        try:
            stream.write("note: %s; running OpenBLAS's own kernel (python -m mp_symbolic blas "
                         "says more, %s=default turns the choice off)\n" % (failed, SWITCH))
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    return choice


def report(recheck=False, stream=None):
    """Prints the CPU, the choice and the check's verdict, and OpenBLAS's
    own kernel for comparison (``python -m mp_symbolic blas``). Returns 0.

    Raises:
        ValueError: ``MP_SYMBOLIC_BLAS`` is neither ``auto`` nor ``default``.
    """
    stream = sys.stdout if stream is None else stream
    _switch(os.environ)  # a bad value is refused before anything is printed
    model, flags = cpu()
    known = sorted(set().union(*(needs for _, needs in KERNELS)) & flags)
    stream.write('cpu: %s (%s %s; %s)\n' % (model or 'unknown', platform.machine(), sys.platform,
                                           ' '.join(known) or 'none of AVX, AVX2, AVX-512'))
    mxnet = _mxnet()
    stream.write('mxnet: %s\n' % ('%s in %s' % mxnet if mxnet else 'not found'))
    choice = recommended(recheck=recheck)
    stream.write('choice: %s\n' % choice.reason)
    if choice.coretype is not None:
        stream.write('set: OPENBLAS_CORETYPE=%s in MXNet\'s OpenBLAS by python -m mp_symbolic, '
                     'python -m export and python -m bench (verdict cached in %s)\n'
                     % (choice.coretype, cache_path()))
    elif choice.verdict is not None:
        stream.write('set: nothing: OpenBLAS chooses its own kernel\n')
    if mxnet is not None and VARIABLE not in os.environ:
        default = check(None)
        stream.write("OpenBLAS's own choice: %s\n" % (
            default['core'] if default['core'] else default['reason']))
    return 0


def at_start(argv=None):
    """:func:`apply` for a command's entry point, before MXNet loads: a bad
    ``MP_SYMBOLIC_BLAS`` is one line and exit status 2. Skipped for
    ``-h``/``--help`` in ``argv`` (default: ``sys.argv[1:]``), which load no
    MXNet."""
    argv = sys.argv[1:] if argv is None else argv
    if {'-h', '--help'} & set(argv):
        return None
    try:
        return apply()
    except ValueError as err:
        from .cliargs import USAGE_ERROR, print_error  # pylint: disable=import-outside-toplevel
        print_error(err)
        sys.exit(USAGE_ERROR)
