"""A process that joins a node job as node ``RANK`` with plain
torch.distributed, not as a node: ``python tests/fake_peer.py MODE FILE``
with the rendezvous variables of :func:`test_nodes.node_env`.

Modes:
    pickle: joins and sends, as ``all_gather_object`` does, a pickle whose
        unpickling creates ``FILE``.
    wrong-secret: answers node 0's nonce with a proof made with another
        secret than the job's, then joins as ``pickle`` does.
"""
import datetime
import hashlib
import hmac
import os
import shlex
import sys

sys.path.append(os.path.join(sys.prefix, 'torch-site'))  # where make setup installs torch
import torch.distributed as dist  # pylint: disable=wrong-import-position


class Payload:  # pylint: disable=too-few-public-methods
    """Unpickled, runs a shell command that creates the file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, ('touch %s' % shlex.quote(self.path),)


def main(mode, path):
    rank, count = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    timeout = datetime.timedelta(seconds=60)
    store = dist.PrefixStore('mp_symbolic/job/0', dist.TCPStore(
        os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), count, is_master=False,
        timeout=timeout))
    if mode == 'wrong-secret':
        nonce = store.get('auth/nonce').decode()
        store.set('auth/%d' % rank, hmac.new(b'not the secret', (
            'mp_symbolic node %d of %d: %s' % (rank, count, nonce)).encode(),
            hashlib.sha256).hexdigest())
    dist.init_process_group('gloo', store=store, rank=rank, world_size=count, timeout=timeout)
    dist.all_gather_object([None] * count, Payload(path))


if __name__ == '__main__':
    main(*sys.argv[1:])
