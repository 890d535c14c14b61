"""systemd's quoting rules, in one place: how ExecStart=, Environment=, `systemctl show` values and
EnvironmentFile= files split into words, how `$VAR` expands when systemd executes a command, and how a
value is written back so systemd reads exactly it.

Hand-written because no library implements systemd's extract_first_word(), replace_env_argv() and
env-file parser with the spans an edit needs; each function names the systemd function it mirrors, and
tests/systemd/test_exec_start.py compares them with what a real systemd runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vllm_ctxmgr.errors import UnitError

WHITESPACE = " \t\n\r"
NEWLINE = "\n\r"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# ---------------------------------------------------------------------------------------------
# The one escape table: systemd's cunescape_one() (src/basic/escape.c).

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
    "s": " ",  # systemd's extension of the XDG syntax
}
_HEX = "0123456789abcdefABCDEF"


def cunescape_one(text: str, i: int) -> tuple[bytes, int] | None:
    """The character escaped at text[i] (just after a backslash) as bytes, and how many characters the
    escape used; None where systemd rejects it (unknown letter, NUL, invalid code point)."""
    char = text[i : i + 1]
    if char in _C_ESCAPES:
        return _C_ESCAPES[char].encode(), 1
    if char == "x":
        digits = text[i + 1 : i + 3]
        if len(digits) == 2 and all(d in _HEX for d in digits) and int(digits, 16) != 0:
            return bytes([int(digits, 16)]), 3  # an eight-bit byte, not a code point
        return None
    if char in ("u", "U"):
        width = 4 if char == "u" else 8
        digits = text[i + 1 : i + 1 + width]
        if len(digits) == width and all(d in _HEX for d in digits):
            code = int(digits, 16)
            if 0 < code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF:
                return chr(code).encode(), 1 + width
        return None
    if char and char in "01234567":
        digits = text[i : i + 3]
        if len(digits) == 3 and all(d in "01234567" for d in digits) and 0 < int(digits, 8) < 256:
            return bytes([int(digits, 8)]), 3
        return None
    return None


# ---------------------------------------------------------------------------------------------
# Splitting into words: systemd's extract_first_word().


@dataclass(frozen=True)
class Word:
    value: str  # unquoted, C-unescaped; `%%` and `$$` are kept (specifiers and variables come later)
    start: int  # span of the word in the text that was split
    end: int
    separator: bool = False  # a bare `;`: ExecStart='s command separator, not an argument


def _extract(text: str, i: int, cunescape: bool, relax: bool, shell_quoted: bool) -> tuple[bytes, int]:
    """One word from text[i] (not whitespace): its bytes and the index after it.

    cunescape: EXTRACT_CUNESCAPE with the EXTRACT_CUNESCAPE_RELAX retry of extract_first_word_and_warn()
    (an unknown escape is kept verbatim, a trailing backslash too); otherwise a backslash takes the next
    character literally. relax: EXTRACT_RELAX (an unbalanced quote ends the word). shell_quoted: text that
    systemd wrote with shell_maybe_quote() (`systemctl show`), where `\\$` and `` \\` `` stand for the
    character itself."""
    out = bytearray()
    n = len(text)
    quote = ""
    while i < n:
        ch = text[i]
        if not quote and ch in WHITESPACE:
            break
        if ch == "\\":
            if i + 1 >= n:
                if quote and not relax:
                    raise UnitError(f"unbalanced quote {quote} in {text!r}")
                if cunescape and not quote:
                    out += b"\\"
                return bytes(out), n
            if cunescape:
                escaped = cunescape_one(text, i + 1)
                if escaped is None:
                    kept = text[i + 1] if shell_quoted else "\\" + text[i + 1]
                    out += kept.encode("utf-8", "surrogateescape")
                    i += 2
                else:
                    out += escaped[0]
                    i += 1 + escaped[1]
            else:
                out += text[i + 1].encode("utf-8", "surrogateescape")
                i += 2
            continue
        if quote:
            if ch == quote:
                quote = ""
            else:
                out += ch.encode("utf-8", "surrogateescape")
            i += 1
            continue
        if ch in "\"'":
            quote = ch
        else:
            out += ch.encode("utf-8", "surrogateescape")
        i += 1
    if quote and not relax:
        raise UnitError(f"unbalanced quote {quote} in {text!r}")
    return bytes(out), i


def split_words(
    text: str, cunescape: bool = True, relax: bool = False, shell_quoted: bool = False
) -> list[Word]:
    """Words of ExecStart=, Environment= or a `systemctl show` list, as systemd splits them
    (config_parse_exec: a bare `;` is a separator, a bare `\\;` a literal `;`)."""
    words: list[Word] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in WHITESPACE:
            i += 1
        if i >= n:
            return words
        start = i
        end_of_word = text[i + 1 : i + 2] in ("", *WHITESPACE)
        if cunescape and text[i] == ";" and end_of_word:
            words.append(Word(";", start, i + 1, separator=True))
            i += 1
            continue
        if cunescape and text.startswith("\\;", i) and text[i + 2 : i + 3] in ("", *WHITESPACE):
            words.append(Word(";", start, i + 2))
            i += 2
            continue
        raw, i = _extract(text, i, cunescape, relax, shell_quoted)
        words.append(Word(raw.decode("utf-8", "surrogateescape"), start, i))


# ---------------------------------------------------------------------------------------------
# What the program receives: specifiers at load time, then variables at exec time.


def resolve_specifiers(value: str) -> str:
    """unit_full_printf() for `%%` (a `%` specifier that needs the host, e.g. %H, is kept as written)."""
    return re.sub(r"%(.)", lambda m: "%" if m.group(1) == "%" else m.group(0), value, flags=re.S)


def replace_env(word: str, env: Mapping[str, str]) -> str:
    """replace_env() without REPLACE_ENV_ALLOW_BRACELESS: `${NAME}` expands (unset: empty), `$$` is `$`;
    `$NAME` inside a word, `${NAME:-x}` and an unterminated `${` stay as written."""
    out: list[str] = []
    i, n = 0, len(word)
    while i < n:
        if word[i] != "$" or i + 1 >= n:
            out.append(word[i])
            i += 1
            continue
        nxt = word[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            j = i + 2
            while j < n and word[j] not in "}:":
                j += 1
            if j < n and word[j] == "}":
                out.append(env.get(word[i + 2 : j], ""))
                i = j + 1
            else:  # `${NAME:...` (no extended syntax here) or unterminated: literal up to here
                out.append(word[i : j + 1])
                i = j + 1
        else:
            out.append("$")
            i += 1
    return "".join(out)


def expand_argv(words: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """replace_env_argv(): a word that is `$NAME` becomes the variable split at whitespace (quotes
    removed; zero words when unset or empty); every other word expands `${NAME}` and `$$` in place."""
    argv: list[str] = []
    for word in words:
        if word.startswith("$") and word[1:2] not in ("{", "$"):
            value = env.get(word[1:])
            if value is not None:
                argv.extend(w.value for w in split_words(value, cunescape=False, relax=True))
            continue
        argv.append(replace_env(word, env))
    return argv


def exec_argv(words: Sequence[Word], env: Mapping[str, str], expand: bool = True) -> list[str]:
    """The argv systemd executes for these ExecStart= words (`expand=False`: the `:` prefix)."""
    values = [resolve_specifiers(w.value) for w in words if not w.separator]
    return expand_argv(values, env) if expand else values


def parse_environment_words(value: str, shell_quoted: bool = False) -> dict[str, str]:
    """`NAME=value` words (Environment=, or `systemctl show -p Environment` with shell_quoted); others are
    ignored as systemd ignores an invalid assignment."""
    result: dict[str, str] = {}
    for word in split_words(value, shell_quoted=shell_quoted):
        name, eq, val = word.value.partition("=")
        if eq and ENV_NAME.fullmatch(name):
            result[name] = val
    return result


# ---------------------------------------------------------------------------------------------
# EnvironmentFile= files: systemd's parse_env_file_internal() state machine (systemd 252).


def parse_env_file(text: str) -> list[tuple[str, str]]:
    """Assignments of an EnvironmentFile= in order. Shell-like but not a shell: `#`/`;` comment lines (a
    comment ending in a backslash swallows the next line, as systemd 252 does), `'...'` literal,
    `"..."` with `\\"` `\\\\` `\\$` `` \\` `` escapes, a backslash-newline joins lines, trailing blanks of an
    unquoted value are dropped. An invalid name (`export X=1`, `bad name=1`) is ignored, as systemd does.
    Long because it is systemd's EnvironmentFile= state machine (quotes, escapes, continuations, comments)
    kept as one loop to compare with systemd's own."""
    pairs: list[tuple[str, str]] = []
    state = "pre_key"
    key: list[str] = []
    value: list[str] = []
    key_ws = value_ws = -1  # where trailing whitespace starts, -1: none

    def push() -> None:
        k = "".join(key[:key_ws] if key_ws >= 0 else key)
        v = "".join(value)
        if ENV_NAME.fullmatch(k):
            pairs.append((k, v))

    for c in text + "\n":  # EOF pushes like a newline does
        if state == "pre_key":
            if c in "#;":
                state = "comment"
            elif c not in WHITESPACE:
                state, key, key_ws = "key", [c], -1
        elif state == "key":
            if c in NEWLINE:
                state = "pre_key"
            elif c == "=":
                state, value, value_ws = "pre_value", [], -1
            else:
                if c not in WHITESPACE:
                    key_ws = -1
                elif key_ws < 0:
                    key_ws = len(key)
                key.append(c)
        elif state == "pre_value":
            if c in NEWLINE:
                push()
                state = "pre_key"
            elif c == "'":
                state = "single"
            elif c == '"':
                state = "double"
            elif c == "\\":
                state = "value_escape"
            elif c not in WHITESPACE:
                state = "value"
                value.append(c)
        elif state == "value":
            if c in NEWLINE:
                if value_ws >= 0:
                    del value[value_ws:]
                push()
                state = "pre_key"
            elif c == "\\":
                state, value_ws = "value_escape", -1
            else:
                if c not in WHITESPACE:
                    value_ws = -1
                elif value_ws < 0:
                    value_ws = len(value)
                value.append(c)
        elif state == "value_escape":
            state = "value"
            if c not in NEWLINE:
                value.append(c)
        elif state == "single":
            if c == "'":
                state = "pre_value"
            else:
                value.append(c)
        elif state == "double":
            if c == '"':
                state = "pre_value"
            elif c == "\\":
                state = "double_escape"
            else:
                value.append(c)
        elif state == "double_escape":
            state = "double"
            if c in '"\\`$':
                value.append(c)
            elif c != "\n":
                value += ["\\", c]
        elif state == "comment":
            if c == "\\":
                state = "comment_escape"
            elif c in NEWLINE:
                state = "pre_key"
        elif state == "comment_escape":
            state = "comment"
    if state in ("single", "double", "double_escape"):  # unterminated quote at EOF: systemd keeps it
        push()
    return pairs


# ---------------------------------------------------------------------------------------------
# Writing values back.


def quote_exec_word(value: str) -> str:
    """Quote one argument for ExecStart= so systemd hands the program exactly `value`.

    `%` becomes `%%` (specifiers) and `$` becomes `$$` (environment expansion); control
    characters are C-escaped, so a value can never end the line or start a new directive.
    """
    _refuse_nul(value)
    escaped = _c_escape(value.replace("%", "%%").replace("$", "$$"))
    if escaped and re.fullmatch(r"[A-Za-z0-9_@%+=:,./$-]+", escaped) and escaped != ";":
        return escaped
    return f'"{escaped}"'


def exec_word_value(value: str) -> str:
    """What split_words() gives back for quote_exec_word(value)."""
    return value.replace("%", "%%").replace("$", "$$")


def quote_env_assignment(name: str, value: str) -> str:
    """One Environment= item: `"NAME=value"` (specifiers are expanded there too, `$` is not)."""
    if not ENV_NAME.fullmatch(name):
        raise UnitError(f"invalid environment variable name {name!r}")
    _refuse_nul(value)
    escaped = _c_escape(value.replace("%", "%%"))
    item = f"{name}={escaped}"
    return item if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]*", item) else f'"{item}"'


def _refuse_nul(value: str) -> None:
    if "\0" in value:
        raise UnitError("a NUL character cannot be passed in an argument or environment variable")


_C_QUOTES = {v: k for k, v in _C_ESCAPES.items() if k not in ("s", "a", "b", "f", "v")}


def _c_escape(value: str) -> str:
    out = []
    for ch in value:
        if ch in _C_QUOTES:
            out.append("\\" + _C_QUOTES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def resolve_escapes(value: str) -> str:
    """What the program receives for a word without specifiers or variables: `%%`->`%`, `$$`->`$`."""
    return re.sub(r"%%|\$\$", lambda m: m.group(0)[0], value)
