"""Custom MXNet operators of the benchmarks, built from C++ with MXNet 1.9.1's
library API and loaded into this process (``mx.library.load``).

``fused_layer_norm`` (``bench/fused_layer_norm.cc``): LayerNorm over the last
axis, forward and backward each one pass a row. It is built with the C++
compiler on the path (``$CXX``, else ``g++``) against the ``lib_api.h`` of
the installed ``mxnet`` wheel and ``third_party/mxnet/lib_api.cc``, into
``artifacts/bench/`` under a name of the sources' digest, once; later calls
load what is built.
"""
import hashlib
import os
import shutil
import subprocess

import mxnet as mx

__all__ = ['fused_layer_norm']

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = (os.path.join(ROOT, 'bench', 'fused_layer_norm.cc'),
           os.path.join(ROOT, 'third_party', 'mxnet', 'lib_api.cc'))
OUT_DIR = os.path.join(ROOT, 'artifacts', 'bench')
_LOADED = {}


def fused_layer_norm():
    """``(True, path)`` once ``mx.sym.fused_layer_norm`` and
    ``mx.nd.fused_layer_norm`` exist in this process, else ``(False, why)``
    (no compiler, no header, the build failing: one line)."""
    if 'fused_layer_norm' in _LOADED:
        return _LOADED['fused_layer_norm']
    _LOADED['fused_layer_norm'] = result = _build_and_load()
    return result


def _build_and_load():
    compiler = os.environ.get('CXX') or shutil.which('g++')
    if not compiler:
        return False, 'no C++ compiler (g++, or $CXX) on the path'
    include = os.path.join(os.path.dirname(mx.__file__), 'include')
    if not os.path.isfile(os.path.join(include, 'mxnet', 'lib_api.h')):
        return False, 'the mxnet wheel has no include/mxnet/lib_api.h'
    digest = hashlib.sha256()
    for path in SOURCES + (os.path.join(include, 'mxnet', 'lib_api.h'),):
        with open(path, 'rb') as f:
            digest.update(f.read())
    path = os.path.join(OUT_DIR, 'libfused_layer_norm-%s.so' % digest.hexdigest()[:16])
    if not os.path.isfile(path):
        os.makedirs(OUT_DIR, exist_ok=True)
        building = '%s.%d' % (path, os.getpid())
        result = subprocess.run([compiler, '-shared', '-fPIC', '-std=c++11', '-O3', *SOURCES,
                                 '-I', include, '-o', building],
                                capture_output=True, text=True, check=False)
        if result.returncode:
            if os.path.exists(building):  # a compiler that failed part-way
                os.remove(building)
            lines = (result.stderr or result.stdout).strip().splitlines() or ['no output']
            return False, 'building %s failed: %s' % (os.path.basename(path), lines[0])
        os.replace(building, path)
    try:
        mx.library.load(path, verbose=False)
    except mx.base.MXNetError as err:
        lines = str(err).strip().splitlines() or ['no message']
        return False, 'loading %s failed: %s' % (os.path.basename(path), lines[0])
    return True, path
