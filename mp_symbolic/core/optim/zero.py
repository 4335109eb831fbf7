"""Optimizer state sharded across replicas (ZeRO stage 1): ``Pipeline(...,
shard_optimizer=True)``, described in docs/distributed.md.

Each of a stage's replicas owns whole parameters, balanced by bytes: it alone
keeps their optimizer state and runs their update, and the updated values go
to the other replicas. The assignment is a function of names, stage keys and
bytes alone, so every process, node and the memory estimate compute the same.
"""
from collections import OrderedDict

__all__ = []


def owners(params, replicas):
    """The replica that owns each parameter's optimizer state.

    Args:
        params: ``[(name, stage key, bytes)]`` of the trained parameters; the
            stage key is equal for the parameters of one stage.
        replicas: The replicas the state is shared over (at least 1).

    Returns:
        ``{name: replica}``: within a stage, each parameter dealt largest first
        to the replica holding the fewest bytes so far (ties to the lower), so
        the replicas' bytes differ by at most the largest parameter's.
    """
    stages = OrderedDict()
    for name, stage, size in params:
        stages.setdefault(stage, []).append((name, size))
    owned = {}
    for members in stages.values():
        load = [0] * replicas
        for name, size in sorted(members, key=lambda m: (-m[1], m[0])):
            k = min(range(replicas), key=lambda r: (load[r], r))
            owned[name] = k
            load[k] += size
    return owned


def check(shard_optimizer):
    """``shard_optimizer`` as given, checked.

    Raises:
        ValueError: it is not a bool.
    """
    if not isinstance(shard_optimizer, bool):
        raise ValueError('shard_optimizer: expected True or False, found %r'
                         % (shard_optimizer,))
    return shard_optimizer
