"""One node process of a test of the end-of-run report over nodes:
``python tests/report_nodes_worker.py TRAIN-ARGUMENTS...``.

Runs ``python -m mp_symbolic train TRAIN-ARGUMENTS`` in this process (the
rendezvous from the environment, as ``launch`` sets it), recording what the
nodes' :class:`~mp_symbolic.core.transport.nodes.Group` carries: the numpy arrays'
bytes every ``gather`` returned to this node, and each array
``broadcast_array`` returned. Its last line, after the run's own:
``carried: {"gathered": [...], "read": [...]}`` (JSON, bytes).
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mp_symbolic.core.transport import nodes  # pylint: disable=wrong-import-position
from mp_symbolic.training import cli  # pylint: disable=wrong-import-position
from mp_symbolic.tools.interrupts import end_process  # pylint: disable=wrong-import-position


def array_bytes(value):
    """The bytes of the numpy arrays in ``value`` (dicts and lists walked)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, dict):
        return sum(array_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(array_bytes(v) for v in value)
    return 0


def main(argv):
    carried = {'gathered': [], 'read': []}
    gather = nodes.Group.gather

    def recorded_gather(self, value):
        gathered = gather(self, value)
        carried['gathered'].append(array_bytes(gathered))
        return gathered

    nodes.Group.gather = recorded_gather
    read = getattr(nodes.Group, 'broadcast_array', None)
    if read is not None:
        def recorded_read(self, *args, **kwargs):
            array = read(self, *args, **kwargs)
            carried['read'].append(array.nbytes)
            return array
        nodes.Group.broadcast_array = recorded_read
    status = cli.main(argv)
    print('carried: %s' % json.dumps(carried), flush=True)
    return status


if __name__ == '__main__':
    end_process(main(sys.argv[1:]))  # without seconds of Python's final collection
