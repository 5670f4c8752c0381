"""What the run schema's source says about each key: the comment on a field's line and the
comment block right above it (the schema documents its keys in comments), and a section's
docstring. Read with ``ast`` and ``tokenize`` from wherever the class is defined."""
import ast
import inspect
import io
import textwrap
import tokenize
from typing import Dict, List, Optional, Tuple


def markdown_code(text: str) -> str:
    """reStructuredText's ``code`` as Markdown's `code`."""
    return text.replace("``", "`")


def _class_node(cls) -> Tuple[ast.ClassDef, List[str]]:
    source = textwrap.dedent(inspect.getsource(cls))
    return ast.parse(source).body[0], source.splitlines()


def _comments(lines: List[str]) -> Dict[int, Tuple[str, bool]]:
    """line number (1-based) -> (comment text, whether the comment is alone on its line)."""
    out = {}
    tokens = tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline)
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            alone = lines[row - 1][:col].strip() == ""
            out[row] = (markdown_code(tok.string.lstrip("#").strip()), alone)
    return out


def _join(parts: List[str]) -> str:
    text = ""
    for part in parts:
        sep = " " if not text or text.endswith((".", ":", ",", ";", "(")) else "; "
        text = f"{text}{sep}{part}" if text else part
    return text


def field_notes(cls) -> Dict[str, str]:
    """field name -> its description (the comment block above it, then its own line's comment);
    fields without comments are left out."""
    node, lines = _class_node(cls)
    comments = _comments(lines)
    notes = {}
    for stmt in node.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        block, row = [], stmt.lineno - 1
        while row in comments and comments[row][1]:
            block.insert(0, comments[row][0])
            row -= 1
        trailing = [comments[r][0] for r in range(stmt.lineno, stmt.end_lineno + 1)
                    if r in comments and not comments[r][1]]
        text = _join(([" ".join(block)] if block else []) + trailing)
        if text:
            notes[stmt.target.id] = text
    return notes


def class_doc(cls) -> Optional[str]:
    """The class's own docstring (not the signature ``dataclass`` puts there without one)."""
    node, _ = _class_node(cls)
    doc = ast.get_docstring(node)
    return markdown_code(" ".join(doc.split())) if doc else None
