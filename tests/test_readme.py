"""The README's commands and .ci/run stay in step."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def readme_commands() -> list[str]:
    return re.findall(r"```sh\n(.+?)\n```", read("README.md"))


def test_ci_runs_exactly_the_readme_test_command() -> None:
    demo, tests = readme_commands()[:2]
    assert "mdp demo" in demo
    assert "pytest" in tests
    assert tests in read(".ci/run").splitlines()
