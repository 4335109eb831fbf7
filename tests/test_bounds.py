

# -- task arguments are stored exactly, or refused before training -------------------------------

@pytest.mark.parametrize('value, found', [
    ("b'abc'", "x=b'abc' (bytes)"),
    ('{1,2}', 'x={1, 2} (set)'),
    ('1j', 'x=1j (complex)'),
    ('...', 'x=Ellipsis (ellipsis)'),
    ('{3:4}', 'x={3: 4} (a dict key that is not a string: 3)'),
    ("[1,{'a':{2:3}}]", "x=[1, {'a': {2: 3}}] (a dict key that is not a string: 2)"),
])
def test_task_arguments_json_cannot_store_exactly_are_refused_before_training(tmp_path, capsys,
                                                                               value, found):
    from mp_symbolic.training import cli  # pylint: disable=import-outside-toplevel
    status = cli.main(['train', '--task-arg', 'x=' + value, '--out', str(tmp_path / 'out')]
                      + TRAIN)
    assert status == 2
    assert capsys.readouterr().err == (
        'error: --task-arg: expected values summary.json stores exactly (numbers, strings, '
        'True, False, None, lists, dicts with string keys), found %s\n' % found)
    assert not (tmp_path / 'out').exists()
