"""Every command of the walkthroughs README.md links (docs/your-own-model.md)
runs as written, in order, in a copy of this folder of their own: they
write their own folders under artifacts/ and read nothing the README's
commands write, so they run beside ``tests/test_readme.py`` on another
pytest worker (see that file for what a step is)."""
import pytest

from test_readme import WALKTHROUGHS, _readme_steps, run_steps, workdir  # noqa: F401  (fixture)


@pytest.mark.slow
@pytest.mark.parametrize('page', WALKTHROUGHS)
def test_every_walkthrough_command_runs_as_written(page, workdir, capsys, monkeypatch):  # noqa: F811
    steps = _readme_steps((page,))
    assert [kind for kind, _, _ in steps].count('run') >= 10
    failures = run_steps(steps, workdir, capsys, monkeypatch)
    assert not failures, '\n'.join(failures)
