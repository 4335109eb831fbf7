"""One node process of the bucket tests: ``python tests/buckets_worker.py
--out F --nodes N --table T``, ``bench.buckets``'s node process
(:func:`bench.buckets.worker_main`): for each configuration of the table
(``batches``, the sampler's seed of each node, the Pipeline's arguments),
``fit`` over ``FixedBucketSampler`` batches on ``Pipeline(..., nodes=N)``,
the parameters this node holds written to ``F<k>_<rank>.npz``; a refusal
of the nodes ends it in one line, exit status 2."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import buckets  # pylint: disable=wrong-import-position

if __name__ == '__main__':
    buckets.worker_main()
