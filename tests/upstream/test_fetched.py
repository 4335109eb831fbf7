"""MXNet 1.9.1's own Module tests, run here where they have been fetched:
``test_module.py`` and the ``test_bucketing.py`` it imports are not kept in
this tree (see ``conftest.py``). Where one is absent, as on a fresh clone,
its test here is skipped with the command that fetches it, so that a run
says what it did not check; where it is present, it must be apache/mxnet's
file at tag 1.9.1, byte for byte (its tests then run beside this file)."""
import hashlib
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = 'https://raw.githubusercontent.com/apache/mxnet/1.9.1/tests/python/'
# sha256 of each file at tag 1.9.1 (commit 3f8f3be9)
FILES = {
    'test_module.py': ('unittest/test_module.py',
                       '1d4344106f6658c4731c3001d19de3e0d7d1fd8ca5db9c84aab2471b046598c6'),
    'test_bucketing.py': ('train/test_bucketing.py',
                          '9e0ee10f8c542fc47414f134ab12734d9b71e12fdead97c6b8a317a584b35cc0'),
}


@pytest.mark.parametrize('name', sorted(FILES))
def test_mxnets_own_module_test_file_is_its_1_9_1_text(name):
    source, digest = FILES[name]
    path = os.path.join(HERE, name)
    if not os.path.exists(path):
        pytest.skip('MXNet 1.9.1\'s own %s is not here, so its tests did not run against this '
                    'Module; fetch it with: curl -fsSL -o tests/upstream/%s %s%s'
                    % (name, name, SOURCE, source))
    with open(path, 'rb') as f:
        found = hashlib.sha256(f.read()).hexdigest()
    assert found == digest, 'tests/upstream/%s: expected apache/mxnet 1.9.1\'s file ' \
        '(sha256 %s), found sha256 %s' % (name, digest, found)
