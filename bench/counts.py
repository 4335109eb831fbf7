"""``python -m bench.counts [ROOT]``: the structure of a tree of this project,
counted from its source alone (``ast`` and ``tokenize``; nothing of ROOT is
imported), so that one command prints the same counts for any commit
(``git archive <commit> | tar -x -C DIR`` then ``python -m bench.counts DIR``).

* **core**: ``mp_symbolic/core`` (every ``.py`` under it): files, lines of
  code (lines holding a token that is neither a comment nor part of a
  docstring) and lines of docstring (the lines a module's, class's or
  function's docstring spans), and their ratio.
* **the 15 largest functions** of core, by the lines they span (a method
  as ``Class.method``), with their code lines.
* **raw JSON walks outside ir**: lines of ``mp_symbolic/`` and ``export/``
  outside ``ir.py`` that index MXNet's graph JSON by its keys
  (``['nodes']``, ``['heads']``, ``['arg_nodes']``, ``['node_row_ptr']``) or
  read a Symbol's ``tojson()``: :data:`RAW_WALK`, a heuristic grep.
* **runtime choices**: the calls of the function that says whether a step
  runs on GPipe's one graph or on the stage runtime (:data:`CHOOSERS`:
  ``schedule.one_graph``, then ``runtime.fused``) in ``mp_symbolic/``,
  ``export/`` and ``bench/``, outside the module that defines it: each is
  a site that branches on which runtime a step runs on. Listed as
  ``file:function``.
* **files touched to add** a transport, a schedule, a parallel layer and a
  loss head (the extension points docs/layout.md lists): one (the new
  member's file or record) plus every file of ``mp_symbolic/`` and
  ``export/`` that names an existing member in its code (not in a
  docstring or comment), other than the registry's file and the members'
  own: a file that names a member is where a new one may need a branch or
  an entry. The members are found in ROOT: the transports are core's
  classes named ``*Transport`` but ``Transport``; the schedules, the keys
  of ``NAMED``; the parallel layers, core's subclasses of ``ShardedBlock``;
  the loss heads, the operators of ``HEADS``'s records (``Head(loss, op,
  ...)``). The files are listed, for a reader to judge.
"""
import argparse
import ast
import io
import os
import re
import sys
import tokenize

CORE = os.path.join('mp_symbolic', 'core')
SCOPES = ('mp_symbolic', 'export')  # the code whose files an extension may touch
LARGEST = 15
CHOOSERS = ('one_graph', 'fused')  # the function choosing the runtime, in any commit
RAW_WALK = re.compile(r"""\[\s*['"](nodes|heads|arg_nodes|node_row_ptr)['"]\s*\]|tojson\(\)""")


def python_files(root, folder):
    """The ``.py`` files under ``root/folder``, relative to ``root``, sorted."""
    out = []
    for path, dirs, files in os.walk(os.path.join(root, folder)):
        dirs[:] = sorted(d for d in dirs if not d.startswith(('.', '__pycache__')))
        out.extend(os.path.relpath(os.path.join(path, f), root) for f in files
                   if f.endswith('.py'))
    return sorted(out)


class Source:
    """One file: its text, its tree and the lines of its docstrings."""

    def __init__(self, root, path):
        self.path = path
        with open(os.path.join(root, path), encoding='utf-8') as f:
            self.text = f.read()
        self.tree = ast.parse(self.text, path)
        self.docstrings = set()   # line numbers
        self._docstring_nodes = set()
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)) and node.body:
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                        isinstance(first.value.value, str):
                    self.docstrings.update(range(first.lineno, first.end_lineno + 1))
                    self._docstring_nodes.add(id(first.value))
        self.code = set()
        for tok in tokenize.generate_tokens(io.StringIO(self.text).readline):
            if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
                continue
            for line in range(tok.start[0], tok.end[0] + 1):
                if line not in self.docstrings:
                    self.code.add(line)

    def functions(self):
        """``(qualified name, first line, last line)`` of every function."""
        out = []

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = prefix + child.name
                    out.append((name, child.lineno, child.end_lineno))
                    visit(child, name + '.')
                elif isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + '.')
                else:
                    visit(child, prefix)
        visit(self.tree, '')
        return out

    def names(self):
        """Every identifier and string its code holds (docstrings left out)."""
        out = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name):
                out.add(node.id)
            elif isinstance(node, ast.Attribute):
                out.add(node.attr)
            elif isinstance(node, ast.alias):
                out.add(node.asname or node.name.rsplit('.', 1)[-1])
                out.add(node.name.rsplit('.', 1)[-1])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    id(node) not in self._docstring_nodes:
                out.add(node.value)
        return out

    def classes(self):
        """``(name, [base names])`` of every class."""
        return [(n.name, [b.id if isinstance(b, ast.Name) else getattr(b, 'attr', '')
                          for b in n.bases])
                for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)]


def core_counts(sources):
    code = sum(len(s.code) for s in sources)
    docs = sum(len(s.docstrings) for s in sources)
    return {'files': len(sources), 'code': code, 'docstring': docs,
            'ratio': docs / code if code else 0.0}


def largest_functions(sources, count=LARGEST):
    rows = []
    for source in sources:
        for name, first, last in source.functions():
            code = len([n for n in range(first, last + 1) if n in source.code])
            rows.append((last - first + 1, code, '%s:%s' % (source.path, name)))
    return sorted(rows, key=lambda r: (-r[0], r[2]))[:count]


def raw_walks(root):
    """``{path: lines}`` of :data:`RAW_WALK`'s matches outside ``ir.py``."""
    out = {}
    for scope in SCOPES:
        for path in python_files(root, scope):
            if os.path.basename(path) == 'ir.py' and path.startswith(CORE):
                continue
            with open(os.path.join(root, path), encoding='utf-8') as f:
                hits = sum(1 for line in f if RAW_WALK.search(line))
            if hits:
                out[path] = hits
    return out


def runtime_choices(root, scopes=SCOPES + ('bench',)):
    """``['file:function']`` of every call of a function of :data:`CHOOSERS`
    (a name or an attribute) outside the file that defines it, in
    ``scopes``, sorted."""
    found = []
    for scope in scopes:
        for path in python_files(root, scope):
            source = Source(root, path)
            defined = {n.name for n in source.tree.body if isinstance(n, ast.FunctionDef)}
            spans = source.functions()
            for node in ast.walk(source.tree):
                func = getattr(node, 'func', None)
                called = {getattr(func, 'id', None), getattr(func, 'attr', None)}
                if isinstance(node, ast.Call) and called & (set(CHOOSERS) - defined):
                    inside = [(first, name) for name, first, last in spans
                              if first <= node.lineno <= last]
                    found.append('%s:%s' % (path, max(inside)[1] if inside else '<module>'))
    return sorted(found)


def _defining(sources, predicate):
    """``{name: path}`` of core's classes for which ``predicate(name, bases)``."""
    return {name: s.path for s in sources for name, bases in s.classes()
            if predicate(name, bases)}


def _subclasses(sources, base):
    found = {base: None}
    grew = True
    while grew:
        grew = False
        for s in sources:
            for name, bases in s.classes():
                if name not in found and any(b in found for b in bases):
                    found[name] = s.path
                    grew = True
    del found[base]
    return found


def _assigned(sources, target):
    """The source and value node of core's module-level ``target = ...``."""
    for s in sources:
        for node in s.tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == target for t in targets):
                    return s, node.value
    return None, None


def extension_points(sources):
    """``{point: (registry file, {member: its file or None})}``."""
    points = {}
    transports = _defining(sources, lambda n, b: n.endswith('Transport') and n != 'Transport')
    registry = next((s.path for s in sources for n, _ in s.classes() if n == 'Transport'),
                    next(iter(sorted(set(transports.values()))), None))
    points['transport'] = (registry, transports)
    source, value = _assigned(sources, 'NAMED')
    names = [k.value for k in getattr(value, 'keys', []) if isinstance(k, ast.Constant)]
    points['schedule'] = (source.path if source else None, dict.fromkeys(names))
    layers = _subclasses(sources, 'ShardedBlock')
    registry = next((s.path for s in sources for n, _ in s.classes() if n == 'ShardedBlock'),
                    None)
    points['parallel layer'] = (registry, layers)
    source, value = _assigned(sources, 'HEADS')
    ops = {}
    if source is not None:
        for node in ast.walk(source.tree):
            if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'Head' and \
                    len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                ops[node.args[1].value] = None
    points['loss head'] = (source.path if source else None, ops)
    return points


def touched(root, sources, points):
    """``{point: (files to touch, [the files that name a member])}``."""
    every = [Source(root, p) for scope in SCOPES for p in python_files(root, scope)]
    out = {}
    for point, (registry, members) in points.items():
        own = {registry} | {p for p in members.values() if p}
        naming = sorted(s.path for s in every if s.path not in own and
                        s.names() & set(members))
        out[point] = (1 + len(naming), naming, sorted(members))
    return out


def report(root):
    """The counts of the tree at ``root``, as lines of text."""
    from mp_symbolic.tools.text import columns  # pylint: disable=import-outside-toplevel
    sources = [Source(root, p) for p in python_files(root, CORE)]
    core = core_counts(sources)
    lines = ['core (%s): %d files, %d lines of code, %d lines of docstring (%.2f per line of '
             'code)' % (CORE, core['files'], core['code'], core['docstring'], core['ratio']),
             '', 'the %d largest functions of core:' % LARGEST]
    lines += ['  ' + l for l in columns([('lines', 'code', 'function')] +
                                        largest_functions(sources))]
    walks = raw_walks(root)
    lines += ['', 'raw JSON walks outside ir: %d lines in %d files' % (sum(walks.values()),
                                                                        len(walks))]
    lines += ['  ' + l for l in columns([('lines', 'file')] + sorted(
        ((n, p) for p, n in walks.items()), key=lambda r: (-r[0], r[1])))] if walks else []
    choices = runtime_choices(root)
    lines += ['', 'runtime choices (calls of %s outside its module): %d'
              % (' or '.join(CHOOSERS), len(choices))] + ['  ' + c for c in choices]
    lines += ['', 'files touched to add one (the new one, and the files naming a member):']
    for point, (count, naming, members) in touched(root, sources,
                                                   extension_points(sources)).items():
        lines.append('  %-15s %d  (members: %s)' % (point, count, ', '.join(members)))
        lines += ['      ' + p for p in naming]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.counts', description=__doc__.split(
        '\n\n', 1)[0])
    parser.add_argument('root', nargs='?', default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), help='a tree of this project (default: this one)')
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(args.root, CORE)):
        parser.error('root: expected a tree holding %s, found %s' % (CORE, args.root))
    print('\n'.join(report(args.root)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
