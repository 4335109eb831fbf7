"""``train`` under ``python -m mp_symbolic launch``: two data-parallel workers
of the model-parallel pipeline, gradients summed by dist_sync through
ps-lite, equal to one process on the same global batch."""
import re
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

from mp_symbolic.tools.checkpoint import read_checkpoint
from mp_symbolic.training.metrics import AGREE_ATOL, AGREE_RTOL
from mp_symbolic.training.loop import train

from conftest import make_config

TRAIN = ['train', '--epochs', '2', '--num-examples', '1000', '--devices', 'cpu:0,cpu:1',
         '--optimizer', 'adam', '--lr', '0.05', '--no-progress', '--no-memory']


@pytest.fixture(scope='module')
def dist_job(tmp_path_factory):
    """Two workers' training under the launcher: ``(job, its folder)``."""
    tmp_path = tmp_path_factory.mktemp('dist')
    job = subprocess.run([sys.executable, '-m', 'mp_symbolic', 'launch', '--workers', '2',
                          '--servers', '1', '--'] + TRAIN + ['--out', str(tmp_path / 'dist')],
                         capture_output=True, text=True, timeout=240, check=False)
    return job, tmp_path


def test_two_workers_end_with_the_same_parameters_as_one_process(dist_job):
    job, tmp_path = dist_job
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
    digests = re.findall(r'^\[worker (\d), rank \d\] parameters sha256: ([0-9a-f]{64})$',
                         job.stdout, re.M)
    assert sorted(w for w, _ in digests) == ['0', '1']
    assert digests[0][1] == digests[1][1]  # both workers hold the same weights
    assert len(re.findall(r'this worker writes the checkpoints', job.stdout)) == 1
    assert 'launch: 2 workers, 1 server: all exited 0' in job.stdout

    one = train(make_config(devices='cpu:0,cpu:1', num_epochs=2, num_examples=1000,
                            optimizer='adam', lr=0.05, progress=False,
                            out=str(tmp_path / 'one')), log=lambda line: None)
    _, arg_params, _ = read_checkpoint(str(tmp_path / 'dist')).load()
    for name, value in one.params.items():
        np.testing.assert_allclose(arg_params[name].asnumpy(), value, rtol=AGREE_RTOL,
                                   atol=AGREE_ATOL, err_msg=name)
    assert arg_params['layer2_weight'].context == mx.cpu()


def test_worker_lines_name_the_kvstore_rank_once_known(dist_job):
    """ps-lite ranks the workers as they register, not in the launcher's
    order: each worker's lines carry its kvstore rank from the line that
    reports it on, and the checkpoint is written by rank 0's."""
    job, _ = dist_job
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
    told = re.findall(r'^\[worker (\d), rank (\d)\] worker (\d) of 2 \(kvstore dist_sync\)',
                      job.stdout, re.M)
    assert sorted(index for index, _, _ in told) == ['0', '1'], job.stdout
    assert all(rank == said for _, rank, said in told), told
    ranks = dict((index, rank) for index, rank, _ in told)
    assert sorted(ranks.values()) == ['0', '1']
    # after its rank line, every line of a worker names that rank
    for index, rank in ranks.items():
        lines = [l for l in job.stdout.splitlines() if l.startswith('[worker %s' % index)]
        start = next(i for i, l in enumerate(lines) if 'of 2 (kvstore dist_sync)' in l)
        assert all(l.startswith('[worker %s, rank %s] ' % (index, rank))
                   for l in lines[start:]), lines
    writer = re.findall(r'^\[worker \d, rank (\d)\] checkpoint: ', job.stdout, re.M)
    assert writer and set(writer) == {'0'}, job.stdout
