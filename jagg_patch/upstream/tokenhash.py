"""A hash of a function's source that is the same on every Python: its tokens, without comments,
blank lines or layout, joined by one space (sha256, 16 hex digits).

`ast.dump` differs between Python releases (3.12 adds type_params, 3.13 leaves out empty fields),
so a hash of the syntax tree recorded on one Python fires on another. Tokens differ in one place:
from 3.12 on, tokenize splits an f-string into FSTRING_START / MIDDLE / END with the expression's
tokens between; before, the f-string is one STRING token. `token_hash` joins each f-string back
into that one token (its source text), so it is the same on every Python; `native_token_hash` is
the running Python's own tokenization, which a hash recorded on 3.12 or later matches there.

Standard library only: a test imports this module under other Pythons than the project's.
"""
import hashlib
import inspect
import io
import textwrap
import tokenize

_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}
_FSTRING_START = getattr(tokenize, "FSTRING_START", None)   # Python >= 3.12
_FSTRING_END = getattr(tokenize, "FSTRING_END", None)


def function_source(fn):
    """The function's source as the hash reads it: inspect.getsource, dedented."""
    return textwrap.dedent(inspect.getsource(fn))


def _span(lines, start, end):
    """The source text between two (row, col) token positions (rows count from 1)."""
    (r0, c0), (r1, c1) = start, end
    if r0 == r1:
        return lines[r0 - 1][c0:c1]
    return lines[r0 - 1][c0:] + "".join(lines[r0:r1 - 1]) + lines[r1 - 1][:c1]


def source_tokens(source, join_fstrings=True):
    """The token strings the hash joins. join_fstrings: each f-string as one token (its source
    text), as Python <= 3.11 tokenizes it; False: the running Python's own tokens."""
    lines = source.splitlines(keepends=True)
    tokens, depth, start = [], 0, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in _SKIPPED:
            continue
        if join_fstrings and _FSTRING_START is not None:
            if tok.type == _FSTRING_START:
                depth += 1
                start = tok.start if depth == 1 else start
                continue
            if tok.type == _FSTRING_END:
                depth -= 1
                if depth == 0:
                    tokens.append(_span(lines, start, tok.end))
                continue
            if depth:
                continue
        tokens.append(tok.string)
    return tokens


def hash_tokens(tokens):
    return hashlib.sha256(" ".join(tokens).encode()).hexdigest()[:16]


def token_hash(fn):
    """The source hash of fn, the same on every Python (f-strings as one token each)."""
    return hash_tokens(source_tokens(function_source(fn)))


def native_token_hash(fn):
    """The source hash of fn as the running Python tokenizes it (differs from token_hash only on
    Python >= 3.12, and only where fn has an f-string)."""
    return hash_tokens(source_tokens(function_source(fn), join_fstrings=False))


def token_hashes(fn):
    """Both hashes of fn, token_hash first; one when they agree."""
    return tuple(dict.fromkeys((token_hash(fn), native_token_hash(fn))))
