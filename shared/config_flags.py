"""The config's two faces outside TOML files: command-line flags and the reference docs.

Both are derived from the schema in shared/config.py (every key's `Spec`):

    add_override_arguments(parser)                    the override flags, `--set KEY=VALUE`
    overrides_from_args(args)     -> {dotted: value}  what the user typed, checked
    reference_markdown() / write_docs(path)           the key tables of docs/configuration.md

`python -m moe_pipe.shared.config_flags --docs` regenerates those tables.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .config import SCHEMA, TABLES, Key, _check, _fail, _Invalid, _known, toml_repr
from .errors import ConfigError

# ---------------------------------------------------------------- command line

SET_DEST = "config_set"


def add_override_arguments(parser: Any, tables: Iterable[str] | None = None) -> None:
    """Add the override flags of `tables` (default: all) and `--set KEY=VALUE` to an argparse parser.

    Every flag defaults to None (= not given), so the config's value stands unless typed.
    """
    wanted = set(TABLES if tables is None else tables)
    group = parser.add_argument_group("config overrides (win over the TOML file)")
    for key in SCHEMA:
        if key.table not in wanted or not key.spec.flags:
            continue
        help_text = f"{key.dotted}: {key.spec.doc}".replace("%", "%%")  # argparse formats help with %
        if key.spec.kind == "bool":
            if key.name == "no_think":
                group.add_argument("--no-think", dest=key.dest, action="store_const", const=True, default=None, help=help_text)
                group.add_argument(
                    "--think", dest=key.dest, action="store_const", const=False, default=None, help="undo no_think from the config"
                )
            else:
                flag = key.spec.flags[0]
                group.add_argument(flag, dest=key.dest, action="store_const", const=True, default=None, help=help_text)
                group.add_argument(
                    key.spec.off_flag or "--no-" + flag[2:],
                    dest=key.dest,
                    action="store_const",
                    const=False,
                    default=None,
                    help=f"turn {key.dotted} off",
                )
            continue
        metavar = "|".join(key.spec.choices) if key.spec.kind == "choice" else key.name.upper()
        group.add_argument(*key.spec.flags, dest=key.dest, default=None, metavar=metavar, help=help_text)
    group.add_argument(
        "--set",
        dest=SET_DEST,
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="set any config key, e.g. --set supervisor.start_secs=2 (VALUE in TOML syntax; bare text is a string)",
    )


def _parse_text(key: Key, text: str, flag: str) -> Any:
    """A typed value from what was typed after a flag."""
    s = key.spec
    if s.unset and text.lower() in ("none", "null", "unset"):
        return None
    try:
        if s.kind == "int":
            return int(text, 0)
        if s.kind == "float" or (s.kind == "mb" and text != "auto"):
            return float(text)
    except ValueError:
        raise _fail(flag, key, text, "wrong type, expected " + ("an integer" if s.kind == "int" else "a number")) from None
    return text


def _parse_set(item: str) -> tuple[str, Any]:
    dotted, eq, text = item.partition("=")
    dotted = dotted.strip()
    if not eq or not dotted:
        raise ConfigError(f"--set {item}: expected TABLE.KEY=VALUE, e.g. --set cache.cache_mb=512")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # bare text: a string (paths need no quotes)
    return dotted, value


def overrides_from_args(args: Any) -> dict[str, Any]:
    """{dotted key: typed value} for every override flag given on the command line; --set last."""
    out: dict[str, Any] = {}
    for key in SCHEMA:
        raw = getattr(args, key.dest, None) if key.spec.flags else None
        if raw is None:
            continue
        flag = "/".join(key.spec.flags)
        value = _parse_text(key, raw, flag) if isinstance(raw, str) else raw
        try:
            out[key.dotted] = _check(key, value)
        except _Invalid as exc:
            raise _fail(flag, key, value, exc.problem) from None
    for item in getattr(args, SET_DEST, None) or ():  # checked here too, so every error says "--set"
        dotted, value = _parse_set(item)
        key = _known(dotted, "--set")
        if isinstance(value, str) and key.spec.kind in ("int", "float", "mb"):
            value = _parse_text(key, value, "--set")
        try:
            out[key.dotted] = _check(key, value)
        except _Invalid as exc:
            raise _fail("--set", key, value, exc.problem) from None
    return out


# ---------------------------------------------------------------- docs

DOCS_BEGIN = "<!-- BEGIN SCHEMA (generated by `python -m moe_pipe.shared.config_flags --docs`; do not edit) -->"
DOCS_END = "<!-- END SCHEMA -->"


def _default_text(key: Key) -> str:
    if key.default is None:
        return f"unset ({key.spec.unset})"
    return f"`{toml_repr(key.default)}`"


def reference_markdown() -> str:
    """The key reference for docs/configuration.md, one table per TOML table."""
    lines = [DOCS_BEGIN]
    for table, cls in TABLES.items():
        lines += [
            "",
            f"### [{table}]",
            "",
            (cls.__doc__ or "").strip(),
            "",
            "| key | type | default | allowed | flag | meaning |",
            "|---|---|---|---|---|---|",
        ]
        for key in (k for k in SCHEMA if k.table == table):
            flags = ", ".join(f"`{f}`" for f in key.spec.flags) or f"`--set {key.dotted}=`"
            if key.name == "no_think":
                flags += ", `--think`"
            elif key.spec.kind == "bool" and key.spec.flags:
                flags += f", `{key.spec.off_flag or '--no-' + key.spec.flags[0][2:]}`"
            allowed = key.allowed_text().replace("|", "\\|")
            lines.append(f"| `{key.name}` | {key.type_text()} | {_default_text(key)} | {allowed} | {flags} | {key.spec.doc} |")
    lines += ["", DOCS_END]
    return "\n".join(lines)


def write_docs(path: Path) -> bool:
    """Replace the generated block in `path`; True when the file changed."""
    text = path.read_text(encoding="utf-8")
    start, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    new = text[:start] + reference_markdown() + text[end:]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--docs"]:
        target = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
        print(f"{target}: {'updated' if write_docs(target) else 'already current'}")
    else:
        print(reference_markdown())
