"""The README's first two commands are the ones a new user types: `make demo` works as written (the suite itself is
the second, `make test`, which CI runs through .ci/run on a fresh clone with no .venv)."""
from __future__ import annotations

import os
import re
import subprocess

from conftest import REPO


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_opens_with_demo_and_test_commands():
    assert readme_commands() == ["make demo", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text().splitlines()[-1]


def test_make_demo_answers_as_the_readme_shows():
    # as typed at a shell: not inside the `make test` that may be running this suite
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    result = subprocess.run(["make", "demo"], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "The capital of France is Paris."
    if len(os.sched_getaffinity(0)) < 3:  # the demo's 3 eager ranks outnumber the cores: said at start
        assert "3 ranks share this machine's" in result.stderr
