"""The size rules (DEVELOPERS.md, issue 29), checked beside the import contracts: functions up to 60 lines
(a nested function counts inside the one that holds it, as a reader sees it); a folder past 12 modules
gets subpackages by concept; files around 300 lines of code as a soft target (docstrings, comments and
blank lines do not count), reviewed past 500: over 500 fails here. Never a split whose only reason is a
count: these bounds are for reading, and a file is named after a concept a reader would look for."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "loraplex"
MAX_FUNCTION_LINES = 60
MAX_MODULES_PER_FOLDER = 12
MAX_CODE_LINES = 500


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_functions_fit_a_screen() -> None:
    long = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_folders_hold_at_most_twelve_modules() -> None:
    crowded = {str(d.relative_to(PACKAGE.parent)): n for d in {p.parent for p in sources()}
               if (n := len([f for f in d.glob("*.py") if f.name != "__init__.py"])) > MAX_MODULES_PER_FOLDER}
    assert not crowded, crowded


def test_files_are_reviewed_past_five_hundred_lines_of_code() -> None:
    big = {str(p.relative_to(PACKAGE.parent)): n for p in sources()
           if (n := code_lines(p.read_text())) > MAX_CODE_LINES}
    assert not big, big


def test_code_lines_leave_out_docstrings_and_comments() -> None:
    source = '"""Module doc.\n\nMore."""\n\n# a comment\nx = 1  # code\n\n\ndef f():\n    """Doc."""\n    return x\n'
    assert code_lines(source) == 3  # x = 1, def f(), return x
