"""The documentation: the site builds with ``mkdocs build --strict`` (no dead link, no missing page,
no unknown anchor), its generated reference pages cover the code, and the README stays a front page
whose relative links lead somewhere."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FRONT_PAGES = ("README.md", "SECURITY.md", "CONTRIBUTING.md", "CHANGELOG.md")
README_MAX_LINES = 250
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _gen_ref():
    spec = importlib.util.spec_from_file_location("gen_ref", ROOT / "docs" / "gen_ref.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _slug(heading: str) -> str:
    """The anchor mkdocs' toc extension gives a heading (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+?)\s*$", text, flags=re.MULTILINE)}


def _relative_links(path: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", FRONT_PAGES)
def test_every_relative_link_of_a_front_page_leads_to_a_file(page):
    path = ROOT / page
    dead = []
    for link in _relative_links(path):
        target, _, anchor = link.partition("#")
        found = (path.parent / target).resolve()
        if not found.exists():
            dead.append(f"{link} (no such file)")
        elif anchor and found.suffix == ".md" and anchor not in _anchors(found):
            dead.append(f"{link} (no heading with that anchor)")
    assert not dead, f"{page}: dead links: {', '.join(dead)}"


def test_the_readme_is_a_front_page_that_says_how_to_run_and_test():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "the README is a front page: details go to docs/"
    for command in ("make demo", "make test", "make docs", "pip install nanguard"):
        assert command in readme, f"the README no longer says {command!r}"


def test_the_generated_reference_covers_every_setting_and_command():
    from nanguard.config import Settings

    pages = _gen_ref().pages()
    settings, cli = pages["reference/settings.md"], pages["reference/cli.md"]
    for field in Settings.__dataclass_fields__:
        assert f"| `{field}` | `NANGUARD_{field.upper()}` |" in settings, field
    for command in ("demo", "coordinator", "status", "stop", "clear", "keys", "inspect"):
        assert f"## `nanguard {command}`" in cli, command
    for option in ("--bind", "--metrics-host", "--dead-after-s", "--stall-after-s", "--count-skipped",
                   "--timeout-s", "--reason", "--plot", "--on-restart"):
        assert f"`{option} " in cli or f"`{option}`" in cli, option
    prose = re.sub(r"```.*?```", "", settings + cli, flags=re.DOTALL)
    assert not re.search(r"``\w", prose), "RST ``literals`` must render as Markdown code"


def _mkdocs() -> list[str]:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        message = "mkdocs-material is not installed (pip install -e '.[docs]'; make test installs it)"
        if os.environ.get("CI_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return [sys.executable, "-m", "mkdocs"]


def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    command = [*_mkdocs(), "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "nanguard coordinator" in cli and "--stall-after-s" in cli
    assert "NANGUARD_ON_NAN" in (site / "reference" / "settings" / "index.html").read_text()
