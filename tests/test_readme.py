"""The README's commands and .ci/run stay in step.

Every other command of the README and of docs/ is run (or listed as one that
cannot be, with the reason) by tests/test_docs_commands.py.
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def readme_commands() -> list[str]:
    """The bodies of the README's ```sh blocks, in order."""
    return re.findall(r"^```sh\n(.*?)\n```", read("README.md"), re.M | re.S)


def test_ci_runs_exactly_the_readme_test_command() -> None:
    demo, tests = readme_commands()[:2]
    assert "\n" not in demo and "\n" not in tests, "the first two blocks are one command each"
    assert "mdp demo" in demo
    assert "pytest" in tests
    assert tests in read(".ci/run").splitlines()


def test_the_demo_and_test_commands_come_first() -> None:
    """The first screen: the demo and the test command, before any other block."""
    text = read("README.md")
    first_fence = text.index("```")
    assert text[first_fence:].startswith("```sh\n" + readme_commands()[0])


def test_ci_says_how_long_it_took_however_it_ends() -> None:
    script = read(".ci/run")
    trap = re.search(r"^trap '(.*)' EXIT$", script, re.M)
    assert trap is not None and "in all" in trap.group(1)
    assert script.index("trap ") < script.index("pip install")


def test_the_readme_says_how_long_the_first_commands_take_and_to_activate_the_venv() -> None:
    text = read("README.md")
    first_screen = text[:text.index("## Install")]
    before_demo, before_tests = first_screen.split("```sh")[:2]
    assert re.search(r"about \d+ minutes on two cores", before_demo)
    assert re.search(r"about \d+ minutes on two cores", before_tests)
    assert "`. .venv/bin/activate`" in first_screen
