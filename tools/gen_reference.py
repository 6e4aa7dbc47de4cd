"""Writes the generated parts of the docs' reference pages from the code, so they cannot drift.

* ``docs/reference/configuration.md``: every setting of the TOML file, from the config's own
  dataclasses (``pg2delta.config``: fields, types, defaults and the comments beside them), the
  environment variables and flags that override them, and the two example files in ``conf/``.
* ``docs/reference/exit-codes.md``: every exit code and error kind, from ``pg2delta.errors``
  (the constants and the comments beside them).
* ``docs/reference/cli.md``: every command and flag, from the CLI's own parser (``pg2delta.cli``).

Only the text between ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` is written; the
rest of each page is prose kept by hand. ``make docs-reference`` writes them; ``--check`` (run by
``make docs``, and ``tests/test_docs.py`` checks the same) exits 1 when a page is not current.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

from pg2delta import cli, config, delta_features, errors

ROOT = Path(__file__).resolve().parent.parent
CONFIG_PAGE = ROOT / "docs" / "reference" / "configuration.md"
EXIT_PAGE = ROOT / "docs" / "reference" / "exit-codes.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
EXAMPLES = (ROOT / "conf" / "embedded.toml", ROOT / "conf" / "spark.toml")
_REGION = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def source_comments(source: str) -> dict[str, str]:
    """Per name assigned or declared at the start of a line: the comment beside it, else the lines just above it."""
    comments: dict[str, str] = {}
    above: list[str] = []
    name: str | None = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if name is not None:  # beside the name, on its line: it wins over the lines above
                comments[name] = text
                above, name = [], None
            else:
                above.append(text)
        elif tok.type == tokenize.NAME and name is None and tok.start[1] == _indent(tok.line):
            name = tok.string
        elif tok.type in (tokenize.NEWLINE, tokenize.NL):
            if name is not None:
                if above:
                    comments.setdefault(name, " ".join(above))
                above, name = [], None
            elif tok.type == tokenize.NL and not tok.line.strip():
                above = []  # a blank line ends a comment block
    return comments


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def example_comments() -> dict[tuple[str, str], str]:
    """``(section, key)`` -> the comment beside the key in the example files (commented-out keys too)."""
    found: dict[tuple[str, str], str] = {}
    for path in EXAMPLES:
        section = ""
        last: tuple[str, str] | None = None
        for raw in path.read_text().splitlines():
            line = raw[2:] if re.match(r'^# (\[|"?[\w.]+"?\s*=)', raw) else raw  # a commented-out example
            head = re.match(r"^\[(?P<s>[^\]]+)\]", line)
            item = re.match(r'^"?(?P<k>[\w.]+)"?\s*=\s*[^#]*?(#\s*(?P<c>.*))?$', line)
            more = re.match(r"^#?\s+#\s*(?P<c>\S.*)$", line)  # continues the comment beside the key above
            if head:
                section, last = ("tables" if head["s"].startswith("tables.") else head["s"]), None
            elif item:
                last = (section, item["k"])
                if item["c"] and last not in found:
                    found[last] = item["c"].strip()
                else:
                    last = None
            elif more and last is not None:
                found[last] += " " + more["c"].strip()
            else:
                last = None
    return found


def subcommands() -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """``pg2delta``'s commands: name -> (its help, its parser), in the order ``--help`` lists them."""
    parser = cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return {name: (helps.get(name, ""), sub) for name, sub in action.choices.items()}
    return {}


def cli_options() -> dict[str, str]:
    """A flag's destination (``create_slot``) -> the flag (``--create-slot``), over every command."""
    found: dict[str, str] = {}
    for _help, sub in subcommands().values():
        for action in sub._actions:
            longest = max(action.option_strings, key=len, default="")
            if longest.startswith("--") and longest != "--help":
                found.setdefault(action.dest, longest)
    return found


def cli_commands() -> str:
    commands = subcommands()
    per_command = {name: [a for a in sub._actions if a.option_strings and "--help" not in a.option_strings]
                   for name, (_text, sub) in commands.items()}
    # The flags every command takes the same way are listed once.
    shared = [a for a in next(iter(per_command.values()), []) if all(
        any(b.option_strings == a.option_strings and b.help == a.help for b in actions) for actions in per_command.values()
    )]
    lines = ["## Every command", "", *_flag_table(shared)]
    names = {tuple(a.option_strings) for a in shared}
    for name, (text, _sub) in commands.items():
        own = [a for a in per_command[name] if tuple(a.option_strings) not in names]
        lines += ["", f"## `pg2delta {name}`", "", _sentence(text), ""]
        lines += _flag_table(own) if own else ["No flags but those of every command."]
    return "\n".join(lines) + "\n"


def _flag_table(actions: list[argparse.Action]) -> list[str]:
    lines = ["| flag | value | default | meaning |", "|---|---|---|---|"]
    for action in actions:
        flags = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs == 0:
            value = ""
        elif action.choices:
            value = " \\| ".join(f"`{c}`" for c in action.choices)
        else:
            value = f"`{action.metavar or action.dest.upper()}`"
        if action.required:
            value = (value + " (required)").strip()
        default = action.default
        hidden = default is None or default is False or default == [] or default == argparse.SUPPRESS
        shown = "" if hidden else f"`{default}`"
        lines.append(f"| {flags} | {value} | {shown} | {_sentence(_cell(action.help or ''))} |")
    return lines


def _cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped, angle brackets shown rather than taken as HTML."""
    parts = re.split(r"(`[^`]*`)", text.replace("|", "\\|"))
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in parts)


def _sentence(text: str) -> str:
    text = text.strip()
    return text + ("" if not text or text.endswith(".") else ".")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _toml_value(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int):
        size = f" ({value >> 20} MiB)" if value >= 1 << 20 and value % (1 << 20) == 0 else ""
        return f"`{value}`{size}"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, tuple | list):
        return "`[" + ", ".join(f'"{v}"' for v in value) + "]`"
    return f"`{value!r}`"


_TYPES = {"str": "string", "int": "integer", "bool": "boolean", "tuple[str, ...]": "list of strings",
          "tuple[tuple[str, str], ...]": "table of `delta.*` properties"}


def _type(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "")
    if text in _TYPES:
        return _TYPES[text]
    if text.endswith(" | None"):
        return _TYPES.get(text[: -len(" | None")], text) + " (optional)"
    return text


@dataclasses.dataclass(frozen=True)
class Setting:
    section: str  # "source", "lake", "engine", "window", "maintain", 'tables."schema.table"'
    key: str
    type: str
    default: str
    description: str
    allowed: tuple[str, ...] = ()
    env: str = ""
    flag: str = ""


def _describe(cls: type, section: str, names: dict[str, str] | None = None) -> list[Setting]:
    """The settings of one section, from its dataclass (``names`` renames fields to their TOML keys)."""
    comments = source_comments(inspect.getsource(cls))
    examples = example_comments()
    env = {(s, k): var for var, (s, k, _t) in config._ENV.items()}
    options = cli_options()
    flags = {(s, k): options[flag] for flag, (s, k) in config._FLAGS.items() if flag in options}
    modes: dict[str, tuple[str, ...]] = {**config._TABLE_MODES, "history": config.HISTORY_MODES, "deletes": delta_features.DELETE_MODES}
    if section == "engine":
        modes = {"kind": tuple(config.ENGINES)}
    out = []
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        key = (names or {}).get(f.name, f.name)
        where = "tables" if section.startswith("tables") else section
        text = comments.get(f.name) or examples.get((where, key), "")
        out.append(
            Setting(
                section=section, key=key, type=_type(f.type), default=_toml_value(_default(f)),
                description=text, allowed=modes.get(key, ()), env=env.get((where, key), ""),
                flag=flags.get((where, key), ""),
            )
        )
    return out


def settings() -> list[Setting]:
    """Every setting of the configuration file, section by section."""
    lake = {"lake_root": "root", "changelog": "changelog", "history": "history", "deletion_vectors": "deletion_vectors",
            "hash_key_env": "hash_key_env", "hash_key_file": "hash_key_file"}
    engine = config.Config().engine.__class__
    # EngineConfig.deletion_vectors is set from [lake] deletion_vectors, listed there.
    engine_keys = {f.name: f.name for f in dataclasses.fields(engine) if f.name != "deletion_vectors"}
    found = [
        *_describe(config.SourceConfig, "source"),
        *_describe(config.Config, "lake", lake),
        *_describe(config.StorageConfig, "lake"),
        *_describe(delta_features.FeatureSettings, "lake", {k: k for k in delta_features.LAKE_KEYS}),
        *_describe(delta_features.RowSettings, "lake"),
        *_describe(engine, "engine", engine_keys),
        *_describe(config.WindowConfig, "window"),
        *_describe(config.MaintainConfig, "maintain"),
        *_describe(config.TableConfig, 'tables."schema.table"', {f.name: f.name for f in dataclasses.fields(config.TableConfig) if f.name not in ("delta", "rows")}),
        *_describe(delta_features.FeatureSettings, 'tables."schema.table"'),
        *_describe(delta_features.RowSettings, 'tables."schema.table"'),
    ]
    for s in found:
        if s.section == "engine" and s.key == "spark_conf":
            found[found.index(s)] = dataclasses.replace(s, key="spark_conf", type='table of strings ([engine.spark_conf])', default="`{}`")
    return found


def config_tables() -> str:
    lines: list[str] = []
    section = None
    for s in settings():
        if s.section != section:
            section = s.section
            lines += ["", f"### `[{section}]`", "", "| key | type | default | overridden by | meaning |", "|---|---|---|---|---|"]
        over = ", ".join(f"`{x}`" for x in (s.env, s.flag) if x) or "—"
        meaning = _sentence(_cell(s.description)) or "(undocumented)"
        if s.allowed:
            meaning += " One of " + ", ".join(f'`"{v}"`' for v in s.allowed) + "."
        lines.append(f"| `{s.key}` | {s.type} | {s.default} | {over} | {meaning} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def config_examples() -> str:
    out = []
    for path in EXAMPLES:
        out += [f"`{path.relative_to(ROOT)}`:", "", "```toml", path.read_text().rstrip("\n"), "```", ""]
    return "\n".join(out)


def exit_code_constants() -> list[tuple[int, str, str]]:
    """``(code, constant, comment)`` of every ``EXIT_*`` constant in pg2delta.errors, by code."""
    comments = source_comments(inspect.getsource(errors))
    found = [
        (value, name, comments.get(name, ""))
        for name, value in vars(errors).items()
        if name.startswith("EXIT_") and isinstance(value, int) and not isinstance(value, bool)
    ]
    return sorted(found)


def exit_tables() -> str:
    lines = ["| code | constant in `pg2delta.errors` | meaning there |", "|---|---|---|"]
    for code, name, comment in exit_code_constants():
        lines.append(f"| {code} | `{name}` | {_sentence(_cell(comment))} |")
    kinds = source_comments(inspect.getsource(errors.ErrorKind))
    lines += ["", "| error kind (`pg2delta: <kind> error: ...`) | what failed | exit code |", "|---|---|---|"]
    for kind in errors.ErrorKind:
        code = errors.EXIT_CODES[kind]
        lines.append(f"| `{kind.value}` | {_sentence(_cell(kinds.get(kind.name, '')))} | {code} |")
    lines += ["", f"An error a retry can help with (`retryable`, such as a lost connection) exits {errors.EXIT_RETRYABLE}, whatever its kind."]
    reserved = ", ".join(str(c) for c in sorted(errors.RESERVED_EXIT_CODES))
    lines += ["", f"`--idle-exit-code` refuses {reserved} (exit {errors.EXIT_NEEDS_HUMAN}): an idle run must not look like a failure."]
    return "\n".join(lines) + "\n"


GENERATORS = {
    "config-tables": config_tables, "config-examples": config_examples, "exit-codes": exit_tables, "cli": cli_commands,
}


PAGES = (CONFIG_PAGE, EXIT_PAGE, CLI_PAGE)


def render(text: str) -> str:
    """``text`` with every generated region written anew."""

    def fill(m: re.Match[str]) -> str:
        return m[1] + GENERATORS[m["name"]]() + m[4]

    return _REGION.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when a page is not current; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for page in PAGES:
        old = page.read_text()
        new = render(old)
        if new != old:
            stale.append(page)
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print("not current (run make docs-reference): " + ", ".join(str(p.relative_to(ROOT)) for p in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
