"""``python -m bench.networks``: one small network's row (``--quick``), built
in a child process, and a name it does not know refused in one line."""
import os
import subprocess
import sys

import pytest

from bench import networks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, MXNET_SUBGRAPH_VERBOSE='0')


def _cells(line):
    return [c.strip() for c in line.strip().strip('|').split('|')]


@pytest.mark.slow
def test_a_quick_row_of_mobilenetv2_has_every_column_measured():
    pytest.importorskip('gluoncv')
    proc = subprocess.run([sys.executable, '-m', 'bench.networks', '--only', 'mobilenetv2_0.25',
                           '--quick'], capture_output=True, text=True, timeout=900, env=ENV,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [_cells(l) for l in proc.stdout.splitlines() if l.startswith('| mobilenetv2_0.25 ')]
    assert len(rows) == 1
    row = dict(zip(networks.COLUMNS, rows[0]))
    assert row['input'] == '32x32'
    for column in ('split = one device', '1F1B = GPipe params', '1F1B = GPipe statistics',
                   'predict'):
        assert float(row[column]) >= 0, (column, row[column])
    assert float(row['split = one device']) < 1e-4
    assert float(row['1F1B = GPipe params']) < 1e-4
    assert float(row['predict']) < 1e-4
    assert row['export'] == 'PASSED'
    deferred = row['deferred = whole batch'].split(', ')
    assert [d.split(' ')[0] for d in deferred] == ['all', 'first']
    assert all(float(d.split(' ')[1]) >= 0 for d in deferred)


def test_a_crash_in_the_child_is_a_row_not_the_end_of_the_table():
    row = networks.run_row('no-such-network', timeout=120)
    assert row['network'] == 'no-such-network'
    assert row['split = one device'].startswith('crashed (exit 1): KeyError')


def test_an_unknown_name_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, '-m', 'bench.networks', '--only', 'resnet1000'],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.startswith('error: --only: expected names among mobilenetv2_0.25, ')
    assert proc.stderr.strip().endswith('found resnet1000')
    assert len(proc.stderr.strip().splitlines()) == 1
