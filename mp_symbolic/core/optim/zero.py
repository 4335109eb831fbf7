"""Optimizer state sharded across replicas (ZeRO stage 1): ``Pipeline(...,
shard_optimizer=True)``.

Each of a stage's R replicas (R x W over W ``dist_sync`` workers) owns a
share of that stage's trained parameters: it alone keeps their optimizer
state and runs their update, on the gradient the kvstore summed, and the
updated values then go to the other replicas (a copy in one process; over
workers, the owner's value summed with the others' zeros by the kvstore).

The shares are whole parameters, balanced by bytes within each stage (each
stage's parameters are dealt largest first to the replica holding the
fewest bytes so far, ties to the lower replica). A whole parameter is
updated by the same op on the same summed gradient and the same state as
an unsharded replica updates it, so the values are bit for bit the
unsharded run's for every optimizer; slices of each parameter would give
exactly 1/R of the bytes, but an optimizer that reads a whole parameter
(LARS' and LAMB's norms) would then see a slice, and MXNet's fused
``multi_*`` updates would group other arrays. The price is granularity: a
replica's share is within one parameter's bytes of 1/R of its stage's.

The assignment is a function of names, stage keys and bytes alone, so every
process, node and the memory estimate compute the same one.
"""
from collections import OrderedDict

__all__ = []


def owners(params, replicas):
    """The replica that owns each parameter's optimizer state.

    Args:
        params: ``[(name, stage key, bytes)]`` of the trained parameters; the
            stage key is anything equal for the parameters of one stage (the
            device of replica 0's copy).
        replicas: R, the replicas the state is shared over (at least 1).

    Returns:
        ``{name: replica}``, each replica in ``range(replicas)``; within a
        stage the replicas' bytes differ by at most the largest parameter's.
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
