"""The export side in one line: python -m export and python -m export.predict
interrupted while they load MXNet, models and inputs that MXNet or numpy
would answer with a traceback, a file-size limit, an output that is the
input. Each case is one line on stderr and a non-zero exit."""
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')


def _loading_mxnet(pid):
    """Whether MXNet's library is mapped into the process: its import has begun."""
    try:
        with open('/proc/%d/maps' % pid) as f:
            return 'libmxnet' in f.read()
    except OSError:
        return False


@pytest.mark.parametrize('module', ['export', 'export.predict'])
@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_mxnet_loads_is_one_line(tmp_path, module, signum):
    """The signal lands as soon as MXNet's library is mapped, in the seconds
    its import takes, before any of the command's own code ran."""
    argv = (['--checkpoint', str(tmp_path / 'none'), '--out', str(tmp_path / 'e')]
            if module == 'export' else ['--model', str(tmp_path / 'm.onnx'), '--input', '-'])
    proc = subprocess.Popen([sys.executable, '-m', module] + argv, cwd=ROOT, env=ENV,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _loading_mxnet(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    assert stderr.startswith('error: ') and stderr.count('\n') == 1, stderr
    assert not os.path.exists(str(tmp_path / 'e'))
