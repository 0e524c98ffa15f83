"""The docs site's generated reference pages: the ``nanguard`` command, read from the argparse
parsers that ``nanguard.cli.main`` builds, and the settings, read from the fields of
``nanguard.config.Settings`` and the text each field carries.

mkdocs runs this file as a hook (``hooks:`` in mkdocs.yml), so the pages are made again at every
build and cannot drift from the code. ``python docs/gen_ref.py DIR`` writes them into DIR, to read
them without building the site.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
from collections.abc import Iterator

CLI_PAGE = "reference/cli.md"
SETTINGS_PAGE = "reference/settings.md"
_USAGE_COLUMNS = "100"
"""argparse wraps usage lines to $COLUMNS: fixed, so a build does not depend on the terminal"""


def on_files(files, config):
    """mkdocs hook: add the generated pages to the site's files before the nav is built."""
    from mkdocs.structure.files import File

    for uri, text in pages().items():
        files.append(File.generated(config, uri, content=text))
    return files


def pages() -> dict[str, str]:
    return {CLI_PAGE: cli_page(), SETTINGS_PAGE: settings_page()}


def markdown(text: str) -> str:
    """Help text as Markdown: RST ``literals`` become `code`; a table cell's bars are escaped."""
    return re.sub(r"``(.+?)``", r"`\1`", text).replace("|", "\\|")


def _code(value: str) -> str:
    fence = "``" if "`" in value else "`"
    return f"{fence}{value}{fence}"


# --- the nanguard command ------------------------------------------------------------------------


class _Caught(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


@contextlib.contextmanager
def _parsers_caught() -> Iterator[None]:
    """While inside, the first parser asked to read arguments raises ``_Caught`` instead: the
    parser as ``nanguard.cli`` builds it, whatever shape that code takes, and nothing is run."""
    original = argparse.ArgumentParser.parse_known_args

    def catch(self, args=None, namespace=None):
        raise _Caught(self)

    argparse.ArgumentParser.parse_known_args = catch
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original


def _parser_for(argv: list[str]) -> argparse.ArgumentParser:
    from nanguard import cli

    with _parsers_caught():
        try:
            cli.main(argv)
        except _Caught as caught:
            return caught.parser
    raise RuntimeError(f"nanguard {' '.join(argv)} read its arguments without argparse: "
                       "docs/gen_ref.py cannot document it")


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, the parser that reads its arguments) for every subcommand."""
    found = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, sub in action.choices.items():
            own = _parser_for([name, "ARG"])  # a subcommand may read its arguments with a parser of its own
            found.append((name, helps.get(name, ""), sub if own.prog == parser.prog else own))
    return found


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            metavar = "" if action.nargs == 0 else " " + formatter._format_args(action, action.dest.upper())
            name = ", ".join(_code(option + metavar) for option in action.option_strings)
        else:
            name = _code(formatter._metavar_formatter(action, action.dest)(1)[0])
        default = action.default
        if action.required:
            shown = "required"
        elif default in (None, argparse.SUPPRESS) or action.nargs == 0:
            shown = ""
        elif default == "":
            shown = "empty"
        else:
            shown = _code(str(default))
        rows.append(f"| {name} | {shown} | {markdown(formatter._expand_help(action)) if action.help else ''} |")
    if not rows:
        return []
    return ["| option | default | what it does |", "|---|---|---|", *rows, ""]


def _prose(parser: argparse.ArgumentParser, text: str | None) -> list[str]:
    if not text:
        return []
    if issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter):
        return ["```text", text.strip("\n"), "```", ""]
    return [re.sub(r"``(.+?)``", r"`\1`", text.strip()), ""]


def _command_section(title: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## `{title}`", ""]
    said = " ".join((parser.description or "").split()).lower()
    if summary and not said.startswith(summary.strip().rstrip(".").lower()):  # the description says it
        lines += [markdown(summary)[0].upper() + markdown(summary)[1:].rstrip(".") + ".", ""]
    lines += _prose(parser, parser.description)
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    lines += _options_table(parser)
    lines += _prose(parser, parser.epilog)
    return lines


def cli_page() -> str:
    with _columns(_USAGE_COLUMNS):
        top = _parser_for(["demo"])
        lines = ["# The `nanguard` command", "",
                 ("Generated from the command's own argument parsers when the site is built "
                  "(`docs/gen_ref.py`): what `nanguard COMMAND --help` says, as a page."), ""]
        lines += _command_section(top.prog, "", top)
        for name, summary, parser in _subcommands(top):
            lines += _command_section(f"{top.prog} {name}", summary, parser)
    return "\n".join(lines).rstrip() + "\n"


@contextlib.contextmanager
def _columns(width: str) -> Iterator[None]:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


# --- the settings ---------------------------------------------------------------------------------


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if value is None:
        return "none"
    if value in ((), ""):
        return "empty"
    return _code(str(value))


def _settings_table(cls: type, keyword: bool) -> list[str]:
    from nanguard.config import _variable

    head = "| `init` keyword | variable | default | type | what it does |" if keyword else \
        "| variable | default | what it does |"
    lines = [head, "|---|---|---|---|---|" if keyword else "|---|---|---|"]
    for field in dataclasses.fields(cls):
        doc = markdown(field.metadata.get("doc", ""))
        variable = _code(_variable(field.name))
        if keyword:
            lines.append(f"| `{field.name}` | {variable} | {_default(field)} | "
                         f"{_code(str(field.type).replace(' | ', ' or '))} | {doc} |")
        else:
            lines.append(f"| {variable} | {_default(field)} | {doc} |")
    return lines + [""]


def _paragraph(text: str | None) -> str:
    return re.sub(r"``(.+?)``", r"`\1`", " ".join((text or "").split()))


def settings_page() -> str:
    from nanguard import config

    lines = ["# Settings reference", "",
             ("Generated from `nanguard.config.Settings` when the site is built (`docs/gen_ref.py`): "
              "every field, its `NANGUARD_*` environment variable, its default and the text the field "
              "carries in the code. [Settings](../settings.md) says how values are chosen and checked."), "",
             _paragraph(config.Settings.__doc__), "",
             _paragraph((config.__doc__ or "").strip().split("\n\n", 1)[-1]), "",
             "## A guard's settings", ""]
    lines += _settings_table(config.Settings, keyword=True)
    daemon = getattr(config, "_DaemonSettings", None)
    if daemon is not None:
        lines += ["## Read by the coordinator and the operator commands only", "",
                  _paragraph(daemon.__doc__), ""]
        lines += _settings_table(daemon, keyword=False)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python docs/gen_ref.py DIR   (writes the generated reference pages into DIR)",
              file=sys.stderr)
        return 2
    for uri, text in pages().items():
        path = os.path.join(argv[0], uri)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
