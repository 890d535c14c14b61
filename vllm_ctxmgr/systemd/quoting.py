"""systemd's quoting rules, in one place: how ExecStart= and Environment= values split into words
and how a value is written back so systemd reads exactly it.

Hand-written because no library implements systemd's extract_first_word() with the spans an edit
needs; each rule cites the systemd function it mirrors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_ctxmgr.errors import UnitError

# ---------------------------------------------------------------------------------------------
# Lexing one ExecStart= value into words, the way systemd's extract_first_word() does
# (EXTRACT_UNQUOTE | EXTRACT_CUNESCAPE), keeping each word's span in the raw text.

_C_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
    '"': '"',
    "'": "'",
    "s": " ",
    ";": ";",
}


@dataclass(frozen=True)
class Word:
    value: str  # unquoted, C-unescaped; `%%` and `$$` are kept (they are resolved later by systemd)
    start: int  # span of the word in the raw assignment text
    end: int


def split_words(text: str) -> list[Word]:
    """Split an ExecStart= value; `\\` + newline (a continuation) counts as whitespace."""
    words: list[Word] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i] in " \t\n\r" or text.startswith("\\\n", i)):
            i += 2 if text.startswith("\\\n", i) else 1
        if i >= n:
            return words
        start = i
        out: list[str] = []
        quote: str | None = None
        while i < n:
            ch = text[i]
            if quote is None and (ch in " \t\r\n" or text.startswith("\\\n", i)):
                break
            if ch == "\\" and i + 1 < n:
                nxt = text[i + 1]
                if nxt == "\n":  # continuation inside a word: joins
                    i += 2
                    continue
                if nxt in _C_ESCAPES:
                    out.append(_C_ESCAPES[nxt])
                    i += 2
                    continue
                if nxt == "x" and re.match(r"[0-9a-fA-F]{2}", text[i + 2 : i + 4]):
                    out.append(chr(int(text[i + 2 : i + 4], 16)))
                    i += 4
                    continue
                raise UnitError(f"unsupported escape '\\{nxt}' in ExecStart=")
            if ch == "\\":
                raise UnitError("ExecStart= ends with a lone backslash")
            if quote is None and ch in "\"'":
                quote = ch
                i += 1
                continue
            if quote is not None and ch == quote:
                quote = None
                i += 1
                continue
            out.append(ch)
            i += 1
        if quote is not None:
            raise UnitError(f"unbalanced quote {quote} in ExecStart=")
        words.append(Word("".join(out), start, i))


def quote_exec_word(value: str) -> str:
    """Quote one argument for ExecStart= so systemd hands the program exactly `value`.

    `%` becomes `%%` (specifiers) and `$` becomes `$$` (environment expansion); control
    characters are C-escaped, so a value can never end the line or start a new directive.
    """
    escaped = _c_escape(value.replace("%", "%%").replace("$", "$$"))
    if escaped and re.fullmatch(r"[A-Za-z0-9_@%+=:,./$-]+", escaped) and escaped != ";":
        return escaped
    return f'"{escaped}"'


def quote_env_assignment(name: str, value: str) -> str:
    """One Environment= item: `"NAME=value"` (specifiers are expanded there too, `$` is not)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise UnitError(f"invalid environment variable name {name!r}")
    escaped = _c_escape(value.replace("%", "%%"))
    item = f"{name}={escaped}"
    return item if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]*", item) else f'"{item}"'


def _c_escape(value: str) -> str:
    out = []
    for ch in value:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "'":
            out.append("\\'")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def resolve_escapes(value: str) -> str:
    """What the program receives for a word without specifiers or variables: `%%`->`%`, `$$`->`$`."""
    return re.sub(r"%%|\$\$", lambda m: m.group(0)[0], value)
