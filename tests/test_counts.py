"""``python -m bench.counts``: the structure counts of a tree, from its
source alone, on a tree small enough to count by hand."""
import subprocess
import sys
import textwrap

from bench import counts

CORE = '''\
"""A module.

Two lines of docstring, three with the quotes."""
import json


class Transport:
    """The interface."""


class LocalTransport(Transport):
    def send(self, x):
        # a comment is no code
        return x


NAMED = {'gpipe': 1, 'zigzag': 2}


def walk(symbol):
    """Walks the JSON.

    By hand."""
    graph = json.loads(symbol.tojson())
    return [n for n in graph['nodes']]
'''

USER = '''\
from .core.comm import LocalTransport


def pick(name):
    """'zigzag' in a docstring is not a use."""
    return LocalTransport() if name == 'gpipe' else None


class Maker:
    def make(self, schedule):
        return schedules.one_graph(schedule) or one_graph(schedule, None)


def choose(pipe):
    return runtime.fused(pipe) and pipe.schedule.fused
'''

SCHEDULE = '''\
def one_graph(spec):
    return spec is None


def pick(spec):
    return one_graph(spec)
'''


def _tree(tmp_path):
    core = tmp_path / 'mp_symbolic' / 'core'
    core.mkdir(parents=True)
    (core / 'comm.py').write_text(CORE)
    (core / 'ir.py').write_text("def read(g):\n    return g['nodes']\n")
    (tmp_path / 'mp_symbolic' / 'sched.py').write_text(SCHEDULE)
    (tmp_path / 'mp_symbolic' / 'user.py').write_text(USER)
    return str(tmp_path)


def test_counts_split_code_from_docstrings_and_name_the_files_naming_a_member(tmp_path):
    root = _tree(tmp_path)
    sources = [counts.Source(root, p) for p in counts.python_files(root, counts.CORE)]
    core = counts.core_counts(sources)
    # comm.py: 3 + 1 + 3 docstring lines; ir.py none
    assert core['docstring'] == 7
    # comm.py: import, two class lines, def send, return, NAMED, def walk, graph =,
    # return; ir.py: two
    assert core['code'] == 9 + 2
    largest = counts.largest_functions(sources)
    assert largest[0] == (6, 3, 'mp_symbolic/core/comm.py:walk')
    assert ('mp_symbolic/core/comm.py:LocalTransport.send' in [r[2] for r in largest])
    # the walk in ir.py is not counted; comm.py's two lines are
    assert counts.raw_walks(root) == {'mp_symbolic/core/comm.py': 2}
    touched = counts.touched(root, sources, counts.extension_points(sources))
    assert touched['transport'] == (2, ['mp_symbolic/user.py'], ['LocalTransport'])
    assert touched['schedule'] == (2, ['mp_symbolic/user.py'], ['gpipe', 'zigzag'])


def test_counts_list_each_call_choosing_the_runtime_by_one_graph_or_fused_outside_its_module(
        tmp_path):
    root = _tree(tmp_path)
    # a schedule's fused read (not a call) is no choice
    assert counts.runtime_choices(root) == ['mp_symbolic/user.py:Maker.make'] * 2 + [
        'mp_symbolic/user.py:choose']


def test_counts_refuses_a_folder_without_core_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, '-m', 'bench.counts', str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == textwrap.dedent(
        'python -m bench.counts: error: root: expected a tree holding mp_symbolic/core, '
        'found %s' % tmp_path)
